"""A node silent for AENV_NODE_LOST_AFTER is dead: the sweeper declares what ran there lost
(error, with the reason and a ``lost`` event), a kill in flight done, and leaves paused
sandboxes and every other node's sandboxes alone; a node that is only late is not dead."""
from datetime import timedelta

import pytest
from django.utils import timezone

from nodes.models import Node
from lifecycle import lost
from lifecycle.expiry import sweep_once
from sandboxes.models import Sandbox, SandboxEvent, Team, Template

pytestmark = pytest.mark.django_db(transaction=True)


def _setup(silent_s: float):
    team = Team.objects.create(slug="t", name="t")
    tpl = Template.objects.create(id="base")
    dead = Node.objects.create(id="dead", address="127.0.0.1", last_heartbeat_at=timezone.now() - timedelta(seconds=silent_s))
    alive = Node.objects.create(id="alive", address="127.0.0.1", last_heartbeat_at=timezone.now())
    ids = {}
    for node in (dead, alive):
        for state in ("running", "creating", "forking", "paused", "killing", "killed"):
            ids[(node.pk, state)] = Sandbox.objects.create(
                team=team, template=tpl, node=node, state=state, end_at=timezone.now() + timedelta(hours=1)).pk
    return ids


def test_the_sandboxes_of_a_dead_node_are_lost(settings):
    settings.AENV_NODE_LOST_AFTER = 120
    ids = _setup(silent_s=300)
    done = {(sid, was, to) for sid, was, to in lost.mark_lost.func()}
    expect = {(ids[("dead", s)], s, "error") for s in ("running", "creating", "forking")}
    expect.add((ids[("dead", "killing")], "killing", "killed"))
    assert done == expect
    states = dict(Sandbox.objects.values_list("pk", "state"))
    assert states[ids[("dead", "paused")]] == "paused"  # its files outlive its processes
    assert all(states[ids[("alive", s)]] == s for s in ("running", "creating", "forking", "paused", "killing"))
    row = Sandbox.objects.get(pk=ids[("dead", "running")])
    assert row.error_reason.startswith("lost: node dead stopped answering (no heartbeat for 3")
    event = SandboxEvent.objects.get(sandbox_id=row.pk, operation="lost")
    assert (event.from_state, event.to_state, event.details["node"]) == ("running", "error", "dead")
    assert Sandbox.objects.get(pk=ids[("dead", "killing")]).killed_at is not None
    assert lost.mark_lost.func() == []  # once


def test_a_late_node_is_not_dead(settings):
    settings.AENV_NODE_LOST_AFTER = 120
    ids = _setup(silent_s=60)  # past the heartbeat timeout (not placed on), not yet lost
    assert lost.mark_lost.func() == []
    assert Sandbox.objects.get(pk=ids[("dead", "running")]).state == "running"


async def test_the_sweeper_declares_them(settings):
    from asgiref.sync import sync_to_async  # noqa: PLC0415

    settings.AENV_NODE_LOST_AFTER = 120
    ids = await sync_to_async(_setup)(silent_s=600)
    await sweep_once()
    assert (await Sandbox.objects.aget(pk=ids[("dead", "running")])).state == "error"
