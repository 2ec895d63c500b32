"""E2B's operator routes (``/admin/teams/...``) share Django's ``/admin/`` prefix: they answer
JSON ``{code, message}`` (404: aenv does not serve them), never the admin site's HTML 403 for a
missing CSRF token; the admin site itself stays where it was."""
import pytest
from django.test import Client

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("method, path", [
    ("post", "/admin/teams/00000000-0000-0000-0000-000000000001/sandboxes/kill"),
    ("post", "/admin/teams/00000000-0000-0000-0000-000000000001/builds/cancel"),
    ("get", "/admin/teams/x"),
])
def test_e2b_admin_routes_answer_json(method, path):
    response = getattr(Client(enforce_csrf_checks=True), method)(path, HTTP_X_API_KEY="e2b_" + "0" * 40)
    assert response.status_code == 404
    assert response["Content-Type"].startswith("application/json")
    body = response.json()
    assert body["code"] == 404 and "not served" in body["message"]


def test_the_admin_site_is_still_the_admin_site():
    response = Client().get("/admin/login/")
    assert response.status_code == 200 and b"<form" in response.content
