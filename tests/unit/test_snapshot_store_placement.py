"""Where a restore runs, per snapshot backend: posix_fs only on the snapshot's own
node; s3 on that node when it can, else on any alive node with room."""
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from django.utils import timezone

from nodes.models import Node
from nodes.placement import NoNodeAvailable
from snapshots.models import Snapshot, SnapshotState
from lifecycle.sources import restore_node

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def two_nodes(db):
    now = timezone.now()
    own = Node.objects.create(id="own", address="127.0.0.1", vcpu_capacity=8, memory_mb_capacity=4096,
                              last_heartbeat_at=now)
    other = Node.objects.create(id="other", address="127.0.0.2", vcpu_capacity=8, memory_mb_capacity=4096,
                                last_heartbeat_at=now)
    return own, other


@pytest.fixture
def snapshot(team, base_template, two_nodes):
    return Snapshot.objects.create(team=team, template=base_template, node=two_nodes[0], state=SnapshotState.READY,
                                   cpu_count=2, memory_mb=512)


@sync_to_async
def _kill_node(node_id):
    Node.objects.filter(pk=node_id).update(last_heartbeat_at=timezone.now() - timedelta(hours=1))


async def test_own_node_is_preferred_with_either_backend(snapshot, settings):
    for backend in ("posix_fs", "s3"):
        settings.AENV_SNAPSHOT_BACKEND = backend
        assert (await restore_node(snapshot)).pk == "own"


async def test_posix_fs_needs_the_own_node(snapshot, settings):
    settings.AENV_SNAPSHOT_BACKEND = "posix_fs"
    await _kill_node("own")
    with pytest.raises(NoNodeAvailable, match="holding snapshot .* is not available"):
        await restore_node(snapshot)


async def test_s3_restores_on_another_alive_node(snapshot, settings):
    settings.AENV_SNAPSHOT_BACKEND = "s3"
    await _kill_node("own")
    assert (await restore_node(snapshot)).pk == "other"
    await _kill_node("other")
    with pytest.raises(NoNodeAvailable, match=f"no node can restore snapshot {snapshot.id}"):
        await restore_node(snapshot)


async def test_s3_goes_elsewhere_when_the_own_node_is_full(snapshot, settings):
    settings.AENV_SNAPSHOT_BACKEND = "s3"
    await Node.objects.filter(pk="own").aupdate(memory_mb_capacity=256)
    assert (await restore_node(snapshot)).pk == "other"
    settings.AENV_SNAPSHOT_BACKEND = "posix_fs"
    with pytest.raises(NoNodeAvailable, match="has no room"):
        await restore_node(snapshot)
