"""The lifecycle sweeper (lifecycle.expiry) with the node side mocked: expired running
sandboxes are paused or killed as created, paused ones past retention are killed, every
action is a conditional transition with events by "lifecycle", and two sweepers never
both act. Runs on SQLite and, with DATABASE_URL, on PostgreSQL."""
import asyncio
from datetime import timedelta

import pytest
from conftest import PAUSE_RESULT
from django.core.management import call_command
from django.utils import timezone

from lifecycle import expiry
from lifecycle.sandboxes import create, ttl
from lifecycle.sandboxes.options import SandboxOptions
from sandboxes.models import Sandbox, SandboxEvent

pytestmark = pytest.mark.django_db(transaction=True)


async def _expire(sandbox_id: str, seconds_ago: float = 1) -> None:
    await Sandbox.objects.filter(pk=sandbox_id).aupdate(end_at=timezone.now() - timedelta(seconds=seconds_ago))


async def _events(sandbox_id: str, operation: str):
    return [e async for e in SandboxEvent.objects.filter(sandbox_id=sandbox_id, operation=operation).order_by("id")]


async def _state(sandbox_id: str) -> str:
    return (await Sandbox.objects.aget(pk=sandbox_id)).state


async def test_expired_sandbox_without_autopause_field_is_paused(create, nodes_mock):
    sb = await create(timeout=60)
    other = await create(timeout=60)  # not expired: untouched
    await _expire(sb["sandboxID"])
    outcomes = await expiry.sweep_once()
    assert outcomes == [(sb["sandboxID"], "expire_pause", "paused")]
    assert await _state(sb["sandboxID"]) == "paused" and await _state(other["sandboxID"]) == "running"
    nodes_mock.client.pause_sandbox.assert_awaited_once()
    started, done = await _events(sb["sandboxID"], "pause")
    assert (started.outcome, started.to_state, started.actor) == ("started", "pausing", "lifecycle")
    assert started.details["reason"] == "expired"
    assert (done.outcome, done.to_state, done.actor) == ("ok", "paused", "lifecycle")
    assert await expiry.sweep_once() == []  # a paused sandbox does not expire again


async def test_expired_sandbox_with_autopause_false_is_killed(create, nodes_mock):
    sb = await create(timeout=60, autoPause=False)
    await _expire(sb["sandboxID"])
    assert await expiry.sweep_once() == [(sb["sandboxID"], "expire_kill", "killed")]
    row = await Sandbox.objects.aget(pk=sb["sandboxID"])
    assert row.state == "killed" and row.killed_at is not None
    nodes_mock.client.pause_sandbox.assert_not_awaited()
    assert nodes_mock.client.kill_sandbox.await_args.kwargs == {"sandbox_id": sb["sandboxID"]}
    kills = await _events(sb["sandboxID"], "kill")
    assert [(e.outcome, e.to_state, e.actor, e.details.get("reason")) for e in kills] == [
        ("started", "killing", "lifecycle", "expired"), ("ok", "killed", "lifecycle", "expired")]


async def test_detail_shows_the_timeout_action(api, create):
    default = await create()
    killed = await create(autoPause=False)
    resumable = await create(autoPause=True, autoResume={"enabled": True})
    lifecycle = {sid: (await api.get(f"/sandboxes/{sid}")).json()["lifecycle"]
                 for sid in (default["sandboxID"], killed["sandboxID"], resumable["sandboxID"])}
    assert lifecycle[default["sandboxID"]] == {"autoResume": False, "onTimeout": "pause"}
    assert lifecycle[killed["sandboxID"]] == {"autoResume": False, "onTimeout": "kill"}
    assert lifecycle[resumable["sandboxID"]] == {"autoResume": True, "onTimeout": "pause"}


async def test_autopause_memory_false_pauses_filesystem_only(create, nodes_mock):
    seen = {}

    async def pause_with_memory(node, *, sandbox_id, to_disk=True, memory=True, deadline=None):
        seen.update(sandbox_id=sandbox_id, memory=memory)
        return dict(PAUSE_RESULT)

    nodes_mock.client.pause_sandbox = pause_with_memory
    sb = await create(timeout=60, autoPause=True, autoPauseMemory=False)
    assert (await Sandbox.objects.aget(pk=sb["sandboxID"])).auto_pause_memory is False
    await _expire(sb["sandboxID"])
    assert await expiry.sweep_once() == [(sb["sandboxID"], "expire_pause", "paused")]
    assert seen == {"sandbox_id": sb["sandboxID"], "memory": False}
    done = (await _events(sb["sandboxID"], "pause"))[-1]
    assert done.details["mode"] == "filesystem" and done.details["memory"] is False


async def test_extension_after_the_decision_wins(create, team, nodes_mock):
    sb = await create(timeout=60)
    await _expire(sb["sandboxID"])
    [action] = await expiry.due()
    await ttl.set_timeout(team, sb["sandboxID"], 600)  # the user extends meanwhile
    assert (await expiry.apply(action)).startswith("skipped")
    assert await _state(sb["sandboxID"]) == "running"
    assert await _events(sb["sandboxID"], "pause") == []
    nodes_mock.client.pause_sandbox.assert_not_awaited()
    kill = expiry.Action(sb["sandboxID"], action.team_id, "expire_kill", action.seen)
    assert (await expiry.apply(kill)).startswith("skipped")
    assert await _state(sb["sandboxID"]) == "running"


