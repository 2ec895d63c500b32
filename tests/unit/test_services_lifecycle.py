"""Lifecycle paths with the node side mocked: failures map to clean JSON errors at the
edge (domain errors inside), failed creates leave an ``error`` row + event and no VM,
transitions are conditional so concurrent requests cannot both win."""
import asyncio

import pytest

from lifecycle.sandboxes import core, create, kill
from sandboxes.errors import Conflict, NotFound
from sandboxes.models import Sandbox, SandboxEvent

pytestmark = pytest.mark.django_db(transaction=True)


async def _events(sandbox_id):
    return [(e.operation, e.outcome, e.to_state)
            async for e in SandboxEvent.objects.filter(sandbox_id=sandbox_id).order_by("id")]


async def _new(team, **kwargs) -> Sandbox:
    return (await create.create_sandbox(team, "base", **kwargs)).sandbox


async def _only_sandbox():
    assert await Sandbox.objects.acount() == 1
    return await Sandbox.objects.aget()


async def test_no_node_is_503_without_retry(api, nodes_mock, assert_error):
    nodes_mock.placement.place.side_effect = nodes_mock.placement.NoNodeAvailable("full")
    resp = await api.post("/v2/sandboxes", json={"templateID": "base"})
    assert_error(resp, 503, "no node")
    assert resp.headers["should-retry"] == "false"
    sb = await _only_sandbox()
    assert sb.state == "error" and "no node" in sb.error_reason and sb.node_id is None
    assert (await _events(sb.id))[-1] == ("create", "error", "error")
    nodes_mock.client.boot_sandbox.assert_not_awaited()
    assert (await api.get("/v2/sandboxes")).json() == []


async def test_node_timeout_is_504_and_cleans_up(api, nodes_mock, assert_error):
    nodes_mock.client.boot_sandbox.side_effect = nodes_mock.client.NodeTimeout("slow")
    resp = await api.post("/v2/sandboxes", json={"templateID": "base"})
    assert_error(resp, 504, "n1")
    assert resp.headers["should-retry"] == "false"
    sb = await _only_sandbox()
    assert sb.state == "error" and sb.node_id == "n1"
    nodes_mock.client.kill_sandbox.assert_awaited_once()  # whatever booted late is removed
    assert nodes_mock.client.kill_sandbox.await_args.kwargs == {"sandbox_id": sb.id}
    ev = await SandboxEvent.objects.filter(sandbox=sb, outcome="error").aget()
    assert ev.details["kind"] == "NodeTimeout" and ev.details["cleanup"]["ok"] is True


async def test_node_unavailable_is_503(api, nodes_mock, assert_error):
    nodes_mock.client.boot_sandbox.side_effect = nodes_mock.client.NodeUnavailable("broker down")
    assert_error(await api.post("/v2/sandboxes", json={"templateID": "base"}), 503, "broker down")
    assert (await _only_sandbox()).state == "error"


async def test_boot_failure_is_error_state_event_and_no_leak(api, nodes_mock, assert_error):
    nodes_mock.client.boot_sandbox.side_effect = nodes_mock.client.NodeTaskFailed("envd never answered",
                                                                                  kind="BootTimeout")
    nodes_mock.client.kill_sandbox.side_effect = nodes_mock.client.NodeUnavailable("gone too")
    body = assert_error(await api.post("/v2/sandboxes", json={"templateID": "base"}), 500, "envd never answered")
    assert body["error_code"] == "boot_timeout"
    sb = await _only_sandbox()
    assert sb.state == "error" and "BootTimeout" in sb.error_reason
    nodes_mock.client.kill_sandbox.assert_awaited_once()
    ev = await SandboxEvent.objects.filter(sandbox=sb, outcome="error").aget()
    assert ev.details["cleanup"] == {"ok": False, "error": "NodeUnavailable: gone too"}
    assert (await api.get("/v2/sandboxes")).json() == []
    # a failed sandbox is gone for the API
    assert_error(await api.get(f"/sandboxes/{sb.id}"), 404)


async def test_unexpected_exception_is_json_500_not_bare(api, nodes_mock, assert_error):
    nodes_mock.client.boot_sandbox.side_effect = KeyError("envd_host")
    assert_error(await api.post("/v2/sandboxes", json={"templateID": "base"}), 500, "KeyError")
    assert (await _only_sandbox()).state == "error"


