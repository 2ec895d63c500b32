"""Browser security headers on the API's port (issue 21, item 10): the dashboard, the admin
and the E2B API answer with X-Frame-Options DENY, a Content-Security-Policy that forbids
framing and inline scripts, nosniff and a Referrer-Policy; and the dashboard has no inline
script or event handler the policy would block (the browser tests run it under the policy)."""
import re
from pathlib import Path

import pytest
from django.conf import settings

pytestmark = pytest.mark.django_db(transaction=True)

TEMPLATES = Path(settings.BASE_DIR) / "templates" / "dashboard"


def directives(response) -> dict[str, str]:
    policy = response.headers["Content-Security-Policy"]
    return {d.split()[0]: d.strip() for d in policy.split(";") if d.strip()}


def assert_browser_headers(response):
    assert response.headers["X-Frame-Options"] == "DENY"
    assert response.headers["X-Content-Type-Options"] == "nosniff"
    assert response.headers["Referrer-Policy"] == "same-origin"
    csp = directives(response)
    assert csp["frame-ancestors"] == "frame-ancestors 'none'"
    assert csp["script-src"] == "script-src 'self'"  # no 'unsafe-inline', no 'unsafe-eval'
    assert csp["connect-src"] == "connect-src 'self'" and csp["object-src"] == "object-src 'none'"
    assert csp["base-uri"] == "base-uri 'none'" and csp["form-action"] == "form-action 'self'"


def test_dashboard_pages_send_them(client, dash, mine):
    for path in ("/dashboard/", "/dashboard/sandboxes/", f"/dashboard/sandboxes/{mine.id}/", "/dashboard/nodes/"):
        response = dash.get(path)
        assert response.status_code == 200, path
        assert_browser_headers(response)


def test_the_login_page_admin_and_errors_send_them(client):
    for path, status in (("/dashboard/login/", 200), ("/admin/login/", 200), ("/dashboard/nope/", 404)):
        response = client.get(path)
        assert response.status_code == status, path
        assert_browser_headers(response)


async def test_the_json_api_sends_them(api, anon):
    for response in (await api.get("/sandboxes"), await anon.get("/sandboxes"), await api.get("/health")):
        assert response.headers["X-Content-Type-Options"] == "nosniff"
        assert response.headers["X-Frame-Options"] == "DENY"
        assert "frame-ancestors 'none'" in response.headers["Content-Security-Policy"]


def test_a_policy_from_the_settings(settings):
    from django.test import Client  # noqa: PLC0415 - the middleware reads the setting when the app loads

    settings.AENV_CONTENT_SECURITY_POLICY = "default-src 'none'; frame-ancestors 'none'"
    assert Client().get("/dashboard/login/").headers["Content-Security-Policy"] == (
        "default-src 'none'; frame-ancestors 'none'")


INLINE_SCRIPT = re.compile(r"<script(?![^>]*\bsrc=)(?![^>]*type=\"application/json\")[^>]*>", re.I)
HANDLER = re.compile(r"\son[a-z]+\s*=", re.I)


def test_the_dashboard_has_no_inline_script_or_handler():
    """'unsafe-inline' is not in script-src: an inline script or onclick= would not run."""
    for page in TEMPLATES.glob("*.html"):
        text = page.read_text()
        assert not INLINE_SCRIPT.search(text), page.name
        assert not HANDLER.search(text), page.name
        assert "javascript:" not in text, page.name


@pytest.fixture
def mine(team, base_template, node):
    from datetime import timedelta  # noqa: PLC0415

    from django.utils import timezone  # noqa: PLC0415

    from sandboxes.models import Sandbox  # noqa: PLC0415

    return Sandbox.objects.create(team=team, template=base_template, node=node, state="running",
                                  end_at=timezone.now() + timedelta(hours=1))
