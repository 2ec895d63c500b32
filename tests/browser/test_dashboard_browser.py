"""The dashboard in a real browser against a real stack: sign in, create a sandbox
from the dashboard (a real VM boots), type ``echo hello-$RANDOM`` in the xterm.js
terminal and see the shell's output, pause (the terminal closes saying why and the
state changes without a reload), resume (the terminal re-attaches to the same
shell), visit every page, kill. A screenshot of every page is saved."""
import re

import pytest

from .conftest import PASSWORD

pytestmark = pytest.mark.vm

SANDBOX_URL = re.compile(r".*/dashboard/sandboxes/(i[a-z0-9]+)/$")


def shot(page, shots_dir, name: str) -> None:
    path = shots_dir / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")


def terminal_text(page) -> str:
    return page.eval_on_selector("[data-terminal-screen] .xterm-rows", "el => el.innerText")


def wait_badge(page, state: str, timeout: float = 120_000) -> None:
    page.wait_for_selector(f'[data-live-region="badge"] .badge-{state}', timeout=timeout)


def sign_in(page) -> None:
    page.goto("/dashboard/")
    assert "/dashboard/login/" in page.url
    page.fill("input[name=username]", "ada")
    page.fill("input[name=password]", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url("**/dashboard/")


def create_sandbox(page, metadata: str) -> str:
    """From the dashboard's New sandbox form; the page goes to the sandbox once it runs."""
    page.goto("/dashboard/sandboxes/")
    if not page.is_visible("[data-create-form]"):  # folded away once the team has sandboxes
        page.click("details.create-card summary")
    page.select_option("[data-create-form] select[name=template]", "base")
    page.fill("[data-create-form] input[name=metadata]", metadata)
    page.click("[data-create-form] button[data-action=create]")
    page.wait_for_url(SANDBOX_URL, timeout=300_000)
    wait_badge(page, "running")
    return SANDBOX_URL.match(page.url).group(1)


def type_line(page, line: str, expect: str) -> None:
    """Types ``line`` in the terminal once the prompt is there; waits for ``expect`` (a
    regex) alone on a line of the screen."""
    page.wait_for_selector('[data-terminal-status][data-status="connected"]', timeout=60_000)
    page.wait_for_function(
        "() => /\\$\\s*$/m.test(document.querySelector('[data-terminal-screen] .xterm-rows').innerText)",
        timeout=60_000)
    type_and_expect(page, line, expect)


def type_and_expect(page, line: str, expect: str) -> None:
    """Types ``line`` in the terminal as it is now; waits for ``expect`` (a regex) alone on a
    line of the screen."""
    page.click("[data-terminal-screen]")
    page.keyboard.type(line)
    page.keyboard.press("Enter")
    page.wait_for_function(
        "(re) => new RegExp(re, 'm').test(document.querySelector('[data-terminal-screen] .xterm-rows').innerText)",
        arg=f"^{expect}\\s*$", timeout=60_000)


def test_sign_in_terminal_pause_resume_kill(page, web_stack, shots_dir):
    page.on("dialog", lambda dialog: dialog.accept())  # the confirmations of pause and kill
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))

    # Sign in.
    page.goto("/dashboard/")
    assert "/dashboard/login/" in page.url
    shot(page, shots_dir, "01-login")
    page.fill("input[name=username]", "ada")
    page.fill("input[name=password]", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url("**/dashboard/")
    shot(page, shots_dir, "02-overview")

    # Create a sandbox from the dashboard: the page goes to it once the VM runs.
    page.click("nav a:has-text('Sandboxes')")
    page.wait_for_url("**/dashboard/sandboxes/")
    shot(page, shots_dir, "03-sandboxes-empty")
    page.select_option("[data-create-form] select[name=template]", "base")
    page.fill("[data-create-form] input[name=metadata]", "owner=ada")
    page.click("[data-create-form] button[data-action=create]")
    page.wait_for_url(SANDBOX_URL, timeout=300_000)
    sandbox_id = SANDBOX_URL.match(page.url).group(1)
    wait_badge(page, "running")

    # The terminal: a real shell in the VM.
    status = page.locator("[data-terminal-status]")
    page.wait_for_selector('[data-terminal-status][data-status="connected"]', timeout=60_000)
    pid = status.get_attribute("data-pid")
    assert status.inner_text() == f"connected · shell pid {pid}"
    type_line(page, "echo hello-$RANDOM", "hello-\\d+")
    assert re.search(r"^hello-\d+\s*$", terminal_text(page), re.M)  # output, not just the typed line
    shot(page, shots_dir, "04-sandbox-terminal")

    # A reload re-attaches to the same shell (its state is still there).
    type_line(page, "export MARK=$((6*7)); echo set-$MARK", "set-42")
    page.reload()
    page.wait_for_selector('[data-terminal-status][data-status="connected"]', timeout=60_000)
    assert status.inner_text() == f"connected · reattached to shell pid {pid}"
    page.click("[data-terminal-screen]")
    page.keyboard.type("echo mark-$MARK")
    page.keyboard.press("Enter")
    page.wait_for_function(
        "() => /^mark-42\\s*$/m.test(document.querySelector('[data-terminal-screen] .xterm-rows').innerText)",
        timeout=60_000)

    # Pause: confirmation, inline result, state changes live, terminal closes with a reason.
    page.click("button[data-action=pause]")
    page.wait_for_selector("[data-action-result][data-level=success]", timeout=300_000)
    assert f"Sandbox {sandbox_id} paused." in page.inner_text("[data-action-result]")
    wait_badge(page, "paused", timeout=30_000)
    page.wait_for_selector('[data-terminal-status][data-close-code="4409"]', timeout=30_000)
    assert "sandbox is paused: resume it to use the terminal" in status.inner_text()
    assert page.locator("button[data-action=resume]").is_visible()
    shot(page, shots_dir, "05-sandbox-paused")

    # Resume: the terminal re-attaches to the same shell (its memory was paused too).
    page.click("button[data-action=resume]")
    wait_badge(page, "running", timeout=300_000)
    page.wait_for_function(
        "() => /^connected · reattached to shell pid/.test(document.querySelector('[data-terminal-status]').innerText)",
        timeout=60_000)
    assert status.inner_text() == f"connected · reattached to shell pid {pid}"

    # Every other page, with the sandbox in it.
    page.goto("/dashboard/sandboxes/")
    page.wait_for_selector(f"text={sandbox_id}")
    assert "owner=ada" in page.inner_text("[data-sandbox-table]")
    shot(page, shots_dir, "06-sandboxes")
    for path, name in (("/dashboard/", "07-overview-busy"), ("/dashboard/snapshots/", "08-snapshots"),
                       ("/dashboard/templates/", "09-templates"), ("/dashboard/nodes/", "10-nodes"),
                       ("/dashboard/api-keys/", "11-api-keys")):
        page.goto(path)
        shot(page, shots_dir, name)
    page.goto("/admin/")
    shot(page, shots_dir, "12-admin-login")

    # Kill: the terminal closes saying so; the list shows it killed without a reload.
    page.goto(f"/dashboard/sandboxes/{sandbox_id}/")
    page.wait_for_selector('[data-terminal-status][data-status="connected"]', timeout=60_000)
    page.click("button[data-action=kill]")
    wait_badge(page, "killed", timeout=120_000)
    page.wait_for_selector('[data-terminal-status][data-status="closed"]', timeout=30_000)
    assert "sandbox was killed" in status.inner_text()
    shot(page, shots_dir, "13-sandbox-killed")
    assert errors == []
    assert web_stack.vm_leftovers()["processes"] == []


def test_snapshot_new_sandbox_from_it_and_fork(page, web_stack, shots_dir):
    """Snapshot a sandbox whose disk has a mark, fork it, start a sandbox from the
    snapshot on the Snapshots page: both children see the mark; the lineage shows it."""
    page.on("dialog", lambda dialog: dialog.accept())
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    sign_in(page)
    parent = create_sandbox(page, "role=parent")
    type_line(page, "echo kept-$((20+1)) > ~/mark && cat ~/mark", "kept-21")

    page.fill("input[name=name]", "golden")
    page.click("button[data-action=snapshot]")
    page.wait_for_selector("[data-action-result][data-level=success]", timeout=300_000)
    text = page.inner_text("[data-action-result]")
    snapshot = re.search(r"Snapshot (s[a-z0-9]+) of " + parent + " taken", text).group(1)

    page.fill("input[name=count]", "1")
    page.click("button[data-action=fork]")
    page.wait_for_function(
        "() => /Forked/.test(document.querySelector('[data-action-result]').innerText)", timeout=300_000)
    text = page.inner_text("[data-action-result]")
    assert page.get_attribute("[data-action-result]", "data-level") == "success", text
    fork = re.search(r"into 1: (i[a-z0-9]+)\.", text).group(1)
    page.wait_for_selector(f"a:has-text('{fork}')", timeout=30_000)  # the Forks fact, live

    page.goto("/dashboard/snapshots/")
    row = page.locator(f"tr[data-snapshot={snapshot}]")
    assert "golden" in row.inner_text() and "ready" in row.inner_text() and parent in row.inner_text()
    row.locator("button[data-action=create-from-snapshot]").click()
    page.wait_for_url(SANDBOX_URL, timeout=300_000)
    restored = SANDBOX_URL.match(page.url).group(1)
    assert restored not in (parent, fork)
    wait_badge(page, "running")
    assert snapshot in page.inner_text("[data-live-region=facts]")
    type_line(page, "cat ~/mark", "kept-21")
    shot(page, shots_dir, "14-sandbox-from-snapshot")

    page.goto(f"/dashboard/sandboxes/{fork}/")
    assert parent in page.inner_text("[data-live-region=facts]")  # forked from
    type_line(page, "cat ~/mark", "kept-21")

    page.goto("/dashboard/snapshots/")
    lineage = page.inner_text("[data-lineage]")
    assert lineage.index("base") < lineage.index(snapshot) < lineage.index(restored)
    assert parent in lineage and fork in lineage
    shot(page, shots_dir, "15-snapshots-lineage")
    # Deleting it while a sandbox started from it runs: the API's refusal, inline.
    page.click(f"tr[data-snapshot={snapshot}] button[data-action=delete-snapshot]")
    page.wait_for_selector("[data-action-result][data-level=error]", timeout=60_000)
    assert "Delete failed:" in page.inner_text("[data-action-result]")

    for sandbox_id in (restored, fork, parent):
        page.goto(f"/dashboard/sandboxes/{sandbox_id}/")
        page.click("button[data-action=kill]")
        wait_badge(page, "killed", timeout=120_000)
    page.goto("/dashboard/snapshots/")
    page.click(f"tr[data-snapshot={snapshot}] button[data-action=delete-snapshot]")
    page.wait_for_selector(f"tr[data-snapshot={snapshot}]", state="detached", timeout=120_000)
    assert errors == []
    assert web_stack.vm_leftovers()["processes"] == []
