"""E2B's lifecycle events API (``GET /events/sandboxes``, ``/events/sandboxes/{id}``) and
webhook registration (``/events/webhooks``) through the ASGI app: the shapes of E2B's
OpenAPI (``SandboxEvent``, ``WebhookDetail``), events made from real operations (create,
timeout, pause, resume, kill with a mocked node; snapshot and fork from their recorded
events), offset paging both ways, type filters, team scoping, retention (served and purged
by the sweeper), and 400 ``{code, message}`` for every bad parameter."""
from datetime import timedelta

import httpx
import pytest
from asgiref.sync import sync_to_async
from django.utils import timezone

from events import catalog, ingest
from events.models import LifecycleEvent, Webhook, WebhookDelivery
from lifecycle.expiry import sweep_once
from sandboxes.models import SandboxEvent

pytestmark = pytest.mark.django_db(transaction=True)

EVENT_KEYS = {"id", "version", "type", "eventCategory", "eventLabel", "eventData", "timestamp", "sandboxId",
              "sandboxExecutionId", "sandboxTemplateId", "sandboxBuildId", "sandboxTeamId", "sandboxUptimeSecs"}


@pytest.fixture
def other_api(asgi_app, other_key):
    async def _client():
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi_app), base_url="http://testserver",
                                 headers={"X-API-Key": other_key}, timeout=30)
    return _client


@pytest.fixture
async def lived(api, create):
    """A sandbox that was created, had its timeout set, was paused, resumed and killed."""
    sb = (await create(metadata={"run": "r1"}))["sandboxID"]
    assert (await api.post(f"/sandboxes/{sb}/timeout", json={"timeout": 600})).status_code == 204
    assert (await api.post(f"/sandboxes/{sb}/pause")).status_code == 204
    assert (await api.post(f"/sandboxes/{sb}/resume", json={})).status_code == 201
    assert (await api.delete(f"/sandboxes/{sb}")).status_code == 204
    return sb


async def test_operations_are_served_as_e2b_sandbox_events(api, lived, team):
    events = (await api.get(f"/events/sandboxes/{lived}", params={"orderAsc": "true"})).json()
    assert [e["type"] for e in events] == [catalog.CREATED, catalog.UPDATED, catalog.PAUSED, catalog.RESUMED,
                                           catalog.KILLED]
    first = events[0]
    assert set(first) == EVENT_KEYS
    assert first["version"] == "v1" and first["sandboxId"] == lived and first["sandboxTeamId"] == str(team.id)
    assert first["sandboxTemplateId"] == "base" and first["eventData"]["sandbox_metadata"] == {"run": "r1"}
    assert first["eventData"]["actor"] and first["eventData"]["operation"] == "create"
    assert events[1]["eventData"]["timeout"] == 600
    assert events[4]["eventData"]["fromState"] == "killing" and events[4]["eventData"]["toState"] == "killed"
    assert len({e["id"] for e in events}) == 5 and all(len(e["id"]) == 36 for e in events)
    stamps = [e["timestamp"] for e in events]
    assert stamps == sorted(stamps) and stamps[0].endswith("Z")
    # newest first by default
    newest = (await api.get(f"/events/sandboxes/{lived}")).json()
    assert [e["id"] for e in newest] == [e["id"] for e in reversed(events)]


async def test_internal_records_are_not_events(api, lived):
    """Started / error / reconcile records stay internal: only finished operations are events."""
    await SandboxEvent.objects.acreate(sandbox_id=lived, operation="pause", outcome="error", from_state="pausing",
                                       to_state="running", actor="x")
    await SandboxEvent.objects.acreate(sandbox_id=lived, operation="reconcile", outcome="ok", from_state="paused",
                                       to_state="paused", actor="node")
    events = (await api.get(f"/events/sandboxes/{lived}", params={"limit": 100})).json()
    assert len(events) == 5
    assert await SandboxEvent.objects.filter(sandbox_id=lived).acount() > 5