async def test_killed_while_creating_kills_the_vm(team, base_template, nodes_mock):
    booting = asyncio.Event()

    async def slow_boot(node, **kw):
        booting.set()
        await asyncio.sleep(0.3)
        return {"envd_host": "127.0.0.1", "envd_port": 1, "pid": 1, "accel": "tcg", "timings": {}}

    nodes_mock.client.boot_sandbox.side_effect = slow_boot
    creating = asyncio.create_task(_new(team))
    await booting.wait()
    sb = await Sandbox.objects.aget()
    assert sb.state == "creating" and sb.node_id == "n1"
    await kill.kill_sandbox(team, sb.id)
    with pytest.raises(Conflict) as err:
        await creating
    assert err.value.retry is False
    sb = await Sandbox.objects.aget()
    assert sb.state == "killed"
    # one kill from the kill request, one from create noticing it lost the race
    assert nodes_mock.client.kill_sandbox.await_count == 2
    assert ("create", "aborted", "") in await _events(sb.id)


async def test_cancelled_request_still_finishes_the_boot(team, base_template, nodes_mock):
    booting = asyncio.Event()

    async def slow_boot(node, **kw):
        booting.set()
        await asyncio.sleep(0.3)
        return {"envd_host": "127.0.0.1", "envd_port": 1, "pid": 1, "accel": "tcg", "timings": {}}

    nodes_mock.client.boot_sandbox.side_effect = slow_boot
    task = asyncio.create_task(_new(team))
    await asyncio.wait_for(booting.wait(), 30)  # cancelled while the node boots (not before: under load
    task.cancel()                               # placement alone can take longer than any fixed wait)
    with pytest.raises(asyncio.CancelledError):
        await task
    deadline = asyncio.get_running_loop().time() + 15  # the boot's own 0.3 s, then the commit (slow under load)
    while True:
        await asyncio.sleep(0.05)
        sb = await Sandbox.objects.aget()
        if sb.state != "creating" or asyncio.get_running_loop().time() > deadline:
            break
    assert sb.state == "running"  # not stuck in creating with an unknown VM


async def test_two_concurrent_kills_one_wins(team, base_template, nodes_mock):
    async def slow_kill(node, **kw):
        await asyncio.sleep(0.2)
        return {"killed": True}

    sb = await _new(team)
    nodes_mock.client.kill_sandbox.side_effect = slow_kill
    results = await asyncio.gather(kill.kill_sandbox(team, sb.id), kill.kill_sandbox(team, sb.id),
                                   return_exceptions=True)
    errors = [r for r in results if isinstance(r, Exception)]
    assert len(errors) == 1 and isinstance(errors[0], NotFound)
    assert nodes_mock.client.kill_sandbox.await_count == 1
    assert (await Sandbox.objects.aget(pk=sb.id)).state == "killed"
    assert [e for e in await _events(sb.id) if e[0] == "kill"] == [("kill", "started", "killing"),
                                                                    ("kill", "ok", "killed")]


async def test_transition_is_conditional(team, base_template, nodes_mock):
    sb = await _new(team)
    ev = core.event(sb.id, "kill")
    assert await core.transition(sb.id, ["running"], "killing", ev) is True
    assert await core.transition(sb.id, ["running"], "killing", core.event(sb.id, "kill")) is False
    assert await SandboxEvent.objects.filter(sandbox=sb, operation="kill", outcome="ok").acount() == 1


async def test_dead_node_does_not_hang_kill(team, base_template, nodes_mock, settings):
    settings.AENV_KILL_DEADLINE = 0.2

    async def hang(node, **kw):
        await asyncio.sleep(30)

    sb = await _new(team)
    nodes_mock.client.kill_sandbox.side_effect = hang
    killed = await asyncio.wait_for(kill.kill_sandbox(team, sb.id), timeout=5)
    assert killed.state == "killed" and killed.killed_at is not None
    assert "not confirmed" in killed.error_reason and "n1" in killed.error_reason
    ev = await SandboxEvent.objects.filter(sandbox=sb, operation="kill", to_state="killed").aget()
    assert ev.outcome == "unconfirmed" and ev.details["ok"] is False


async def test_kill_of_unknown_or_other_team(team, other_team, base_template, nodes_mock):
    sb = await _new(team)
    for t, sid in ((other_team, sb.id), (team, "inope")):
        with pytest.raises(NotFound):
            await kill.kill_sandbox(t, sid)
    assert (await Sandbox.objects.aget(pk=sb.id)).state == "running"


