"""E2B endpoints end to end through the ASGI app, with the node side mocked."""
import asyncio
import time
from datetime import datetime, timedelta

import pytest
from django.test import override_settings
from django.utils import timezone

from sandboxes.models import Sandbox, SandboxEvent

pytestmark = pytest.mark.django_db(transaction=True)

SANDBOX_KEYS = {"sandboxID", "templateID", "clientID", "envdVersion", "trafficAccessToken", "domain", "alias"}
LISTED_KEYS = {"sandboxID", "templateID", "clientID", "alias", "startedAt", "endAt", "cpuCount", "memoryMB",
               "diskSizeMB", "state", "envdVersion", "metadata", "volumeMounts"}


def _dt(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))

from conftest import BOOT_RESULT


@override_settings(AENV_SANDBOX_DOMAIN="sb.example")
async def test_create_v2_returns_201_sandbox(api, nodes_mock):
    resp = await api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 120, "metadata": {"user": "a b&c"},
                                                 "envVars": {"FOO": "bar"}}, headers={"Idempotency-Key": "abc-123"})
    assert resp.status_code == 201, resp.text
    body = resp.json()
    assert set(body) == SANDBOX_KEYS | {"envdAccessToken"}  # v2 sandboxes are secure
    assert body["templateID"] == "base" and body["envdVersion"] == "0.6.4" and body["domain"] == "sb.example"
    assert body["trafficAccessToken"] is None and body["envdAccessToken"]
    sb = await Sandbox.objects.aget(pk=body["sandboxID"])
    assert sb.state == "running" and sb.node_id == "n1" and sb.envd_port == 40001
    assert sb.metadata == {"user": "a b&c"} and sb.env_vars == {"FOO": "bar"}
    assert 115 <= (sb.end_at - sb.started_at).total_seconds() <= 121
    kwargs = nodes_mock.client.boot_sandbox.await_args.kwargs
    assert kwargs["env_vars"] == {"FOO": "bar"} and kwargs["access_token"] == body["envdAccessToken"]
    assert kwargs["image"] == "base" and kwargs["cpu_count"] == 2 and kwargs["memory_mb"] == 512
    events = [e async for e in SandboxEvent.objects.filter(sandbox=sb).order_by("id")]
    assert [(e.operation, e.outcome, e.to_state) for e in events] == [("create", "started", "creating"),
                                                                       ("create", "ok", "running")]
    assert events[1].duration_ms is not None
    assert events[1].details["timings"] == BOOT_RESULT["timings"]
    phases = events[1].details["phases"]
    assert (phases["disk"], phases["spawn"], phases["boot"], phases["init"]) == (10.0, 20.0, 300.0, 15.0)
    assert phases["total"] >= phases["schedule"] and phases["dispatch"] >= 0
    timing = dict(item.split(";dur=") for item in resp.headers["server-timing"].split(", "))
    assert set(timing) == set(phases) and float(timing["boot"]) == 300.0


async def test_a_created_row_is_born_with_its_node(api, nodes_mock):
    """One step (issue 26): the placement's claim inserts the ``creating`` row with its node,
    in the placement's transaction; there is no row before the claim and no second write of it."""
    from asgiref.sync import sync_to_async

    seen = []

    async def place(cpu_count, memory_mb, *, on=None, prefer=None, claim=None):
        def look_around(node):
            seen.append(Sandbox.objects.count())
            claim(node)
            seen.append(list(Sandbox.objects.values_list("state", "node_id")))
        await sync_to_async(look_around)(nodes_mock.node)
        return nodes_mock.node

    nodes_mock.placement.place.side_effect = place
    resp = await api.post("/v2/sandboxes", json={"templateID": "base"})
    assert resp.status_code == 201, resp.text
    assert seen == [0, [("creating", "n1")]] and nodes_mock.placement.place.await_count == 1
    sb = await Sandbox.objects.aget(pk=resp.json()["sandboxID"])
    assert sb.state == "running" and sb.node_id == "n1"