async def test_snapshot_and_fork_records_become_checkpointed_and_forked(api, create):
    sb = (await create())["sandboxID"]
    for op in ("snapshot", "fork"):
        await SandboxEvent.objects.acreate(sandbox_id=sb, operation=op, outcome="ok",
                                           from_state=op + "ting" if op == "snapshot" else "forking",
                                           to_state="running", actor="k", details={"node": "n1", "count": 3})
    events = (await api.get(f"/events/sandboxes/{sb}", params={"types": f"{catalog.CHECKPOINTED},{catalog.FORKED}",
                                                                "orderAsc": True})).json()
    assert [e["type"] for e in events] == [catalog.CHECKPOINTED, catalog.FORKED]
    assert "node" not in events[1]["eventData"] and events[1]["eventData"]["count"] == 3


async def test_offset_paging_covers_every_event_once(api, create):
    ids = [(await create())["sandboxID"] for _ in range(3)]
    for sb in ids:
        assert (await api.post(f"/sandboxes/{sb}/timeout", json={"timeout": 300})).status_code == 204
    whole = (await api.get("/events/sandboxes", params={"limit": 100, "orderAsc": "true"})).json()
    assert len(whole) == 6
    for order in ("true", "false"):
        seen, offset = [], 0
        while page := (await api.get("/events/sandboxes", params={"offset": offset, "limit": 4,
                                                                 "orderAsc": order})).json():
            assert len(page) <= 4
            seen += [e["id"] for e in page]
            offset += len(page)
        expected = [e["id"] for e in whole]
        assert seen == (expected if order == "true" else expected[::-1])
    assert len((await api.get("/events/sandboxes")).json()) == 6  # default limit 10
    typed = (await api.get("/events/sandboxes", params=[("types", catalog.UPDATED)])).json()
    assert {e["type"] for e in typed} == {catalog.UPDATED} and len(typed) == 3


async def test_another_teams_events_are_invisible(api, create, other_api, assert_error):
    sb = (await create())["sandboxID"]
    async with await other_api() as other:
        assert (await other.get("/events/sandboxes")).json() == []
        assert_error(await other.get(f"/events/sandboxes/{sb}"), 404, "not found")
    assert_error(await api.get("/events/sandboxes/inope"), 404, "not found")  # unknown: the same answer
    assert len((await api.get(f"/events/sandboxes/{sb}")).json()) == 1


@pytest.mark.parametrize("params,field", [
    ({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"limit": "ten"}, "limit"), ({"offset": -1}, "offset"),
    ({"orderAsc": "maybe"}, "orderAsc"), ({"types": "sandbox.lifecycle.exploded"}, "types"),
])
async def test_bad_query_parameters_are_400(api, create, assert_error, params, field):
    sb = (await create())["sandboxID"]
    for path in ("/events/sandboxes", f"/events/sandboxes/{sb}"):
        assert_error(await api.get(path, params=params), 400, field)


async def test_no_key_is_401(anon, assert_error):
    assert_error(await anon.get("/events/sandboxes"), 401)
    assert_error(await anon.get("/events/webhooks"), 401)


async def test_retention_hides_then_the_sweeper_deletes_old_events(api, create, settings):
    settings.AENV_EVENT_RETENTION_DAYS = 7
    sb = (await create())["sandboxID"]
    assert (await api.post(f"/sandboxes/{sb}/timeout", json={"timeout": 300})).status_code == 204
    assert len((await api.get(f"/events/sandboxes/{sb}")).json()) == 2
    old = await LifecycleEvent.objects.filter(type=catalog.CREATED).aget()
    old.timestamp = timezone.now() - timedelta(days=8)
    await old.asave()
    # an old record not yet made into an event is never made
    await SandboxEvent.objects.acreate(sandbox_id=sb, operation="refresh", outcome="ok", from_state="running",
                                       to_state="running", started_at=timezone.now() - timedelta(days=9))
    events = (await api.get(f"/events/sandboxes/{sb}")).json()
    assert [e["type"] for e in events] == [catalog.UPDATED]
    assert await LifecycleEvent.objects.acount() == 2  # hidden, not yet deleted
    await sweep_once()
    assert [e.type async for e in LifecycleEvent.objects.all()] == [catalog.UPDATED]