async def test_idempotency_key_returns_the_same_sandbox(api, nodes_mock):
    h = {"Idempotency-Key": "abc-123"}
    first = await api.post("/v2/sandboxes", json={"templateID": "base"}, headers=h)
    again = await api.post("/v2/sandboxes", json={"templateID": "base"}, headers=h)
    assert first.status_code == again.status_code == 201
    assert first.json() == again.json()
    assert nodes_mock.client.boot_sandbox.await_count == 1
    other = await api.post("/v2/sandboxes", json={"templateID": "base"}, headers={"Idempotency-Key": "other"})
    assert other.json()["sandboxID"] != first.json()["sandboxID"]


async def test_idempotency_key_concurrent_requests_boot_once(api, nodes_mock):
    async def slow_boot(node, **kw):
        await asyncio.sleep(0.3)
        return {"envd_host": "127.0.0.1", "envd_port": 1, "pid": 1, "accel": "tcg", "timings": {}}

    nodes_mock.client.boot_sandbox.side_effect = slow_boot
    h = {"Idempotency-Key": "same"}
    a, b = await asyncio.gather(api.post("/v2/sandboxes", json={"templateID": "base"}, headers=h),
                                api.post("/v2/sandboxes", json={"templateID": "base"}, headers=h))
    assert a.status_code == b.status_code == 201, (a.text, b.text)
    assert a.json()["sandboxID"] == b.json()["sandboxID"]
    assert nodes_mock.client.boot_sandbox.await_count == 1


async def test_idempotency_key_is_per_team(api, anon, other_key, nodes_mock):
    h = {"Idempotency-Key": "k1"}
    mine = await api.post("/v2/sandboxes", json={"templateID": "base"}, headers=h)
    theirs = await anon.post("/v2/sandboxes", json={"templateID": "base"}, headers={**h, "X-API-Key": other_key})
    assert theirs.status_code == 201 and theirs.json()["sandboxID"] != mine.json()["sandboxID"]


async def test_idempotency_key_after_failure_creates_anew(api, nodes_mock, assert_error):
    h = {"Idempotency-Key": "retry-me"}
    nodes_mock.client.boot_sandbox.side_effect = nodes_mock.client.NodeUnavailable("down")
    assert_error(await api.post("/v2/sandboxes", json={"templateID": "base"}, headers=h), 503)
    nodes_mock.client.boot_sandbox.side_effect = None
    ok = await api.post("/v2/sandboxes", json={"templateID": "base"}, headers=h)
    assert ok.status_code == 201
    failed = await Sandbox.objects.aget(state="error")
    assert failed.idempotency_key == "" and ok.json()["sandboxID"] != failed.id
    ev = await SandboxEvent.objects.filter(sandbox=failed, outcome="started").aget()
    assert ev.details["idempotency_key"] == "retry-me"  # the history keeps it


async def test_idempotency_key_too_long_is_400(api, nodes_mock, assert_error):
    assert_error(await api.post("/v2/sandboxes", json={"templateID": "base"},
                                headers={"Idempotency-Key": "a" * 256}), 400)


@pytest.mark.parametrize("seconds", [-1, 10**9, "5", True])
async def test_the_api_edge_validates_timeout(api, nodes_mock, assert_error, seconds):
    assert_error(await api.post("/v2/sandboxes", json={"templateID": "base", "timeout": seconds}), 400)
    nodes_mock.client.boot_sandbox.assert_not_awaited()


async def test_a_create_whose_node_goes_silent_answers_why_once_the_sandbox_is_lost(api, nodes_mock, assert_error):
    """The node never answers the boot; the sweeper declares the sandbox lost with its node:
    the create answers at once with the sweeper's reason, not a guess that the node restarted."""
    answered, booting = asyncio.Event(), asyncio.Event()

    async def never(node, **kw):
        booting.set()
        await answered.wait()  # cancelled by the create once the row moved

    async def sweeper():
        # the sweeper declares lost what a silent node holds: a sandbox placed, its boot sent
        # (earlier, under load, the move could beat the placement's claim: a kill's 409 instead)
        await asyncio.wait_for(booting.wait(), 30)
        sb = await Sandbox.objects.aget()
        reason = "lost: node n1 stopped answering (no heartbeat for 121 s)"
        assert await core.transition(sb.id, ["creating"], "error", core.event(sb.id, "lost"), error_reason=reason)

    nodes_mock.client.boot_sandbox.side_effect = never
    resp, _ = await asyncio.gather(api.post("/v2/sandboxes", json={"templateID": "base"}), sweeper())
    assert_error(resp, 503, "node n1: lost: node n1 stopped answering (no heartbeat for 121 s) (now error)")
    assert (await _only_sandbox()).state == "error"
