"""Pause / resume / connect through the ASGI app, with the node side mocked: status
codes, state transitions and the events written for each."""
import asyncio
from datetime import timedelta

import pytest
from conftest import PAUSE_RESULT, RESUME_RESULT
from django.utils import timezone

from sandboxes.models import Sandbox, SandboxEvent

pytestmark = pytest.mark.django_db(transaction=True)


async def _state(sandbox_id: str) -> str:
    return (await Sandbox.objects.aget(pk=sandbox_id)).state


async def _events(sandbox_id: str, operation: str | None = None) -> list[tuple]:
    qs = SandboxEvent.objects.filter(sandbox_id=sandbox_id).order_by("id")
    if operation:
        qs = qs.filter(operation=operation)
    return [(e.operation, e.outcome, e.from_state, e.to_state) async for e in qs]


@pytest.fixture
def paused(api, create):
    async def _paused(**body) -> dict:
        sb = await create(**body)
        resp = await api.post(f"/sandboxes/{sb['sandboxID']}/pause", json={})
        assert resp.status_code == 204, resp.text
        return sb

    return _paused


# --------------------------------------------------------------------------- pause


@pytest.mark.parametrize("kwargs", [{}, {"json": {}}, {"json": {"memory": True}}, {"json": {"memory": False}},
                                    {"content": b"", "headers": {"content-type": "application/json"}},
                                    {"json": {"memory": True, "requireHealthyGuest": True}}])
async def test_pause_running_is_204_and_paused(api, create, nodes_mock, kwargs):
    sb = await create()
    resp = await api.post(f"/sandboxes/{sb['sandboxID']}/pause", **kwargs)
    assert resp.status_code == 204, resp.text
    assert resp.content == b""
    assert "node;dur=" in resp.headers.get("server-timing", "")
    assert await _state(sb["sandboxID"]) == "paused"
    node_kwargs = nodes_mock.client.pause_sandbox.await_args.kwargs
    assert node_kwargs["sandbox_id"] == sb["sandboxID"] and node_kwargs["to_disk"] is True
    assert node_kwargs["memory"] is ((kwargs.get("json") or {}).get("memory") is not False)
    assert await _events(sb["sandboxID"], "pause") == [("pause", "started", "running", "pausing"),
                                                        ("pause", "ok", "pausing", "paused")]
    done = await SandboxEvent.objects.filter(sandbox_id=sb["sandboxID"], operation="pause", outcome="ok").aget()
    assert done.details["to_disk"] is True and done.details["timings"] == PAUSE_RESULT["timings"]
    assert done.details["memory"] == (kwargs.get("json") or {}).get("memory")


async def test_strict_pause_of_an_unresponsive_guest_is_503_and_it_keeps_running(api, create, nodes_mock,
                                                                                  assert_error):
    """SDK ``pause(strict=True)``: the node finds envd not answering and pauses nothing;
    E2B answers 503 (the SDK's ServiceBusyException) and the sandbox runs on."""
    sb = await create()
    nodes_mock.client.pause_sandbox.side_effect = nodes_mock.client.NodeTaskFailed(
        f"sandbox {sb['sandboxID']}: its guest agent (envd) does not answer; it was not paused and keeps running",
        kind="GuestUnresponsive")
    resp = await api.post(f"/sandboxes/{sb['sandboxID']}/pause", json={"requireHealthyGuest": True})
    assert_error(resp, 503, "does not answer")
    assert nodes_mock.client.pause_sandbox.await_args.kwargs["require_healthy_guest"] is True
    assert await _state(sb["sandboxID"]) == "running"
    assert (await _events(sb["sandboxID"], "pause"))[-1][1:] == ("error", "pausing", "running")
    # not strict: the flag is not sent (the node then pauses anyway and says so)
    nodes_mock.client.pause_sandbox.side_effect = None
    assert (await api.post(f"/sandboxes/{sb['sandboxID']}/pause", json={})).status_code == 204
    assert "require_healthy_guest" not in nodes_mock.client.pause_sandbox.await_args.kwargs


