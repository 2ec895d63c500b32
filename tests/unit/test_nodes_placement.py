"""Placement: only alive, non-draining nodes with room; least loaded first."""
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from django.db import connections
from django.utils import timezone

from nodes.models import Node
from nodes.placement import NoNodeAvailable, place
from sandboxes.models import Sandbox, Team, Template

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
async def _close_async_orm_connections():
    """The async ORM runs on asgiref's shared thread; close its connection after each
    test, as Django's request cycle would, so PostgreSQL can drop the test database."""
    yield
    await sync_to_async(connections.close_all)()


def make_node(node_id, *, vcpus=8, memory=4096, age_s=0, draining=False, heartbeat=True):
    return Node.objects.create(
        id=node_id, address="127.0.0.1", vcpu_capacity=vcpus, memory_mb_capacity=memory, draining=draining,
        last_heartbeat_at=(timezone.now() - timedelta(seconds=age_s)) if heartbeat else None,
    )


def add_sandbox(node, *, cpu=2, mem=512, state="running"):
    team, _ = Team.objects.get_or_create(slug="t", defaults={"name": "t"})
    tpl, _ = Template.objects.get_or_create(id="base")
    return Sandbox.objects.create(team=team, template=tpl, node=node, state=state, cpu_count=cpu,
                                  memory_mb=mem, end_at=timezone.now() + timedelta(minutes=5))


async def test_no_nodes_raises():
    with pytest.raises(NoNodeAvailable):
        await place(2, 512)


async def test_dead_draining_and_never_seen_nodes_are_skipped():
    await sync_to_async(make_node)("dead", age_s=3600)
    await sync_to_async(make_node)("drain", draining=True)
    await sync_to_async(make_node)("never", heartbeat=False)
    with pytest.raises(NoNodeAvailable):
        await place(1, 128)
    await sync_to_async(make_node)("alive")
    assert (await place(1, 128)).id == "alive"


async def test_capacity_counts_reserving_sandboxes_only():
    node = await sync_to_async(make_node)("n1", vcpus=4, memory=2048)
    await sync_to_async(add_sandbox)(node, cpu=2, mem=1024, state="running")
    await sync_to_async(add_sandbox)(node, cpu=2, mem=512, state="creating")
    # paused and killed sandboxes hold nothing
    await sync_to_async(add_sandbox)(node, cpu=4, mem=2048, state="paused")
    await sync_to_async(add_sandbox)(node, cpu=4, mem=2048, state="killed")
    with pytest.raises(NoNodeAvailable):
        await place(1, 128)  # 4/4 vCPU reserved
    await sync_to_async(Sandbox.objects.filter(state="creating").update)(state="error")
    assert (await place(2, 512)).id == "n1"
    with pytest.raises(NoNodeAvailable):
        await place(2, 1024 + 1)  # memory: 1024 reserved of 2048


async def test_least_loaded_first():
    busy = await sync_to_async(make_node)("a-busy", vcpus=8, memory=8192)
    await sync_to_async(make_node)("b-idle", vcpus=8, memory=8192)
    await sync_to_async(add_sandbox)(busy, cpu=4, mem=1024)
    assert (await place(2, 512)).id == "b-idle"
    # a node too small for the request is skipped even if idle
    await sync_to_async(Node.objects.filter(pk="b-idle").update)(vcpu_capacity=1)
    assert (await place(2, 512)).id == "a-busy"


async def test_on_a_given_node_it_or_nothing():
    """A fork lands on its parent's node: that node when it fits, else a reason, never another."""
    busy = await sync_to_async(make_node)("a-busy", vcpus=4)
    await sync_to_async(make_node)("b-idle", vcpus=64)
    await sync_to_async(add_sandbox)(busy, cpu=2)
    assert (await place(2, 512, on=busy)).id == "a-busy"
    with pytest.raises(NoNodeAvailable, match="node a-busy has no room for 4 vCPU"):
        await place(4, 512, on=busy)
    gone = await sync_to_async(make_node)("c-gone", age_s=3600)
    with pytest.raises(NoNodeAvailable, match="node c-gone is not available"):
        await place(1, 128, on=gone)


async def test_prefer_a_node_then_anywhere():
    """A restore any node can fetch prefers the snapshot's node (no download), else the
    least loaded that fits."""
    own = await sync_to_async(make_node)("own", vcpus=4)
    await sync_to_async(make_node)("other", vcpus=64)
    assert (await place(2, 512, prefer=own)).id == "own"
    assert (await place(8, 512, prefer=own)).id == "other"
    draining = await sync_to_async(make_node)("drain", draining=True)
    assert (await place(1, 128, prefer=draining)).id != "drain"
