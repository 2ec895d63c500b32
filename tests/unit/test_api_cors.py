"""CORS on the E2B API (api.cors.ApiCorsMiddleware), so the TypeScript SDK works
from a browser; the dashboard and the admin keep their same-origin rules."""
import pytest
from django.test import Client

pytestmark = pytest.mark.django_db(transaction=True)

ORIGIN = "https://app.example"
PREFLIGHT = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type, x-api-key"}


@pytest.mark.parametrize("path", ["/v2/sandboxes", "/sandboxes", "/sandboxes/ixyz/connect", "/snapshots",
                                  "/templates/abc", "/health"])
async def test_preflight_is_answered_without_a_key(anon, path):
    r = await anon.options(path, headers=PREFLIGHT)
    assert r.status_code == 204 and r.content == b""
    assert r.headers["access-control-allow-origin"] == "*"
    methods = {m.strip() for m in r.headers["access-control-allow-methods"].split(",")}
    assert methods >= {"GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"}
    assert r.headers["access-control-allow-headers"] == PREFLIGHT["Access-Control-Request-Headers"]
    assert r.headers["access-control-expose-headers"] == "*"
    assert int(r.headers["access-control-max-age"]) > 0
    assert "access-control-allow-credentials" not in r.headers


async def test_preflight_naming_no_headers_allows_the_api_ones(anon):
    r = await anon.options("/v2/sandboxes", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "GET"})
    allowed = {h.strip().lower() for h in r.headers["access-control-allow-headers"].split(",")}
    assert {"x-api-key", "authorization", "content-type"} <= allowed


async def test_answers_are_readable_cross_origin(api, anon):
    r = await api.get("/sandboxes/inope", headers={"Origin": ORIGIN})
    assert r.status_code == 404
    assert r.headers["access-control-allow-origin"] == "*" and r.headers["access-control-expose-headers"] == "*"
    r = await api.get("/v2/sandboxes", headers={"Origin": ORIGIN})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    assert r.headers["access-control-expose-headers"] == "X-Next-Token"  # the view's own is kept
    r = await anon.get("/v2/sandboxes", headers={"Origin": ORIGIN})  # errors too
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "*"


async def test_a_plain_options_is_not_a_preflight(api):
    r = await api.options("/v2/sandboxes")  # no Access-Control-Request-Method: DRF answers it
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"


@pytest.mark.parametrize("path", ["/dashboard/", "/dashboard/login/", "/admin/login/", "/"])
async def test_dashboard_and_admin_get_no_cors(anon, path):
    r = await anon.options(path, headers=PREFLIGHT)
    assert "access-control-allow-origin" not in r.headers
    r = await anon.get(path, headers={"Origin": ORIGIN})
    assert "access-control-allow-origin" not in r.headers


def test_dashboard_still_needs_csrf(user):
    strict = Client(enforce_csrf_checks=True)
    r = strict.post("/dashboard/login/", {"username": "alice", "password": "pw-alice-123"},
                    HTTP_ORIGIN=ORIGIN)
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
