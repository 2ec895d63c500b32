"""The API key cache (sandboxes.key_cache): a key the process has seen live is not read
again for AENV_API_KEY_CACHE_SECONDS, and a revoked key is refused at once when it was
revoked in this process (E2B's /api-keys, the dashboard, the admin) and within that bound
otherwise (another process's revocation: a bare database update here)."""
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from sandboxes import key_cache
from sandboxes.models import ApiKey

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _empty_cache():
    key_cache.clear()
    yield
    key_cache.clear()


class Clock:
    """``key_cache``'s monotonic clock, moved by hand (no sleeping test)."""

    def __init__(self, monkeypatch):
        self.now = 1000.0
        monkeypatch.setattr(key_cache.time, "monotonic", lambda: self.now)


def _lookups(raw: str) -> int:
    """How many queries one lookup of ``raw`` ran."""
    with CaptureQueriesContext(connection) as queries:
        key_cache.lookup(raw)
    return len(queries)


def test_a_live_key_is_read_once_within_the_bound_then_again(raw_key, monkeypatch, settings):
    settings.AENV_API_KEY_CACHE_SECONDS = 2
    clock = Clock(monkeypatch)
    assert _lookups(raw_key) == 1
    assert _lookups(raw_key) == 0
    assert key_cache.lookup(raw_key).team.slug == "team-a"
    clock.now += 2.5
    assert _lookups(raw_key) == 1


def test_unknown_and_revoked_keys_are_never_cached(raw_key):
    assert key_cache.lookup("e2b_" + "0" * 40) is None
    assert _lookups("e2b_" + "0" * 40) == 1
    ApiKey.objects.update(revoked_at=timezone.now())
    assert key_cache.lookup(raw_key) is None
    assert _lookups(raw_key) == 1


def test_zero_turns_it_off(raw_key, settings):
    settings.AENV_API_KEY_CACHE_SECONDS = 0
    assert _lookups(raw_key) == 1
    assert _lookups(raw_key) == 1


async def test_deleted_through_the_api_is_refused_by_the_next_request(api, raw_key, assert_error):
    """The process that revokes refuses at once, though the key was cached a moment before."""
    keys = (await api.get("/api-keys")).json()
    await api.post("/api-keys", json={"name": "spare"})
    assert (await api.get("/v2/sandboxes")).status_code == 200  # cached now
    assert (await api.delete(f"/api-keys/{keys[0]['id']}")).status_code == 204
    assert_error(await api.get("/v2/sandboxes"), 401, "invalid API key")


async def test_revoked_elsewhere_is_refused_within_the_bound(api, raw_key, assert_error, monkeypatch, settings):
    """Another process's revocation is a database update this process hears nothing of:
    the cached key answers until its entry expires (AENV_API_KEY_CACHE_SECONDS), never after."""
    settings.AENV_API_KEY_CACHE_SECONDS = 2
    clock = Clock(monkeypatch)
    assert (await api.get("/v2/sandboxes")).status_code == 200
    await ApiKey.objects.all().aupdate(revoked_at=timezone.now())
    clock.now += 1.9
    assert (await api.get("/v2/sandboxes")).status_code == 200  # within the documented bound
    clock.now += 0.2
    assert_error(await api.get("/v2/sandboxes"), 401, "invalid API key")


async def test_revoked_in_the_dashboard_is_refused_at_once(api, raw_key, team, user, client, assert_error):
    spare, _ = await sync_to_async(ApiKey.generate)(team, name="spare")
    assert (await api.get("/v2/sandboxes")).status_code == 200
    key = await ApiKey.objects.exclude(pk=spare.pk).aget()

    def revoke():
        client.force_login(user)
        assert client.post(f"/dashboard/api-keys/{key.pk}/revoke").status_code == 302

    await sync_to_async(revoke)()
    assert_error(await api.get("/v2/sandboxes"), 401, "invalid API key")


async def test_revoked_in_the_admin_or_deleted_is_refused_at_once(api, raw_key, team, assert_error):
    from django.contrib import admin  # noqa: PLC0415

    assert (await api.get("/v2/sandboxes")).status_code == 200
    model_admin = admin.site._registry[ApiKey]

    def revoke():
        model_admin.message_user = lambda *a, **k: None
        model_admin.revoke(None, ApiKey.objects.filter(team=team))

    await sync_to_async(revoke)()
    assert_error(await api.get("/v2/sandboxes"), 401, "invalid API key")

    other, raw = await sync_to_async(ApiKey.generate)(team, name="other")
    assert (await api.get("/v2/sandboxes", headers={"X-API-Key": raw})).status_code == 200
    await sync_to_async(other.delete)()  # a row deleted (a team's deletion cascades to its keys)
    assert_error(await api.get("/v2/sandboxes", headers={"X-API-Key": raw}), 401, "invalid API key")


async def test_a_cached_key_is_checked_in_the_event_loop(api, raw_key, assert_error, monkeypatch):
    """api.loop_views: with the key cached and used lately, DRF's checks take no thread hop;
    a key not cached, or due its once-a-minute ``last_used_at`` write, takes it as before."""
    from api import loop_views  # noqa: PLC0415

    hopped = []
    real = loop_views.sync_to_async
    monkeypatch.setattr(loop_views, "sync_to_async", lambda f: hopped.append(f.__name__) or real(f))
    assert (await api.get("/v2/sandboxes")).status_code == 200  # not cached yet: read in a thread
    assert hopped == ["initial"]
    assert (await api.get("/v2/sandboxes")).status_code == 200
    assert hopped == ["initial"]  # cached: no hop
    await ApiKey.objects.all().aupdate(last_used_at=timezone.now() - timedelta(minutes=5))
    key_cache.peek(raw_key).last_used_at = timezone.now() - timedelta(minutes=5)
    assert (await api.get("/v2/sandboxes")).status_code == 200  # the write is due: a thread
    assert hopped == ["initial", "initial"]
    assert (await ApiKey.objects.aget()).last_used_at > timezone.now() - timedelta(minutes=1)
    assert_error(await api.get("/v2/sandboxes", headers={"X-API-Key": "e2b_" + "1" * 40}), 401, "invalid")
    assert_error(await api.get("/v2/sandboxes", headers={"X-API-Key": ""}), 401)
    hopped.clear()
    assert (await api.get("/health", headers={"X-API-Key": ""})).status_code == 204  # no authenticator: no hop
    assert hopped == []


async def test_an_api_answer_is_rendered_in_the_event_loop(api, raw_key, assert_error, monkeypatch):
    """api.loop_views.rendered_in_loop: Django renders a DRF response through a thread hop
    unless its ``render`` is a coroutine function; the JSON answer (and an error's) is
    rendered in the loop, the same bytes."""
    from django.core.handlers import base  # noqa: PLC0415

    hopped = []
    real = base.sync_to_async
    monkeypatch.setattr(base, "sync_to_async", lambda f, **kw: hopped.append(getattr(f, "__name__", f)) or real(f, **kw))
    response = await api.get("/v2/sandboxes")
    assert response.status_code == 200 and response.json() == [] and response.headers["content-type"] == "application/json"
    assert_error(await api.get("/v2/sandboxes", headers={"X-API-Key": "e2b_" + "1" * 40}), 401, "invalid")
    assert "render" not in hopped, hopped