async def test_two_sweepers_act_once(create, nodes_mock):
    gate = asyncio.Event()

    async def slow_pause(*args, **kwargs):
        await gate.wait()
        return dict(PAUSE_RESULT)

    nodes_mock.client.pause_sandbox.side_effect = slow_pause
    sb = await create(timeout=60)
    await _expire(sb["sandboxID"])
    a, b = expiry.Sweeper(), expiry.Sweeper()
    # both decide before either acts
    actions = await asyncio.gather(expiry.due(), expiry.due())
    assert all(len(x) == 1 for x in actions)
    runs = [asyncio.create_task(expiry.apply(x[0])) for x in actions]
    await asyncio.sleep(0.3)
    gate.set()
    outcomes = sorted(await asyncio.gather(*runs))
    assert outcomes[0] == "paused" and outcomes[1].startswith("skipped")
    # and the loop form: a second tick of the same sweeper never re-dispatches
    assert await a.tick() == [] and await b.tick() == []
    assert nodes_mock.client.pause_sandbox.await_count == 1
    assert [e.outcome for e in await _events(sb["sandboxID"], "pause")] == ["started", "ok"]


async def test_failed_expiry_pause_backs_off(create, nodes_mock):
    nodes_mock.client.pause_sandbox.side_effect = nodes_mock.client.NodeTaskFailed("disk full", kind="VMError")
    sb = await create(timeout=60)
    await _expire(sb["sandboxID"])
    sweeper = expiry.Sweeper()
    assert len(await sweeper.tick()) == 1
    await sweeper.drain()
    assert sweeper.outcomes[0][2].startswith("failed") and "disk full" in sweeper.outcomes[0][2]
    assert await _state(sb["sandboxID"]) == "running"  # the node continued the VM
    assert await sweeper.tick() == []  # not retried every tick
    nodes_mock.client.pause_sandbox.side_effect = None
    sweeper.backoff.clear()
    assert len(await sweeper.tick()) == 1
    await sweeper.drain()
    assert await _state(sb["sandboxID"]) == "paused"


async def _paused_for(api, create, seconds: float) -> str:
    sb = await create(timeout=60)
    assert (await api.post(f"/sandboxes/{sb['sandboxID']}/pause")).status_code == 204
    when = timezone.now() - timedelta(seconds=seconds)
    await SandboxEvent.objects.filter(sandbox_id=sb["sandboxID"], to_state="paused").aupdate(started_at=when)
    return sb["sandboxID"]


async def test_retention_kills_old_paused_sandboxes_only(api, create, nodes_mock, settings):
    settings.AENV_PAUSED_RETENTION = 3600
    old = await _paused_for(api, create, 7200)
    fresh = await _paused_for(api, create, 60)
    nodes_mock.client.kill_sandbox.reset_mock()
    assert await expiry.sweep_once() == [(old, "retention_kill", "killed")]
    assert await _state(old) == "killed" and await _state(fresh) == "paused"
    assert nodes_mock.client.kill_sandbox.await_args.kwargs == {"sandbox_id": old}
    assert [e.details.get("reason") for e in await _events(old, "kill")] == ["retention", "retention"]


async def test_retention_zero_keeps_paused_sandboxes(api, create, nodes_mock, settings):
    settings.AENV_PAUSED_RETENTION = 0
    sid = await _paused_for(api, create, 10**7)
    assert await expiry.sweep_once() == []
    assert await _state(sid) == "paused"


async def test_retention_kill_skips_a_sandbox_touched_meanwhile(api, create, nodes_mock, settings):
    settings.AENV_PAUSED_RETENTION = 3600
    sid = await _paused_for(api, create, 7200)
    [action] = await expiry.due()
    await Sandbox.objects.filter(pk=sid).aupdate(state="resuming")  # a connect won the race
    assert (await expiry.apply(action)).startswith("skipped")
    assert await _state(sid) == "resuming"


async def test_run_loop_stops(create, nodes_mock):
    sb = await create(timeout=60, autoPause=False)
    await _expire(sb["sandboxID"])
    stop = asyncio.Event()
    sweeper = expiry.Sweeper()
    loop = asyncio.create_task(sweeper.run(0.05, stop))
    for _ in range(100):
        if await _state(sb["sandboxID"]) == "killed":
            break
        await asyncio.sleep(0.05)
    stop.set()
    await asyncio.wait_for(loop, 5)
    assert await _state(sb["sandboxID"]) == "killed"


def test_management_command_once(team, base_template, nodes_mock, capsys):
    from asgiref.sync import async_to_sync

    sb = async_to_sync(create.create_sandbox)(team, "base", SandboxOptions(auto_pause=False), timeout=60).sandbox
    Sandbox.objects.filter(pk=sb.id).update(end_at=timezone.now() - timedelta(seconds=5))
    call_command("run_lifecycle", "--once")
    assert f"{sb.id} expire_kill: killed" in capsys.readouterr().out
    assert Sandbox.objects.get(pk=sb.id).state == "killed"