async def _only_a_reboot_resumes(api, sid, assert_error, text, error_code):
    """Every plain resume (v1 and v2 connect, resume) is a 409 with ``error_code``, and traffic
    does not auto-resume the sandbox."""
    from lifecycle.sandboxes import pause

    for path, body in ((f"/sandboxes/{sid}/connect", {"timeout": 30}), (f"/v2/sandboxes/{sid}/connect", {}),
                       (f"/sandboxes/{sid}/resume", {})):
        resp = await api.post(path, json=body)
        assert_error(resp, 409, text)
        assert resp.json()["error_code"] == error_code
    assert await pause.auto_resume(sid) is None


async def test_a_pause_of_an_unresponsive_guest_resumes_only_by_reboot(api, create, nodes_mock, assert_error):
    """The node paused with the memory although envd did not answer: the sandbox shows
    envdUnresponsiveAtPause; a plain resume is E2B's 409 with its error_code (the SDK's
    GuestUnresponsiveException), traffic does not auto-resume it, a reboot does."""
    sb = await create(autoResume={"enabled": True})
    sid = sb["sandboxID"]
    nodes_mock.client.pause_sandbox.return_value = {**PAUSE_RESULT, "envd_unresponsive": True}
    assert (await api.post(f"/sandboxes/{sid}/pause", json={})).status_code == 204
    assert (await api.get(f"/sandboxes/{sid}")).json()["envdUnresponsiveAtPause"] is True
    listed = (await api.get("/v2/sandboxes", params={"state": "paused"})).json()
    assert listed[0]["envdUnresponsiveAtPause"] is True
    await _only_a_reboot_resumes(api, sid, assert_error, "guest agent", "sandbox_snapshot_guest_agent_unresponsive")
    assert nodes_mock.client.resume_sandbox.await_count == 0 and await _state(sid) == "paused"
    resp = await api.post(f"/v2/sandboxes/{sid}/connect", json={"memory": False})
    assert resp.status_code == 201, resp.text
    assert nodes_mock.client.resume_sandbox.await_args.kwargs["memory"] is False
    detail = (await api.get(f"/sandboxes/{sid}")).json()
    assert detail["state"] == "running" and "envdUnresponsiveAtPause" not in detail
    nodes_mock.client.pause_sandbox.return_value = dict(PAUSE_RESULT)
    assert (await api.post(f"/sandboxes/{sid}/pause", json={})).status_code == 204
    assert "envdUnresponsiveAtPause" not in (await api.get(f"/sandboxes/{sid}")).json()


async def test_a_resume_that_lost_the_memory_leaves_it_paused_for_a_reboot_only(api, create, nodes_mock,
                                                                                 assert_error):
    """The node's resume failed after the guest ran on the only copy of its memory (vmm
    MemoryLost): the answer says so, the sandbox stays paused and is marked; a plain resume is
    then a 409 saying why (not a cold boot the caller did not ask for), traffic does not
    auto-resume it, a reboot does and clears the mark."""
    sb = await create(autoResume={"enabled": True})
    sid = sb["sandboxID"]
    assert (await api.post(f"/sandboxes/{sid}/pause", json={})).status_code == 204
    nodes_mock.client.resume_sandbox.side_effect = nodes_mock.client.NodeTaskFailed(
        "sandbox x: not resumed, and its memory is lost (...)", kind="MemoryLost")
    resp = await api.post(f"/sandboxes/{sid}/connect", json={"timeout": 30})
    assert_error(resp, 500, "its memory is lost")
    row = await Sandbox.objects.aget(pk=sid)
    assert row.state == "paused" and row.memory_lost
    failed = await SandboxEvent.objects.filter(sandbox_id=sid, operation="resume", outcome="error").alast()
    assert failed.details["memory_lost"] is True and failed.details["kind"] == "MemoryLost"
    calls = nodes_mock.client.resume_sandbox.await_count
    await _only_a_reboot_resumes(api, sid, assert_error, "lost its memory", "sandbox_memory_lost")
    assert nodes_mock.client.resume_sandbox.await_count == calls and await _state(sid) == "paused"
    nodes_mock.client.resume_sandbox.side_effect = None
    nodes_mock.client.resume_sandbox.return_value = dict(RESUME_RESULT)
    resp = await api.post(f"/v2/sandboxes/{sid}/connect", json={"memory": False})
    assert resp.status_code == 201, resp.text
    assert nodes_mock.client.resume_sandbox.await_args.kwargs["memory"] is False
    assert not (await Sandbox.objects.aget(pk=sid)).memory_lost