async def test_a_create_refused_for_want_of_room_is_still_recorded(api, nodes_mock, assert_error):
    """No room: the answer is E2B's 503 and the sandbox is on record as an error saying why,
    with its events (the two-step way records what the one step cannot)."""
    nodes_mock.placement.place.side_effect = nodes_mock.placement.NoNodeAvailable("no node has room")
    assert_error(await api.post("/v2/sandboxes", json={"templateID": "base"}), 503, "no node available")
    sb = await Sandbox.objects.aget()
    assert sb.state == "error" and sb.node_id is None and "no node has room" in sb.error_reason
    events = [(e.operation, e.outcome, e.to_state) async for e in SandboxEvent.objects.filter(sandbox=sb).order_by("id")]
    assert events == [("create", "started", "creating"), ("create", "error", "error")]


async def test_create_v1_secure_flag(api, nodes_mock):
    insecure = await api.post("/sandboxes", json={"templateID": "base", "timeout": 300, "secure": False,
                                                  "allow_internet_access": True, "metadata": {}, "envVars": {}})
    assert insecure.status_code == 201, insecure.text
    assert set(insecure.json()) == SANDBOX_KEYS
    assert nodes_mock.client.boot_sandbox.await_args.kwargs["access_token"] is None
    secure = await api.post("/sandboxes", json={"templateID": "base", "secure": True})
    assert secure.status_code == 201 and secure.json()["envdAccessToken"]


async def test_create_by_alias_and_default_timeout(api, nodes_mock, base_template):
    base_template.alias = "my-alias"
    await base_template.asave()
    body = (await api.post("/v2/sandboxes", json={"templateID": "my-alias"})).json()
    assert body["templateID"] == "base" and body["alias"] == "my-alias"
    sb = await Sandbox.objects.aget(pk=body["sandboxID"])
    assert abs((sb.end_at - sb.started_at).total_seconds() - 300) < 2


async def test_get_detail_has_all_required_fields(api, create):
    sid = (await create(metadata={"k": "v"}, autoPause=True, autoResume={"enabled": True}))["sandboxID"]
    resp = await api.get(f"/sandboxes/{sid}")
    assert resp.status_code == 200
    body = resp.json()
    assert LISTED_KEYS | {"envdAccessToken", "domain", "lifecycle", "allowInternetAccess"} <= set(body)
    assert body["state"] == "running" and body["metadata"] == {"k": "v"}
    assert body["cpuCount"] == 2 and body["memoryMB"] == 512 and body["diskSizeMB"] == 2048
    assert body["lifecycle"] == {"autoResume": True, "onTimeout": "pause"}
    assert _dt(body["endAt"]) > _dt(body["startedAt"])


async def test_list_v1_running_only(api, create):
    a = (await create(metadata={"team": "x"}))["sandboxID"]
    b = (await create(metadata={"team": "y"}))["sandboxID"]
    await Sandbox.objects.filter(pk=b).aupdate(state="paused")
    listed = (await api.get("/sandboxes")).json()
    assert [s["sandboxID"] for s in listed] == [a]
    assert set(listed[0]) == LISTED_KEYS
    assert (await api.get("/sandboxes", params={"metadata": "team=y"})).json() == []


async def test_kill_then_404(api, create, nodes_mock, assert_error):
    sid = (await create())["sandboxID"]
    resp = await api.delete(f"/sandboxes/{sid}")
    assert resp.status_code == 204 and resp.content == b""
    sb = await Sandbox.objects.aget(pk=sid)
    assert sb.state == "killed" and sb.killed_at is not None and sb.error_reason == ""
    assert nodes_mock.client.kill_sandbox.await_args.kwargs == {"sandbox_id": sid}
    assert_error(await api.delete(f"/sandboxes/{sid}"), 404)
    assert_error(await api.get(f"/sandboxes/{sid}"), 404)
    assert (await api.get("/v2/sandboxes")).json() == []