async def test_retention_zero_keeps_everything(api, create, settings):
    settings.AENV_EVENT_RETENTION_DAYS = 0
    sb = (await create())["sandboxID"]
    await sync_to_async(ingest.catch_up)()
    await LifecycleEvent.objects.all().aupdate(timestamp=timezone.now() - timedelta(days=400))
    await sweep_once()
    assert len((await api.get(f"/events/sandboxes/{sb}")).json()) == 1


async def test_ingest_reads_back_past_its_cursor(create):
    """An event committed after a higher id was read (PostgreSQL) is still made."""
    sb = (await create())["sandboxID"]
    assert await sync_to_async(ingest.catch_up)() == 1
    late = await SandboxEvent.objects.acreate(sandbox_id=sb, operation="refresh", outcome="ok",
                                              from_state="running", to_state="running")
    await SandboxEvent.objects.acreate(sandbox_id=sb, operation="refresh", outcome="started")
    assert await sync_to_async(ingest.catch_up)() == 1
    # pretend the late one was invisible: forget it and move the cursor past it
    await LifecycleEvent.objects.filter(source=late).adelete()
    assert await sync_to_async(ingest.catch_up)() == 1
    assert await sync_to_async(ingest.catch_up)() == 0
    assert await LifecycleEvent.objects.acount() == 2


# --------------------------------------------------------------------------- webhooks

HOOK = {"name": "My Sandbox Webhook", "url": "https://hooks.example.com/e2b", "enabled": True,
        "events": [catalog.CREATED, catalog.KILLED], "signatureSecret": "secret-for-event-signature-verification"}
DETAIL_KEYS = {"id", "teamId", "name", "createdAt", "url", "enabled", "events"}


async def test_webhook_crud_in_e2b_shapes(api, team):
    resp = await api.post("/events/webhooks", json=HOOK)
    assert resp.status_code == 201, resp.text
    made = resp.json()
    assert set(made) == DETAIL_KEYS  # the given secret is never shown back
    assert made["teamId"] == str(team.id) and made["events"] == HOOK["events"] and made["enabled"] is True
    wid = made["id"]
    assert (await api.get(f"/events/webhooks/{wid}")).json() == made
    assert (await api.get("/events/webhooks")).json() == [made]
    patched = await api.patch(f"/events/webhooks/{wid}", json={"enabled": False, "events": [catalog.PAUSED],
                                                               "signatureSecret": "a-new-secret-of-enough-length"})
    assert patched.status_code == 200
    assert (patched.json()["enabled"], patched.json()["events"], patched.json()["name"]) == \
        (False, [catalog.PAUSED], HOOK["name"])
    stored = await Webhook.objects.aget(pk=wid)
    assert "a-new-secret" not in stored.secret_sealed and "secret-for-event" not in stored.secret_sealed
    deleted = await api.delete(f"/events/webhooks/{wid}")
    assert deleted.status_code == 200
    assert (await api.get("/events/webhooks")).json() == []


async def test_a_secret_aenv_makes_is_shown_once(api):
    body = {k: v for k, v in HOOK.items() if k not in ("signatureSecret", "name")}
    made = (await api.post("/events/webhooks", json=body)).json()
    assert made["signatureSecret"].startswith("whsec_") and len(made["signatureSecret"]) > 40
    assert made["name"] == "hooks.example.com"
    assert "signatureSecret" not in (await api.get(f"/events/webhooks/{made['id']}")).json()
    assert all("signatureSecret" not in h for h in (await api.get("/events/webhooks")).json())


async def test_webhooks_are_team_scoped(api, other_api, assert_error):
    wid = (await api.post("/events/webhooks", json=HOOK)).json()["id"]
    async with await other_api() as other:
        assert (await other.get("/events/webhooks")).json() == []
        assert_error(await other.get(f"/events/webhooks/{wid}"), 404)
        assert_error(await other.patch(f"/events/webhooks/{wid}", json={"enabled": False}), 404)
        assert_error(await other.delete(f"/events/webhooks/{wid}"), 404)
        assert_error(await other.get(f"/events/webhooks/{wid}/deliveries"), 404)
    assert (await api.get(f"/events/webhooks/{wid}")).json()["enabled"] is True