async def test_a_resume_that_failed_otherwise_keeps_the_memory(api, paused, nodes_mock):
    sb = await paused()
    nodes_mock.client.resume_sandbox.side_effect = nodes_mock.client.NodeTaskFailed("envd silent", kind="BootTimeout")
    assert (await api.post(f"/sandboxes/{sb['sandboxID']}/connect", json={"timeout": 30})).status_code == 500
    assert not (await Sandbox.objects.aget(pk=sb["sandboxID"])).memory_lost


async def test_paused_sandbox_is_listed_as_paused(api, paused):
    sb = await paused()
    listed = (await api.get("/v2/sandboxes", params={"state": "paused"})).json()
    assert [s["sandboxID"] for s in listed] == [sb["sandboxID"]] and listed[0]["state"] == "paused"
    assert (await api.get("/v2/sandboxes", params={"state": "running"})).json() == []
    assert (await api.get("/sandboxes")).json() == []  # v1 list: running only
    assert (await api.get(f"/sandboxes/{sb['sandboxID']}")).json()["state"] == "paused"


async def test_pause_twice_is_409(api, paused, assert_error, nodes_mock):
    sb = await paused()
    assert_error(await api.post(f"/sandboxes/{sb['sandboxID']}/pause"), 409, "not running")
    assert nodes_mock.client.pause_sandbox.await_count == 1


async def test_pause_unknown_killed_or_other_team_is_404(api, create, asgi_app, other_key, assert_error):
    import httpx

    assert_error(await api.post("/sandboxes/nope/pause"), 404, "not found")
    sb = await create()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi_app), base_url="http://testserver",
                                 headers={"X-API-Key": other_key}) as other:
        assert_error(await other.post(f"/sandboxes/{sb['sandboxID']}/pause"), 404)
        assert_error(await other.post(f"/sandboxes/{sb['sandboxID']}/connect", json={"timeout": 30}), 404)
        assert_error(await other.post(f"/sandboxes/{sb['sandboxID']}/resume", json={}), 404)
    assert await _state(sb["sandboxID"]) == "running"
    assert (await api.delete(f"/sandboxes/{sb['sandboxID']}")).status_code == 204
    assert_error(await api.post(f"/sandboxes/{sb['sandboxID']}/pause"), 404)


async def test_pause_rejects_bad_body(api, create, assert_error):
    sb = await create()
    assert_error(await api.post(f"/sandboxes/{sb['sandboxID']}/pause", json={"memory": "yes"}), 400, "memory")
    assert await _state(sb["sandboxID"]) == "running"


async def test_pause_not_running_states_are_409(api, create, assert_error):
    sb = await create()
    await Sandbox.objects.filter(pk=sb["sandboxID"]).aupdate(state="snapshotting")
    # snapshotting is transient: a pause does not wait for it, it is not "running"
    assert_error(await api.post(f"/sandboxes/{sb['sandboxID']}/pause"), 409, "not running")


