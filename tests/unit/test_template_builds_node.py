"""The node boundary of template builds: ``nodes.client.build_template`` sends the task
to a real Celery worker running the real node task (the builder, whose failures at the base
need no VM), placement counts running builds, and the task's name is the protocol's."""
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from django.utils import timezone

from nodes import client, protocol
from nodes.client import NodeUnavailable
from nodes.models import Node
from nodes.placement import NoNodeAvailable, place
from sandboxes.models import Team, Template
from template_builds.models import BuildLogEntry, TemplateBuild
from tests.unit import test_nodes_client
from tests.unit.test_nodes_client import alive_node

pytestmark = pytest.mark.django_db(transaction=True)

# test_nodes_client's fixtures: a real Celery worker on a node queue, running the real node tasks.
envd_stub = test_nodes_client.envd_stub
node_worker = test_nodes_client.node_worker
_close_async_orm_connections = test_nodes_client._close_async_orm_connections


def _building_build(node_id, cpu=2, memory=1024):
    team, _ = Team.objects.get_or_create(slug="t", defaults={"name": "t"})
    template = Template.objects.create(id=f"t{timezone.now().timestamp():.0f}{cpu}{memory}"[:20], team=team,
                                       alias=f"a{cpu}{memory}", public=False)
    return TemplateBuild.objects.create(template=template, status="building", node_id=node_id,
                                        started_at=timezone.now(), cpu_count=cpu, memory_mb=memory)


async def _wait_finished(build_id, seconds=15):
    import asyncio  # noqa: PLC0415

    for _ in range(int(seconds / 0.05)):
        build = await TemplateBuild.objects.aget(pk=build_id)
        if build.status in ("ready", "error"):
            return build
        await asyncio.sleep(0.05)
    raise AssertionError("the node never finished the build")


async def test_a_real_node_worker_runs_the_builder_and_reports_a_base_failure(node_worker, settings, tmp_path):
    """The task goes through the broker to the node's builder, which reports through the
    database: a registry that does not answer (a closed port on loopback) fails the build at
    ``base`` with skopeo's words, and the log says what happened first."""
    settings.AENV_NODE_ID = node_worker.node_id
    settings.AENV_IMAGES_DIR = tmp_path / "images"
    settings.AENV_PRIVATE_REGISTRIES = ["127.0.0.1"]
    node = await sync_to_async(alive_node)(node_worker.node_id)
    build = await sync_to_async(_building_build)(node.pk)
    ref = f"127.0.0.1:{_closed_port()}/nothing/here:v1"
    task_id = await client.build_template(node, build_id=str(build.pk), template_id=build.template_id,
                                          spec={"team_id": "x", "from_image": ref, "steps": []},
                                          cpu_count=2, memory_mb=1024, disk_size_mb=4096)
    assert task_id
    done = await _wait_finished(build.pk, seconds=60)
    assert done.status == "error" and done.reason_step == "base", done.reason_message
    assert done.reason_message.startswith(f"error pulling image {ref}: no registry answered")
    assert done.accepted_at is not None and done.finished_at is not None
    entries = [e async for e in BuildLogEntry.objects.filter(build=build).order_by("index")]
    assert entries[0].message == f"[base] FROM {ref}" and entries[0].step == "base"
    assert entries[-1].level == "error" and entries[-1].message == f"Build failed: {done.reason_message}"


async def test_a_registry_on_the_nodes_own_addresses_is_refused(node_worker, settings, tmp_path):
    """Unless the operator lists it, a registry on loopback (the node's Redis, database, API…)
    is never contacted: the build fails at base before any pull."""
    settings.AENV_NODE_ID = node_worker.node_id
    settings.AENV_IMAGES_DIR = tmp_path / "images"
    settings.AENV_PRIVATE_REGISTRIES = []
    node = await sync_to_async(alive_node)(node_worker.node_id)
    build = await sync_to_async(_building_build)(node.pk)
    await client.build_template(node, build_id=str(build.pk), template_id=build.template_id,
                                spec={"team_id": "x", "from_image": "127.0.0.1:6379/redis-is-here:v1", "steps": []},
                                cpu_count=2, memory_mb=1024, disk_size_mb=4096)
    done = await _wait_finished(build.pk, seconds=60)
    assert done.status == "error" and done.reason_step == "base"
    assert "is on a private or local address (127.0.0.1)" in done.reason_message
    assert not (tmp_path / "images" / "oci").exists()  # nothing was pulled


def _closed_port() -> int:
    import socket  # noqa: PLC0415

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_the_node_task_skips_a_build_that_is_no_longer_building(node_worker, settings):
    settings.AENV_NODE_ID = node_worker.node_id
    node = await sync_to_async(alive_node)(node_worker.node_id)
    build = await sync_to_async(_building_build)(node.pk)
    await TemplateBuild.objects.filter(pk=build.pk).aupdate(status="error", reason_message="cancelled")
    from agent.tasks import build_template  # noqa: PLC0415

    out = await sync_to_async(build_template)(build_id=str(build.pk), template_id=build.template_id, spec={},
                                              cpu_count=2, memory_mb=1024, disk_size_mb=4096)
    assert out == {"status": "skipped"}
    assert (await TemplateBuild.objects.aget(pk=build.pk)).reason_message == "cancelled"
    assert not await BuildLogEntry.objects.filter(build=build).aexists()


async def test_build_template_refuses_a_dead_node():
    node = await Node.objects.acreate(id="dead", address="127.0.0.1",
                                      last_heartbeat_at=timezone.now() - timedelta(hours=1))
    with pytest.raises(NodeUnavailable, match="not alive"):
        await client.build_template(node, build_id="b", template_id="t", spec={}, cpu_count=1, memory_mb=128,
                                    disk_size_mb=1024)


async def test_build_template_sends_the_protocol_task_with_its_pickup_expiry(monkeypatch, settings):
    settings.AENV_TEMPLATE_PICKUP_TIMEOUT = 42
    sent = []

    async def fake_send(task, node, kwargs, deadline):
        sent.append((task, node.queue, kwargs, deadline))
        return "tid"

    monkeypatch.setattr(client, "_send", fake_send)
    node = await sync_to_async(alive_node)("n-send")
    assert await client.build_template(node, build_id="b1", template_id="t1", spec={"steps": []}, cpu_count=2,
                                       memory_mb=512, disk_size_mb=2048) == "tid"
    assert sent == [(protocol.BUILD_TEMPLATE, "node.n-send", dict(build_id="b1", template_id="t1",
                                                                   spec={"steps": []}, cpu_count=2, memory_mb=512,
                                                                   disk_size_mb=2048), 42.0)]


async def test_placement_counts_running_builds():
    node = await Node.objects.acreate(id="small", address="127.0.0.1", vcpu_capacity=4, memory_mb_capacity=2048,
                                      last_heartbeat_at=timezone.now())
    build = await sync_to_async(_building_build)(node.pk, cpu=4, memory=1024)
    with pytest.raises(NoNodeAvailable):
        await place(1, 128)
    await TemplateBuild.objects.filter(pk=build.pk).aupdate(status="ready")
    assert (await place(4, 2048)).pk == "small"