@pytest.mark.parametrize("change,text", [
    ({"url": "ftp://hooks.example.com/"}, "http or https"),
    ({"url": "hooks.example.com/path"}, "http or https"),
    ({"url": "http:///nohost"}, "host"),
    ({"url": "https://user:pw@hooks.example.com/"}, "user info"),
    ({"url": 42}, "url"),
    ({"url": "https://hooks.example.com/a\x00b"}, "control characters"),
    ({"url": "http://2130706433/"}, "loopback or private"),
    ({"url": "http://127.0.0.1:3000/admin"}, "loopback or private"),
    ({"url": "http://localhost/"}, "loopback or private"),
    ({"url": "http://10.0.0.5/"}, "loopback or private"),
    ({"url": "http://[::ffff:192.168.1.1]/"}, "loopback or private"),
    ({"url": "http://169.254.169.254/latest/meta-data/"}, "metadata"),
    ({"url": "http://[fe80::1]/"}, "link-local"),
    ({"events": []}, "events"),
    ({"events": ["sandbox.lifecycle.exploded"]}, "unknown event type"),
    ({"events": "sandbox.lifecycle.created"}, "events"),
    ({"enabled": "yes"}, "enabled"),
    ({"name": ""}, "name"),
    ({"signatureSecret": "short"}, "signatureSecret"),
])
async def test_bad_webhooks_are_400(api, assert_error, change, text):
    assert_error(await api.post("/events/webhooks", json={**HOOK, **change}), 400, text)
    wid = (await api.post("/events/webhooks", json=HOOK)).json()["id"]
    assert_error(await api.patch(f"/events/webhooks/{wid}", json=change), 400, text)
    assert (await api.get(f"/events/webhooks/{wid}")).json()["url"] == HOOK["url"]


async def test_private_destinations_are_allowed_only_when_the_operator_says_so(api, settings, assert_error):
    settings.AENV_WEBHOOK_ALLOW_PRIVATE = True
    assert (await api.post("/events/webhooks", json={**HOOK, "url": "http://127.0.0.1:9/hook"})).status_code == 201
    assert_error(await api.post("/events/webhooks", json={**HOOK, "url": "http://169.254.169.254/"}), 400, "metadata")


async def test_webhook_id_and_body_errors(api, assert_error, settings):
    assert_error(await api.get("/events/webhooks/not-a-uuid"), 400, "uuid")
    assert_error(await api.get("/events/webhooks/00000000-0000-0000-0000-000000000000"), 404)
    assert_error(await api.post("/events/webhooks", json=[1, 2]), 400)
    assert_error(await api.post("/events/webhooks", content=b"{nope", headers={"content-type": "application/json"}),
                 400)
    settings.AENV_WEBHOOKS_PER_TEAM = 2
    for _ in range(2):
        assert (await api.post("/events/webhooks", json=HOOK)).status_code == 201
    assert_error(await api.post("/events/webhooks", json=HOOK), 400, "at most 2")


async def test_events_queue_deliveries_only_to_matching_enabled_webhooks(api, create):
    wanted = (await api.post("/events/webhooks", json=HOOK)).json()["id"]
    (await api.post("/events/webhooks", json={**HOOK, "events": [catalog.PAUSED]})).json()
    (await api.post("/events/webhooks", json={**HOOK, "enabled": False}))
    sb = (await create())["sandboxID"]
    assert (await api.delete(f"/sandboxes/{sb}")).status_code == 204
    await sync_to_async(ingest.catch_up)()
    rows = [(str(d.webhook_id), d.event.type) async for d in WebhookDelivery.objects.select_related("event")]
    assert sorted(rows) == sorted([(wanted, catalog.CREATED), (wanted, catalog.KILLED)])
    await sync_to_async(ingest.catch_up)()  # a second pass makes nothing twice
    assert await WebhookDelivery.objects.acount() == 2