@pytest.mark.parametrize("exc_name, status, end_state", [
    ("NodeTaskFailed", 500, "running"),   # the node answered: QEMU continued the VM
    ("NodeTimeout", 504, "pausing"),      # no answer: the VM's state is unknown; it is kept
    ("NodeUnavailable", 503, "pausing"),  # for the node to reconcile when it answers again
])
async def test_pause_failure_states(api, create, nodes_mock, assert_error, exc_name, status, end_state):
    sb = await create()
    exc_class = getattr(nodes_mock.client, exc_name)
    nodes_mock.client.pause_sandbox.side_effect = (exc_class("migrate failed", kind="VMError")
                                                   if exc_name == "NodeTaskFailed" else exc_class("boom"))
    nodes_mock.client.kill_sandbox.reset_mock()
    body = assert_error(await api.post(f"/sandboxes/{sb['sandboxID']}/pause"), status)
    assert await _state(sb["sandboxID"]) == end_state
    assert nodes_mock.client.kill_sandbox.await_count == 0  # the VM is never destroyed for a failed pause
    if end_state == "running":
        assert body.get("error_code") == "v_m_error"
        assert await _events(sb["sandboxID"], "pause") == [("pause", "started", "running", "pausing"),
                                                            ("pause", "error", "pausing", "running")]
    else:
        assert await _events(sb["sandboxID"], "pause") == [("pause", "started", "running", "pausing"),
                                                            ("pause", "unconfirmed", "pausing", "")]
        # shown as paused meanwhile; a second pause is refused, not repeated
        assert (await api.get(f"/sandboxes/{sb['sandboxID']}")).json()["state"] == "paused"


async def test_pause_memory_false_is_filesystem_only_when_the_node_supports_it(api, create, nodes_mock):
    calls = []

    async def pause(node, *, sandbox_id, to_disk=True, memory=True, deadline=None):
        calls.append(memory)
        return dict(PAUSE_RESULT)

    nodes_mock.client.pause_sandbox = pause
    for body, memory, mode in (({"memory": False}, False, "filesystem"), ({}, True, "memory")):
        sb = await create()
        assert (await api.post(f"/sandboxes/{sb['sandboxID']}/pause", json=body)).status_code == 204
        assert calls[-1] is memory
        done = await SandboxEvent.objects.filter(sandbox_id=sb["sandboxID"], operation="pause", outcome="ok").aget()
        assert done.details["mode"] == mode


async def test_resume_without_room_is_an_admission_refusal(api, paused, nodes_mock, assert_error):
    """A paused sandbox whose node is full now: 503 + Retry-After (issue 27), it stays paused."""
    sb = await paused()
    nodes_mock.placement.place.side_effect = nodes_mock.placement.NoNodeAvailable("node n1 has no room")
    resp = await api.post(f"/sandboxes/{sb['sandboxID']}/connect", json={})
    assert_error(resp, 503, "cannot be resumed now")
    assert resp.headers["Retry-After"] == "5"
    assert await _state(sb["sandboxID"]) == "paused"


async def test_pause_on_dead_node_is_503_and_changes_nothing(api, create, nodes_mock, assert_error):
    sb = await create()
    await nodes_mock.node.__class__.objects.filter(pk="n1").aupdate(
        last_heartbeat_at=timezone.now() - timedelta(hours=1))
    resp = await api.post(f"/sandboxes/{sb['sandboxID']}/pause")
    assert_error(resp, 503, "not alive")
    assert "Retry-After" not in resp.headers  # a dead node is no admission refusal: no promise of room
    assert await _state(sb["sandboxID"]) == "running"
    assert await _events(sb["sandboxID"], "pause") == []
    nodes_mock.client.pause_sandbox.assert_not_awaited()


