"""X-API-Key authentication and team isolation: every failure is JSON."""
import pytest
from django.utils import timezone

from sandboxes.models import ApiKey

pytestmark = pytest.mark.django_db(transaction=True)


async def test_health_needs_no_key(anon):
    resp = await anon.get("/health")
    assert resp.status_code == 204 and resp.content == b""


@pytest.mark.parametrize("path", ["/v2/sandboxes", "/sandboxes", "/sandboxes/ixyz"])
async def test_missing_key_is_401_json(anon, assert_error, path):
    assert_error(await anon.get(path), 401, "missing")


async def test_invalid_key_is_401_json(anon, assert_error, raw_key):
    resp = await anon.get("/v2/sandboxes", headers={"X-API-Key": "e2b_" + "0" * 40})
    assert_error(resp, 401, "invalid")


async def test_revoked_key_is_401_json(anon, assert_error, raw_key):
    await ApiKey.objects.all().aupdate(revoked_at=timezone.now())
    assert_error(await anon.get("/v2/sandboxes", headers={"X-API-Key": raw_key}), 401)


async def test_valid_key_and_header_case_insensitive(anon, raw_key):
    resp = await anon.get("/v2/sandboxes", headers={"x-api-key": raw_key})
    assert resp.status_code == 200 and resp.json() == []


async def test_other_team_sees_404_never_the_sandbox(api, create, anon, other_key, assert_error):
    sid = (await create())["sandboxID"]
    them = {"X-API-Key": other_key}
    assert_error(await anon.get(f"/sandboxes/{sid}", headers=them), 404)
    assert_error(await anon.delete(f"/sandboxes/{sid}", headers=them), 404)
    assert_error(await anon.post(f"/sandboxes/{sid}/timeout", json={"timeout": 5}, headers=them), 404)
    assert_error(await anon.post(f"/sandboxes/{sid}/refreshes", json={"duration": 5}, headers=them), 404)
    assert (await anon.get("/v2/sandboxes", headers=them)).json() == []
    assert (await anon.get("/sandboxes", headers=them)).json() == []
    # still alive for its owner
    assert (await api.get(f"/sandboxes/{sid}")).status_code == 200