async def test_timeout_sets_end_at_both_ways(api, create):
    sid = (await create(timeout=600))["sandboxID"]
    assert (await api.post(f"/sandboxes/{sid}/timeout", json={"timeout": 30})).status_code == 204
    sb = await Sandbox.objects.aget(pk=sid)
    assert 25 <= (sb.end_at - timezone.now()).total_seconds() <= 31
    assert (await api.post(f"/sandboxes/{sid}/timeout", json={"timeout": 0})).status_code == 204
    assert (await Sandbox.objects.aget(pk=sid)).end_at <= timezone.now()


async def test_refresh_only_extends(api, create):
    sid = (await create(timeout=600))["sandboxID"]
    before = (await Sandbox.objects.aget(pk=sid)).end_at
    assert (await api.post(f"/sandboxes/{sid}/refreshes", json={"duration": 10})).status_code == 204
    assert (await Sandbox.objects.aget(pk=sid)).end_at == before
    assert (await api.post(f"/sandboxes/{sid}/refreshes", json={"duration": 3600})).status_code == 204
    assert (await Sandbox.objects.aget(pk=sid)).end_at > before + timedelta(minutes=40)
    assert (await api.post(f"/sandboxes/{sid}/refreshes")).status_code == 204  # body optional


# ---------------------------------------------------------------- bad input → JSON errors

BAD_CREATES = [
    (b"{not json", 400),
    (b"[1,2]", 400),
    (b'"base"', 400),
    (b"null", 400),
    (b"{}", 400),                                           # templateID missing
    (b'{"templateID": 5}', 400),
    (b'{"templateID": ""}', 400),
    (b'{"templateID": "base", "timeout": "x"}', 400),
    (b'{"templateID": "base", "timeout": "120"}', 400),
    (b'{"templateID": "base", "timeout": 1.5}', 400),
    (b'{"templateID": "base", "timeout": true}', 400),
    (b'{"templateID": "base", "timeout": -1}', 400),
    (b'{"templateID": "base", "timeout": 99999999}', 400),
    (b'{"templateID": "base", "metadata": {"a": 1}}', 400),
    (b'{"templateID": "base", "metadata": ["a"]}', 400),
    (b'{"templateID": "base", "envVars": {"A": null}}', 400),
    (b'{"templateID": "base", "envVars": "A=1"}', 400),
    (b'{"templateID": "base", "autoPause": "yes"}', 400),
    (b'{"templateID": "base", "autoResume": "on"}', 400),
    (b'{"templateID": "base", "allow_internet_access": 1}', 400),
    (b'{"templateID": "base", "network": [1]}', 400),
    (b'{"templateID": "base", "secure": "true"}', 400),
]


@pytest.mark.parametrize("path", ["/v2/sandboxes", "/sandboxes"])
@pytest.mark.parametrize("body,status", BAD_CREATES)
async def test_bad_create_bodies(api, nodes_mock, assert_error, path, body, status):
    resp = await api.post(path, content=body, headers={"Content-Type": "application/json"})
    assert_error(resp, status)
    nodes_mock.client.boot_sandbox.assert_not_awaited()
    assert await Sandbox.objects.acount() == 0


async def test_unknown_fields_are_ignored(api, nodes_mock):
    resp = await api.post("/v2/sandboxes", json={"templateID": "base", "mcp": None, "volumeMounts": [],
                                                 "iam": {"tokens": {}}, "autoPauseMemory": False, "whatever": 1})
    assert resp.status_code == 201, resp.text


async def test_unknown_template_is_400_naming_it(api, nodes_mock, assert_error):
    assert_error(await api.post("/v2/sandboxes", json={"templateID": "no-such-template"}), 400, "no-such-template")


async def test_private_template_of_other_team_is_unknown(api, nodes_mock, assert_error, other_team):
    from sandboxes.models import Template  # noqa: PLC0415

    await Template.objects.acreate(id="secret", team=other_team, public=False)
    assert_error(await api.post("/v2/sandboxes", json={"templateID": "secret"}), 400, "secret")