@pytest.mark.parametrize("reconciled, status", [("paused", 204), ("running", 409), ("killing", 404)])
async def test_pause_waiter_follows_a_reconcile(api, create, nodes_mock, reconciled, status):
    """A node worker that restarts mid-pause never answers the task; it reconciles the row
    instead, and the waiting request answers from that at once (not at the deadline)."""
    sb = await create()

    async def never(*args, **kwargs):
        await asyncio.sleep(3600)

    nodes_mock.client.pause_sandbox.side_effect = never
    request = asyncio.ensure_future(api.post(f"/sandboxes/{sb['sandboxID']}/pause"))
    for _ in range(100):
        if await _state(sb["sandboxID"]) == "pausing":
            break
        await asyncio.sleep(0.02)
    await Sandbox.objects.filter(pk=sb["sandboxID"]).aupdate(state=reconciled)
    resp = await asyncio.wait_for(request, 5)
    assert resp.status_code == status, resp.text
    assert await _state(sb["sandboxID"]) == reconciled


async def test_pause_after_failed_pause_works(api, create, nodes_mock):
    sb = await create()
    nodes_mock.client.pause_sandbox.side_effect = [nodes_mock.client.NodeTaskFailed("x", kind="VMError"),
                                                   dict(PAUSE_RESULT)]
    assert (await api.post(f"/sandboxes/{sb['sandboxID']}/pause")).status_code == 500
    assert (await api.post(f"/sandboxes/{sb['sandboxID']}/pause")).status_code == 204
    assert await _state(sb["sandboxID"]) == "paused"


async def test_concurrent_pause_joins_the_first(api, create, nodes_mock):
    sb = await create()
    gate = asyncio.Event()

    async def slow_pause(*args, **kwargs):
        await gate.wait()
        return dict(PAUSE_RESULT)

    nodes_mock.client.pause_sandbox.side_effect = slow_pause
    first = asyncio.ensure_future(api.post(f"/sandboxes/{sb['sandboxID']}/pause"))
    for _ in range(100):
        if await _state(sb["sandboxID"]) == "pausing":
            break
        await asyncio.sleep(0.02)
    second = asyncio.ensure_future(api.post(f"/sandboxes/{sb['sandboxID']}/pause"))
    await asyncio.sleep(0.3)
    assert not second.done()
    gate.set()
    r1, r2 = await asyncio.gather(first, second)
    assert (r1.status_code, r2.status_code) == (204, 204)
    assert nodes_mock.client.pause_sandbox.await_count == 1
    assert await _state(sb["sandboxID"]) == "paused"


async def test_kill_paused_sandbox(api, paused, nodes_mock):
    sb = await paused()
    assert (await api.delete(f"/sandboxes/{sb['sandboxID']}")).status_code == 204
    assert await _state(sb["sandboxID"]) == "killed"
    assert nodes_mock.client.kill_sandbox.await_args.kwargs["sandbox_id"] == sb["sandboxID"]


# --------------------------------------------------------------------------- resume (legacy)


async def test_resume_paused_is_201_running(api, paused, nodes_mock):
    sb = await paused(envVars={"A": "1"})
    resp = await api.post(f"/sandboxes/{sb['sandboxID']}/resume", json={"timeout": 120})
    assert resp.status_code == 201, resp.text
    body = resp.json()
    assert body["sandboxID"] == sb["sandboxID"] and body["envdAccessToken"] == sb["envdAccessToken"]
    assert "node;dur=" in resp.headers.get("server-timing", "")
    row = await Sandbox.objects.aget(pk=sb["sandboxID"])
    assert row.state == "running" and row.envd_port == RESUME_RESULT["envd_port"]
    assert 115 <= (row.end_at - timezone.now()).total_seconds() <= 121
    kwargs = nodes_mock.client.resume_sandbox.await_args.kwargs
    assert kwargs["sandbox_id"] == sb["sandboxID"] and kwargs["env_vars"] == {"A": "1"}
    assert kwargs["access_token"] == sb["envdAccessToken"]
    assert await _events(sb["sandboxID"], "resume") == [("resume", "started", "paused", "resuming"),
                                                         ("resume", "ok", "resuming", "running")]


