"""A node worker that stops cleanly says so (agent.heartbeat.mark_stopped, called by
agent.worker): placement and nodes.client leave it at once, not once its last heartbeat ages
out; its next registration brings it back; and what it left running is still declared lost if
it never comes back (the heartbeat is kept)."""
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from django.db import connections
from django.utils import timezone

from agent.heartbeat import mark_stopped, register_node
from lifecycle import lost
from nodes import client
from nodes.models import Node
from nodes.placement import NoNodeAvailable, place
from nodes.summary import DEAD, READY, status_of
from sandboxes.models import Sandbox, Team, Template

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
async def _close_async_orm_connections():
    yield
    await sync_to_async(connections.close_all)()


def _register(node_id: str) -> Node:
    return register_node(node_id=node_id, address="127.0.0.1", driver_name="qemu", accel="tcg", vcpu_capacity=8,
                         memory_mb_capacity=4096)


async def test_a_stopped_node_gets_no_placement_until_it_registers_again():
    await sync_to_async(_register)("n1")
    assert (await place(2, 512)).pk == "n1"
    await sync_to_async(mark_stopped)("n1")
    node = await Node.objects.aget(pk="n1")
    assert node.stopped_at is not None and node.last_heartbeat_at is not None  # the heartbeat is kept
    assert not node.is_alive() and status_of(node) == DEAD
    with pytest.raises(NoNodeAvailable):
        await place(2, 512)
    with pytest.raises(client.NodeUnavailable):  # a task for a sandbox there is refused at once
        await client._sendable(node)
    await sync_to_async(_register)("n1")  # its next start
    node = await Node.objects.aget(pk="n1")
    assert node.stopped_at is None and node.is_alive() and status_of(node) == READY
    assert (await place(2, 512)).pk == "n1"


def test_what_a_stopped_node_left_running_is_lost_once_it_stays_away(settings):
    settings.AENV_NODE_LOST_AFTER = 60
    node = _register("n2")
    team = Team.objects.create(slug="t", name="t")
    template, _ = Template.objects.get_or_create(id="base")
    sbx = Sandbox.objects.create(team=team, template=template, node=node, state="running", cpu_count=1,
                                 memory_mb=256, end_at=timezone.now() + timedelta(minutes=5))
    mark_stopped("n2")
    assert lost.dead_nodes(timezone.now()) == []  # stopped, not yet silent long enough
    Node.objects.filter(pk="n2").update(last_heartbeat_at=timezone.now() - timedelta(seconds=61))
    assert [n.pk for n in lost.dead_nodes(timezone.now())] == ["n2"]
    assert [row[0] for row in lost.mark_lost.func()] == [sbx.pk]


def test_the_admins_heartbeat_filter_agrees_with_is_alive():
    from nodes.admin import AliveFilter  # noqa: PLC0415

    _register("up")
    _register("stopped")
    mark_stopped("stopped")
    Node.objects.create(id="never", address="127.0.0.1")

    def listed(value):
        chosen = AliveFilter(None, {"alive": [value]}, Node, None)  # as the admin passes request.GET
        return sorted(n.pk for n in chosen.queryset(None, Node.objects.all()))

    assert listed("yes") == ["up"]
    assert listed("no") == ["never", "stopped"]
    assert sorted(n.pk for n in Node.objects.all() if n.is_alive()) == listed("yes")