async def test_non_json_content_type_is_json_error(api, nodes_mock):
    resp = await api.post("/v2/sandboxes", content=b"templateID=base",
                          headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert resp.status_code == 415 and resp.json()["code"] == 415


@pytest.mark.parametrize("body", [b"{}", b'{"timeout": "5"}', b'{"timeout": -5}', b"[]", b"{bad"])
async def test_bad_timeout_bodies(api, create, assert_error, body):
    sid = (await create())["sandboxID"]
    resp = await api.post(f"/sandboxes/{sid}/timeout", content=body, headers={"Content-Type": "application/json"})
    assert_error(resp, 400)


async def test_bad_refresh_body(api, create, assert_error):
    sid = (await create())["sandboxID"]
    assert_error(await api.post(f"/sandboxes/{sid}/refreshes", json={"duration": "x"}), 400)


async def test_unknown_sandbox_is_404_everywhere(api, assert_error):
    assert_error(await api.get("/sandboxes/inope"), 404, "inope")
    assert_error(await api.delete("/sandboxes/inope"), 404)
    assert_error(await api.post("/sandboxes/inope/timeout", json={"timeout": 5}), 404)
    assert_error(await api.post("/sandboxes/inope/refreshes", json={"duration": 5}), 404)


@pytest.mark.parametrize("method,path", [("put", "/v2/sandboxes"), ("delete", "/sandboxes"),
                                         ("patch", "/sandboxes/inope"), ("get", "/sandboxes/inope/timeout"),
                                         ("post", "/health")])
async def test_wrong_method_is_405_json(api, assert_error, method, path):
    resp = await getattr(api, method)(path) if method in ("get", "delete") else \
        await getattr(api, method)(path, json={})
    assert_error(resp, 405)


@pytest.mark.parametrize("path", ["/nope", "/v2/sandboxes/", "/sandboxes/a/b/c", "/v9/sandboxes"])
async def test_unknown_url_is_404_json(api, assert_error, path):
    assert_error(await api.get(path), 404)


async def test_create_answers_at_once_when_a_restarted_node_fails_it(api, nodes_mock, assert_error):
    """A node worker that dies mid-boot never answers the task; on restart it reconciles
    the row creating → error. The create request learns that from the row, not at the
    node deadline."""
    booting = asyncio.Event()

    async def never_answers(node, **kwargs):
        booting.set()
        await asyncio.sleep(3600)

    async def reconcile_when_booting():
        await booting.wait()
        await Sandbox.objects.filter(state="creating").aupdate(state="error", error_reason="node restarted")

    nodes_mock.client.boot_sandbox.side_effect = never_answers
    reconciler = asyncio.create_task(reconcile_when_booting())
    started = time.monotonic()
    resp = await api.post("/v2/sandboxes", json={"templateID": "base"})
    await reconciler
    assert time.monotonic() - started < 10
    body = assert_error(resp, 503, "restarted")
    assert "now error" in body["message"]


@pytest.mark.parametrize("extra", [{}, {"allow_internet_access": True}, {"network": None}, {"network": {}},
                                   {"network": {"allowOut": [], "denyOut": []}},
                                   {"network": {"allowPublicTraffic": True}}])
async def test_what_the_sdks_send_by_default_still_creates(api, nodes_mock, extra):
    resp = await api.post("/v2/sandboxes", json={"templateID": "base", **extra})
    assert resp.status_code == 201, resp.text


async def test_timeout_limits_are_read_per_request(api, create, nodes_mock, assert_error, settings):
    """AENV_MAX_TIMEOUT / AENV_DEFAULT_TIMEOUT are read when a request is checked, so a
    changed setting applies without a restart (and override_settings reaches them)."""
    settings.AENV_MAX_TIMEOUT = 100
    assert_error(await api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 101}), 400, "100")
    sid = (await create(timeout=100))["sandboxID"]
    assert_error(await api.post(f"/sandboxes/{sid}/timeout", json={"timeout": 101}), 400)
    settings.AENV_DEFAULT_TIMEOUT = 42
    assert (await api.post(f"/sandboxes/{sid}/refreshes", json={})).status_code == 204
    row = await Sandbox.objects.aget(pk=sid)
    assert (row.end_at - timezone.now()).total_seconds() > 90  # refresh never shortens
    assert_error(await api.post(f"/sandboxes/{sid}/fork", json={"timeout": 101}), 400)