async def test_resume_without_body_uses_default_timeout(api, paused, settings):
    sb = await paused()
    resp = await api.post(f"/sandboxes/{sb['sandboxID']}/resume")
    assert resp.status_code == 201, resp.text
    row = await Sandbox.objects.aget(pk=sb["sandboxID"])
    assert abs((row.end_at - timezone.now()).total_seconds() - settings.AENV_DEFAULT_TIMEOUT) < 5


async def test_resume_running_is_409_and_unknown_404(api, create, assert_error, nodes_mock):
    sb = await create()
    assert_error(await api.post(f"/sandboxes/{sb['sandboxID']}/resume", json={"timeout": 60}), 409, "running")
    assert_error(await api.post("/sandboxes/nope/resume", json={"timeout": 60}), 404)
    assert nodes_mock.client.resume_sandbox.await_count == 0


async def test_resume_bad_timeout_is_400(api, paused, assert_error):
    sb = await paused()
    assert_error(await api.post(f"/sandboxes/{sb['sandboxID']}/resume", json={"timeout": "60"}), 400, "timeout")
    assert_error(await api.post(f"/sandboxes/{sb['sandboxID']}/resume", json={"timeout": -1}), 400, "timeout")
    assert await _state(sb["sandboxID"]) == "paused"


@pytest.mark.parametrize("exc_name, status", [("NodeTaskFailed", 500), ("NodeTimeout", 504),
                                              ("NodeUnavailable", 503)])
async def test_failed_resume_stays_paused(api, paused, nodes_mock, assert_error, exc_name, status):
    sb = await paused()
    exc_class = getattr(nodes_mock.client, exc_name)
    nodes_mock.client.resume_sandbox.side_effect = (exc_class("envd init failed", kind="EnvdInitFailed")
                                                    if exc_name == "NodeTaskFailed" else exc_class("boom"))
    assert_error(await api.post(f"/sandboxes/{sb['sandboxID']}/connect", json={"timeout": 60}), status)
    assert await _state(sb["sandboxID"]) == "paused"
    assert await _events(sb["sandboxID"], "resume") == [("resume", "started", "paused", "resuming"),
                                                         ("resume", "error", "resuming", "paused")]
    # and a later connect can try again
    nodes_mock.client.resume_sandbox.side_effect = None
    assert (await api.post(f"/sandboxes/{sb['sandboxID']}/connect", json={"timeout": 60})).status_code == 201


# --------------------------------------------------------------------------- connect


@pytest.mark.parametrize("path", ["/sandboxes/{id}/connect", "/v2/sandboxes/{id}/connect"])
async def test_connect_paused_resumes_201(api, paused, nodes_mock, path):
    sb = await paused()
    resp = await api.post(path.format(id=sb["sandboxID"]), json={"timeout": 300})
    assert resp.status_code == 201, resp.text
    body = resp.json()
    assert body["sandboxID"] == sb["sandboxID"] and body["envdAccessToken"] == sb["envdAccessToken"]
    assert await _state(sb["sandboxID"]) == "running"
    assert nodes_mock.client.resume_sandbox.await_count == 1


@pytest.mark.parametrize("path", ["/sandboxes/{id}/connect", "/v2/sandboxes/{id}/connect"])
async def test_connect_running_extends_only_200(api, create, nodes_mock, path):
    sb = await create(timeout=600)
    before = (await Sandbox.objects.aget(pk=sb["sandboxID"])).end_at
    resp = await api.post(path.format(id=sb["sandboxID"]), json={"timeout": 30})  # shorter: no change
    assert resp.status_code == 200, resp.text
    assert resp.json()["sandboxID"] == sb["sandboxID"] and resp.json()["envdAccessToken"] == sb["envdAccessToken"]
    assert (await Sandbox.objects.aget(pk=sb["sandboxID"])).end_at == before
    resp = await api.post(path.format(id=sb["sandboxID"]), json={"timeout": 3000})  # longer: extended
    assert resp.status_code == 200
    after = (await Sandbox.objects.aget(pk=sb["sandboxID"])).end_at
    assert after > before + timedelta(seconds=2000)
    assert nodes_mock.client.resume_sandbox.await_count == 0
    assert ("connect", "ok", "running", "running") in await _events(sb["sandboxID"], "connect")


