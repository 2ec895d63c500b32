"""A sandbox's volumes follow it (the node side mocked): fork children get the parent's
mounts (rows, E2B's ``volumeMounts``, what their node is told), a resume tells the node which
volumes to serve in the new slot (the guest has them mounted), a snapshot keeps its sandbox's
mounts, and every one of them keeps the volume "in use" until it is gone."""
from unittest import mock

import pytest

from sandboxes.models import Sandbox
from snapshots.models import Snapshot
from volumes.models import SandboxVolume, SnapshotVolume

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _volumes_dir(settings, tmp_path):
    settings.AENV_VOLUMES_DIR = tmp_path / "volumes"


@pytest.fixture
async def mounted(api, create, team):
    """A volume and a running sandbox that mounts it at /data."""
    vol = (await api.post("/volumes", json={"name": "data"})).json()
    sandbox = await create(volumeMounts=[{"name": "data", "path": "/data"}])
    wire = {"dir": f"{team.pk}/{vol['volumeID']}", "export_id": 1, "path": "/data"}
    return vol, sandbox, wire


async def test_fork_children_mount_the_parents_volumes(api, nodes_mock, mounted, assert_error):
    vol, parent, wire = mounted

    async def fork(node, *, sandbox_id, env_vars, access_token, children, deadline=None, **kwargs):
        fork.volumes = kwargs.get("volumes")
        return {"parent": {"ok": True}, "timings": {},
                "children": [{"sandbox_id": c["sandbox_id"], "ok": True, "envd_host": "127.0.0.1",
                              "envd_port": 41000 + i, "pid": 1, "accel": "tcg", "timings": {}}
                             for i, c in enumerate(children)]}

    nodes_mock.client.fork_sandbox = mock.AsyncMock(side_effect=fork)
    resp = await api.post(f"/sandboxes/{parent['sandboxID']}/fork", json={"count": 2})
    assert resp.status_code == 201, resp.text
    kids = [r["sandbox"]["sandboxID"] for r in resp.json()]
    assert fork.volumes == [{**wire, "mount": False}]  # served in each child's slot, already mounted
    for kid in kids:
        assert (await api.get(f"/sandboxes/{kid}")).json()["volumeMounts"] == [{"name": "data", "path": "/data"}]
        assert await SandboxVolume.objects.filter(sandbox_id=kid, volume_id=vol["volumeID"]).aexists()
    await api.delete(f"/sandboxes/{parent['sandboxID']}")
    assert_error(await api.delete(f"/volumes/{vol['volumeID']}"), 409, kids[0][:4])
    for kid in kids:
        await api.delete(f"/sandboxes/{kid}")
    assert (await api.delete(f"/volumes/{vol['volumeID']}")).status_code == 204


async def test_a_resume_serves_the_volumes_again(api, nodes_mock, mounted):
    vol, sandbox, wire = mounted
    assert (await api.post(f"/sandboxes/{sandbox['sandboxID']}/pause", json={})).status_code == 204
    resp = await api.post(f"/sandboxes/{sandbox['sandboxID']}/connect", json={"timeout": 60})
    assert resp.status_code == 201, resp.text
    assert nodes_mock.client.resume_sandbox.await_args.kwargs["volumes"] == [{**wire, "mount": False}]


async def test_a_sandbox_without_volumes_tells_the_node_nothing(api, nodes_mock, create):
    sandbox = await create()
    assert "volumes" not in nodes_mock.client.boot_sandbox.await_args.kwargs
    await api.post(f"/sandboxes/{sandbox['sandboxID']}/pause", json={})
    await api.post(f"/sandboxes/{sandbox['sandboxID']}/connect", json={"timeout": 60})
    assert "volumes" not in nodes_mock.client.resume_sandbox.await_args.kwargs


async def test_a_snapshot_keeps_its_sandboxs_mounts(api, nodes_mock, mounted, assert_error):
    vol, sandbox, _ = mounted
    nodes_mock.client.snapshot_sandbox = mock.AsyncMock(side_effect=RuntimeError("node broke"))
    await api.post(f"/sandboxes/{sandbox['sandboxID']}/snapshots", json={})  # the row is made before the node call
    snap = await Snapshot.objects.filter(source_sandbox_id=sandbox["sandboxID"]).afirst()
    assert snap is not None
    assert [(m.volume_id, m.path) async for m in SnapshotVolume.objects.filter(snapshot=snap)] == \
        [(vol["volumeID"], "/data")]
    await Sandbox.objects.filter(pk=sandbox["sandboxID"]).aupdate(state="killed")
    await Snapshot.objects.filter(pk=snap.pk).aupdate(state="ready")
    assert_error(await api.delete(f"/volumes/{vol['volumeID']}"), 409, snap.id)


async def test_a_create_from_a_snapshot_mounts_its_volumes_again(api, nodes_mock, mounted, team, assert_error):
    """The restored memory has the snapshot's mounts: the node serves them and the guest mounts
    only what the create adds; a path clashing with the snapshot's is a 400."""
    vol, sandbox, wire = mounted
    other = (await api.post("/volumes", json={"name": "more"})).json()
    c = nodes_mock.client
    c.snapshot_sandbox = mock.AsyncMock(return_value={
        "manifest": {"layers": ["/base.qcow2", "/s/layer-0.qcow2"], "memory_file": "/s/memory.ram"},
        "size_bytes": 1, "memory": True, "timings": {}})
    c.restore_sandbox = mock.AsyncMock(return_value={"envd_host": "127.0.0.1", "envd_port": 40100, "pid": 7,
                                                     "accel": "tcg", "timings": {}})
    resp = await api.post(f"/sandboxes/{sandbox['sandboxID']}/snapshots", json={})
    assert resp.status_code == 201, resp.text
    snap_id = resp.json()["snapshotID"]
    resp = await api.post("/v2/sandboxes", json={"templateID": snap_id,
                                                 "volumeMounts": [{"name": "more", "path": "/more"}]})
    assert resp.status_code == 201, resp.text
    assert c.restore_sandbox.await_args.kwargs["volumes"] == [
        {**wire, "mount": False},
        {"dir": f"{team.pk}/{other['volumeID']}", "export_id": 2, "path": "/more", "mount": True}]
    assert (await api.get(f"/sandboxes/{resp.json()['sandboxID']}")).json()["volumeMounts"] == [
        {"name": "data", "path": "/data"}, {"name": "more", "path": "/more"}]
    assert_error(await api.post("/v2/sandboxes", json={"templateID": snap_id,
                                                       "volumeMounts": [{"name": "more", "path": "/data/x"}]}),
                 400, "overlaps '/data'")
