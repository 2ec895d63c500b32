"""A template build's page in a real browser: while the test appends log entries to the
stack's database the way a node's builder does (``template_builds.progress``, from
another process), they appear on the open page without a reload, a hostile line shows
as text, and when the build finishes the badge turns ready and the log says complete.

Needs no VM: the stack runs daphne and the data plane only, and the build is registered
on a node row of its own (the builder is this test)."""
import textwrap
import uuid

import pytest

from harness.stack import Stack

from .conftest import dashboard_page, dashboard_stack
from .test_dashboard_browser import shot

PASSWORD = "pw-builds-" + uuid.uuid4().hex[:8]
NODE = "browser-builder"
HOSTILE = "<img src=x onerror=\"window.__pwned=1\">"

# Runs in the stack's own Django (manage.py shell): the node's heartbeat stays fresh, so
# the page's socket never takes the build for one whose node went away.
PRELUDE = textwrap.dedent(f"""
    from django.utils import timezone
    from nodes.models import Node
    from template_builds import progress
    Node.objects.update_or_create(id={NODE!r}, defaults=dict(
        address="127.0.0.1", vcpu_capacity=4, memory_mb_capacity=4096, last_heartbeat_at=timezone.now()))
""")


@pytest.fixture(scope="module")
def log_stack(chromium_path):
    with dashboard_stack("browser-builds", "grace", PASSWORD, with_node=False, with_lifecycle=False) as stack:
        yield stack


def builder(stack: Stack, code: str) -> str:
    """Runs ``code`` in the stack's Django, as the node's builder process would."""
    return stack.manage("shell", "-c", PRELUDE + textwrap.dedent(code))


def new_build(stack: Stack) -> str:
    out = builder(stack, f"""
        from sandboxes.models import Team, Template
        from template_builds.models import TemplateBuild
        from template_builds.transitions import transition_sync
        template = Template.objects.create(id="tbrowser", team=Team.objects.get(slug="default"), alias="web-app",
                                           public=False, image="")
        build = TemplateBuild.objects.create(template=template, from_image="python:3.11",
                                             steps=[{{"type": "RUN", "args": ["pip install flask"], "force": False}}])
        assert transition_sync(build.pk, "start", node_id={NODE!r}, started_at=timezone.now())
        assert progress.accept(build.pk, {NODE!r})
        assert progress.report(build.pk, "info", "[base] FROM python:3.11", step="base")
        print("BUILD", build.pk)
    """)
    return out.split("BUILD", 1)[1].split()[0]


@pytest.fixture
def page(browser, log_stack):
    with dashboard_page(browser, log_stack) as pg:
        yield pg


def log_texts(page) -> list[str]:
    return page.eval_on_selector_all("[data-log-lines] .log-message", "els => els.map(e => e.textContent)")


def test_log_lines_appear_live_and_the_build_ends(page, log_stack, shots_dir):
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    build_id = new_build(log_stack)

    response = page.goto("/dashboard/")
    # the page runs under the dashboard's policy (the page fixture fails on any violation)
    assert "script-src 'self'" in response.headers["content-security-policy"]
    page.fill("input[name=username]", "grace")
    page.fill("input[name=password]", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url("**/dashboard/")
    page.goto("/dashboard/templates/")
    shot(page, shots_dir, "20-templates")
    page.click("a[href='/dashboard/templates/tbrowser/']")
    shot(page, shots_dir, "21-template-detail")
    page.click(f"a[href='/dashboard/templates/tbrowser/builds/{build_id}/']")
    page.wait_for_selector('[data-log-status][data-status="open"]')
    assert log_texts(page) == ["[base] FROM python:3.11"]  # rendered with the page
    assert page.is_visible("[data-build-badge] .badge-building")

    # The builder appends while the page is open: the lines arrive over the socket.
    builder(log_stack, f"""
        assert progress.report({build_id!r}, "info", "[1] RUN pip install flask", step="1")
        assert progress.report({build_id!r}, "warn", {HOSTILE!r}, step="1")
    """)
    page.wait_for_function("() => document.querySelectorAll('[data-log-lines] .log-line').length === 3")
    assert log_texts(page) == ["[base] FROM python:3.11", "[1] RUN pip install flask", HOSTILE]
    assert page.locator("[data-log-lines] .log-line").nth(1).locator(".log-step").count() == 0  # already "[1] …"
    last = page.locator("[data-log-lines] .log-line").last
    assert last.get_attribute("class") == "log-line log-warn" and last.locator(".log-step").inner_text() == "[1]"
    assert page.locator("[data-log-lines] img").count() == 0 and page.evaluate("window.__pwned") is None
    assert page.is_visible("[data-build-badge] .badge-building")
    assert page.inner_text("[data-log-total]") == "3 entries"
    shot(page, shots_dir, "22-build-live")

    # It finishes: the closing line, the badge, the socket's normal close.
    builder(log_stack, f"""
        assert progress.finish({build_id!r}, progress.BuildResult(image="tbrowser-img", details={{"layers": [
            {{"step": "1", "type": "RUN", "key": "{'ab' * 32}", "size_bytes": 2048, "cached": False}}]}}))
    """)
    page.wait_for_selector('[data-log-status][data-status="done"]')
    assert log_texts(page)[-1].startswith("Build finished")
    assert page.locator("[data-build-badge] .badge-ready").count() == 2  # heading and facts
    assert page.is_visible("[data-build-finished-note]")
    page.click("[data-build-finished-note] a")  # reload: the layers are there now
    page.wait_for_selector("[data-layer-table]")
    assert "abababababab" in page.inner_text("[data-layer-table]")
    assert page.inner_text("[data-log-status]") == "complete"
    shot(page, shots_dir, "23-build-ready")
    assert errors == []


def test_the_dashboard_refuses_to_be_framed(log_stack, browser):
    """Another site's page framing the dashboard (clickjacking): the browser refuses it
    (CSP frame-ancestors 'none', X-Frame-Options DENY) and the frame shows nothing of it.
    The stack is asked for before the browser, so it is torn down after it: Playwright's
    sync API keeps an event loop running in this thread, and the stack's teardown (pyroute2)
    cannot run its own while it does."""
    context = browser.new_context()
    try:
        pg = context.new_page()
        blocked = []
        pg.on("console", lambda m: blocked.append(m.text) if "frame-ancestors" in m.text else None)
        pg.set_content(f'<iframe id="f" src="{log_stack.api_url}/dashboard/login/"></iframe>')
        for _ in range(100):  # up to 10 s for the frame's load to be refused
            if blocked:
                break
            pg.wait_for_timeout(100)
        assert blocked, "Chromium did not report the refused frame"
        assert pg.frame_locator("#f").locator("input[name=username]").count() == 0
    finally:
        context.close()