async def test_connect_v2_lenient_bodies(api, paused):
    sb = await paused()
    assert (await api.post(f"/v2/sandboxes/{sb['sandboxID']}/connect", json={})).status_code == 201
    assert (await api.post(f"/v2/sandboxes/{sb['sandboxID']}/connect")).status_code == 200
    resp = await api.post(f"/v2/sandboxes/{sb['sandboxID']}/connect", json={"timeout": 600, "memory": False})
    assert resp.status_code == 200


async def test_connect_unknown_or_killed_is_404(api, create, assert_error):
    assert_error(await api.post("/sandboxes/nope/connect", json={"timeout": 30}), 404)
    assert_error(await api.post("/v2/sandboxes/nope/connect", json={}), 404)
    sb = await create()
    assert (await api.delete(f"/sandboxes/{sb['sandboxID']}")).status_code == 204
    assert_error(await api.post(f"/v2/sandboxes/{sb['sandboxID']}/connect", json={}), 404)


async def test_connect_bad_body_is_400(api, create, assert_error):
    sb = await create()
    assert_error(await api.post(f"/v2/sandboxes/{sb['sandboxID']}/connect", json={"memory": 1}), 400, "memory")
    assert_error(await api.post(f"/sandboxes/{sb['sandboxID']}/connect", json={"timeout": True}), 400, "timeout")


async def test_connect_while_pausing_waits_then_resumes(api, create, nodes_mock):
    sb = await create()
    gate = asyncio.Event()

    async def slow_pause(*args, **kwargs):
        await gate.wait()
        return dict(PAUSE_RESULT)

    nodes_mock.client.pause_sandbox.side_effect = slow_pause
    pause = asyncio.ensure_future(api.post(f"/sandboxes/{sb['sandboxID']}/pause"))
    for _ in range(100):
        if await _state(sb["sandboxID"]) == "pausing":
            break
        await asyncio.sleep(0.02)
    connect = asyncio.ensure_future(api.post(f"/v2/sandboxes/{sb['sandboxID']}/connect", json={}))
    await asyncio.sleep(0.3)
    assert not connect.done()
    gate.set()
    rp, rc = await asyncio.gather(pause, connect)
    assert (rp.status_code, rc.status_code) == (204, 201)
    assert await _state(sb["sandboxID"]) == "running"


async def test_concurrent_connects_resume_once(api, paused, nodes_mock):
    sb = await paused()

    async def slow_resume(*args, **kwargs):
        await asyncio.sleep(0.3)
        return dict(RESUME_RESULT)

    nodes_mock.client.resume_sandbox.side_effect = slow_resume
    results = await asyncio.gather(*[api.post(f"/v2/sandboxes/{sb['sandboxID']}/connect", json={})
                                     for _ in range(3)])
    assert sorted(r.status_code for r in results) == [200, 200, 201]
    assert nodes_mock.client.resume_sandbox.await_count == 1
    assert await _state(sb["sandboxID"]) == "running"


async def test_pause_resume_cycle_records_everything(api, paused, nodes_mock):
    sb = await paused()
    assert (await api.post(f"/v2/sandboxes/{sb['sandboxID']}/connect", json={})).status_code == 201
    assert (await api.post(f"/sandboxes/{sb['sandboxID']}/pause", json={"memory": True})).status_code == 204
    assert (await api.post(f"/sandboxes/{sb['sandboxID']}/resume", json={"timeout": 60})).status_code == 201
    ops = [(op, outcome) for op, outcome, *_ in await _events(sb["sandboxID"])]
    assert ops == [("create", "started"), ("create", "ok"), ("pause", "started"), ("pause", "ok"),
                   ("resume", "started"), ("resume", "ok"), ("pause", "started"), ("pause", "ok"),
                   ("resume", "started"), ("resume", "ok")]


@pytest.mark.parametrize("reconciled, status", [("running", 201), ("paused", 503), ("killing", 404)])
async def test_resume_waiter_follows_a_reconcile(api, paused, nodes_mock, reconciled, status):
    """A node worker that restarts mid-resume never answers; its reconcile decides."""
    sb = await paused()

    async def never(*args, **kwargs):
        await asyncio.sleep(3600)

    nodes_mock.client.resume_sandbox.side_effect = never
    request = asyncio.ensure_future(api.post(f"/sandboxes/{sb['sandboxID']}/connect", json={"timeout": 60}))
    for _ in range(100):
        if await _state(sb["sandboxID"]) == "resuming":
            break
        await asyncio.sleep(0.02)
    await Sandbox.objects.filter(pk=sb["sandboxID"]).aupdate(state=reconciled)
    resp = await asyncio.wait_for(request, 5)
    assert resp.status_code == status, resp.text
    assert await _state(sb["sandboxID"]) == reconciled
    if status != 201:
        assert ("resume", "aborted", "resuming", "") in await _events(sb["sandboxID"], "resume")


async def test_connect_v2_memory_false_reboots_on_the_node(api, paused, nodes_mock):
    """SDK ``connect(on_resume="reboot")`` sends ``{"memory": false}``: the node is asked to
    cold-boot on the disk; a plain connect restores the memory snapshot."""
    sb = await paused()
    resp = await api.post(f"/v2/sandboxes/{sb['sandboxID']}/connect", json={"memory": False})
    assert resp.status_code == 201, resp.text
    assert nodes_mock.client.resume_sandbox.await_args.kwargs["memory"] is False
    done = await SandboxEvent.objects.filter(sandbox_id=sb["sandboxID"], operation="resume", outcome="ok").alast()
    assert done.details["mode"] == "reboot"
    other = await paused()
    assert (await api.post(f"/v2/sandboxes/{other['sandboxID']}/connect", json={})).status_code == 201
    assert "memory" not in nodes_mock.client.resume_sandbox.await_args.kwargs


async def test_a_node_whose_tmpfs_is_full_is_503_not_500(api, nodes_mock, assert_error):
    """vmm.errors.HostMemoryFull on the node: no room there now (another node, or later, may)."""
    nodes_mock.client.boot_sandbox.side_effect = nodes_mock.client.NodeTaskFailed(
        "sandbox x: /dev/shm has 100 MiB free, less than its 512 MiB of memory plus the 1024 MiB kept",
        kind="HostMemoryFull")
    resp = await api.post("/v2/sandboxes", json={"templateID": "base"})
    assert_error(resp, 503, "has no room for this sandbox now")
    # an admission refusal: clients are told when to try again, the SDK not to retry at once
    assert resp.headers["Retry-After"] == "5" and resp.headers["Should-Retry"] == "false"
    from sandboxes.models import Sandbox  # noqa: PLC0415

    row = await Sandbox.objects.aget()
    assert row.state == "error" and "/dev/shm has 100 MiB free" in row.error_reason


async def test_a_resume_whose_saved_state_did_not_load_in_time_is_503_and_stays_paused(api, paused, nodes_mock,
                                                                                         assert_error):
    """A loaded host's incoming QEMU missed its deadline (vmm.errors.StateLoadTimeout): the node
    stopped it before the guest ran, so it is a refusal with Retry-After, not a node that broke."""
    sb = await paused()
    nodes_mock.client.resume_sandbox.side_effect = nodes_mock.client.NodeTaskFailed(
        "incoming from /x/device.state: still inmigrate after 60.0s", kind="StateLoadTimeout")
    resp = await api.post(f"/sandboxes/{sb['sandboxID']}/connect", json={"timeout": 60})
    assert_error(resp, 503, "too busy for this resume now")
    assert resp.headers["Retry-After"]
    assert await _state(sb["sandboxID"]) == "paused"
