"""Snapshots through the ASGI app with the node side mocked: POST /sandboxes/{id}/snapshots,
GET /snapshots, create from a snapshot, DELETE /templates/{id}; status codes, states,
events, pagination and team isolation."""
import asyncio
from unittest import mock

import httpx
import pytest
from django.utils import timezone

from sandboxes.models import Sandbox, SandboxEvent
from snapshots.models import Snapshot, new_snapshot_id

pytestmark = pytest.mark.django_db(transaction=True)

SNAP_RESULT = {"manifest": {"layers": ["/base.qcow2", "/s/layer-0.qcow2"], "memory_file": "/s/memory.ram"},
               "size_bytes": 123456, "memory": True, "timings": {"pause_ms": 40.0, "task_ms": 900.0}}


@pytest.fixture
def snap_mock(nodes_mock):
    c = nodes_mock.client
    c.snapshot_sandbox = mock.AsyncMock(return_value=dict(SNAP_RESULT))
    c.restore_sandbox = mock.AsyncMock(return_value={"envd_host": "127.0.0.1", "envd_port": 40100, "pid": 77,
                                                     "accel": "tcg", "timings": {"total_ms": 300.0, "init": 5.0}})
    c.delete_snapshot_files = mock.AsyncMock(return_value={"deleted": True})
    return nodes_mock


@pytest.fixture
def other_api(asgi_app, other_key):
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi_app), base_url="http://testserver",
                             headers={"X-API-Key": other_key}, timeout=30)


async def _events(sandbox_id: str, operation: str) -> list[tuple]:
    qs = SandboxEvent.objects.filter(sandbox_id=sandbox_id, operation=operation).order_by("id")
    return [(e.outcome, e.from_state, e.to_state) async for e in qs]


async def _snap(api, sandbox_id: str, **body) -> dict:
    resp = await api.post(f"/sandboxes/{sandbox_id}/snapshots", json=body)
    assert resp.status_code == 201, resp.text
    return resp.json()


# --------------------------------------------------------------------------- model


def test_snapshot_ids_and_names(team, base_template):
    sid = new_snapshot_id()
    assert len(sid) == 20 and sid[0] == "s" and sid.isalnum() and sid == sid.lower()
    snap = Snapshot.objects.create(team=team, template=base_template)
    assert snap.state == "creating" and snap.names == [] and str(snap) == snap.id
    snap.name = "x"
    assert snap.names == ["x"] and "x" in str(snap)


# --------------------------------------------------------------------------- create


async def test_snapshot_is_201_and_sandbox_keeps_running(api, create, snap_mock):
    sb = await create()
    end_at = (await Sandbox.objects.aget(pk=sb["sandboxID"])).end_at
    body = await _snap(api, sb["sandboxID"], name="my-snap")
    assert set(body) == {"snapshotID", "names"} and body["names"] == ["my-snap"]
    assert body["snapshotID"].startswith("s")
    kwargs = snap_mock.client.snapshot_sandbox.await_args.kwargs
    assert kwargs["sandbox_id"] == sb["sandboxID"] and kwargs["snapshot_id"] == body["snapshotID"]
    sandbox = await Sandbox.objects.aget(pk=sb["sandboxID"])
    assert sandbox.state == "running" and sandbox.end_at == end_at
    assert await _events(sb["sandboxID"], "snapshot") == [("started", "running", "snapshotting"),
                                                          ("ok", "snapshotting", "running")]
    snap = await Snapshot.objects.aget(pk=body["snapshotID"])
    assert snap.state == "ready" and snap.size_bytes == 123456 and snap.manifest == SNAP_RESULT["manifest"]
    assert snap.source_sandbox_id == sb["sandboxID"] and snap.template_id == "base" and snap.node_id == "n1"
    assert snap.envd_access_token == sandbox.envd_access_token and snap.memory is True


async def test_snapshot_body_variants_and_memory_false(api, create, snap_mock):
    sb = await create()
    assert (await api.post(f"/sandboxes/{sb['sandboxID']}/snapshots")).status_code == 201  # no body
    body = await _snap(api, sb["sandboxID"], memory=False)
    assert body["names"] == []
    done = await SandboxEvent.objects.filter(sandbox_id=sb["sandboxID"], operation="snapshot",
                                             outcome="ok").order_by("-id").afirst()
    assert done.details["memory"] is False and done.details["mode"] == "filesystem"
    assert snap_mock.client.snapshot_sandbox.await_args.kwargs["memory"] is False
    snap = await Snapshot.objects.aget(pk=body["snapshotID"])
    assert snap.memory is False
    # a cold-booted envd has no token to hand over: a v1 create may stay non-secure
    resp = await api.post("/sandboxes", json={"templateID": snap.id, "secure": False})
    assert resp.status_code == 201 and "envdAccessToken" not in resp.json()


async def test_same_name_moves_to_the_newest_snapshot(api, create, snap_mock):
    sb = await create()
    first = await _snap(api, sb["sandboxID"], name="tagged")
    second = await _snap(api, sb["sandboxID"], name="tagged")
    assert (await Snapshot.objects.aget(pk=first["snapshotID"])).names == []
    listed = (await api.get("/snapshots", params={"name": "tagged"})).json()
    assert listed == [{"snapshotID": second["snapshotID"], "names": ["tagged"]}]


@pytest.mark.parametrize("body, text", [({"name": "bad name"}, "name"), ({"name": 5}, "name"),
                                        ({"memory": "yes"}, "memory"), ({"name": "../x"}, "name")])
async def test_snapshot_bad_body_is_400(api, create, snap_mock, assert_error, body, text):
    sb = await create()
    assert_error(await api.post(f"/sandboxes/{sb['sandboxID']}/snapshots", json=body), 400, text)
    assert snap_mock.client.snapshot_sandbox.await_count == 0
    assert (await Sandbox.objects.aget(pk=sb["sandboxID"])).state == "running"


async def test_snapshot_unknown_other_team_paused(api, other_api, create, snap_mock, assert_error):
    assert_error(await api.post("/sandboxes/nope/snapshots", json={}), 404, "not found")
    sb = await create()
    async with other_api:
        assert_error(await other_api.post(f"/sandboxes/{sb['sandboxID']}/snapshots", json={}), 404)
    assert (await api.post(f"/sandboxes/{sb['sandboxID']}/pause")).status_code == 204
    assert_error(await api.post(f"/sandboxes/{sb['sandboxID']}/snapshots", json={}), 409, "not running")
    assert snap_mock.client.snapshot_sandbox.await_count == 0


async def test_snapshot_storage_full_is_507_and_sandbox_runs(api, create, snap_mock, assert_error):
    sb = await create()
    snap_mock.client.snapshot_sandbox.side_effect = snap_mock.client.NodeTaskFailed(
        "no space left in the snapshot store", kind="StorageFull")
    body = assert_error(await api.post(f"/sandboxes/{sb['sandboxID']}/snapshots", json={}), 507, "full")
    assert body["error_code"] == "insufficient_storage"
    assert (await Sandbox.objects.aget(pk=sb["sandboxID"])).state == "running"
    assert await _events(sb["sandboxID"], "snapshot") == [("started", "running", "snapshotting"),
                                                          ("error", "snapshotting", "running")]
    assert [s.state async for s in Snapshot.objects.all()] == ["error"]
    assert (await api.get("/snapshots")).json() == []
    snap_mock.client.kill_sandbox.assert_not_awaited()


async def test_snapshot_node_timeout_removes_vm_and_files(api, create, snap_mock, assert_error):
    sb = await create()
    snap_mock.client.snapshot_sandbox.side_effect = snap_mock.client.NodeTimeout("slow")
    assert_error(await api.post(f"/sandboxes/{sb['sandboxID']}/snapshots", json={}), 504)
    assert (await Sandbox.objects.aget(pk=sb["sandboxID"])).state == "error"
    assert snap_mock.client.kill_sandbox.await_args.kwargs["sandbox_id"] == sb["sandboxID"]
    snap = await Snapshot.objects.aget()
    assert snap.state == "error"
    assert snap_mock.client.delete_snapshot_files.await_args.kwargs["snapshot_id"] == snap.id


# --------------------------------------------------------------------------- list


async def test_list_paginates_filters_and_isolates_teams(api, other_api, create, snap_mock, assert_error):
    a, b = await create(), await create()
    ids = [(await _snap(api, a["sandboxID"]))["snapshotID"] for _ in range(4)]
    only_b = (await _snap(api, b["sandboxID"], name="bee"))["snapshotID"]
    seen, token = [], None
    for _ in range(5):
        params = {"limit": 2, **({"nextToken": token} if token else {})}
        resp = await api.get("/snapshots", params=params)
        assert resp.status_code == 200
        seen += [s["snapshotID"] for s in resp.json()]
        token = resp.headers.get("x-next-token")
        if not token:
            break
    assert seen == list(reversed(ids + [only_b]))  # newest first, no repeats, none skipped
    by_sandbox = (await api.get("/snapshots", params={"sandboxID": a["sandboxID"]})).json()
    assert sorted(s["snapshotID"] for s in by_sandbox) == sorted(ids)
    for name in ("bee", "team-a/bee", "bee:default", only_b):
        assert [s["snapshotID"] for s in (await api.get("/snapshots", params={"name": name})).json()] == [only_b]
    async with other_api:
        assert (await other_api.get("/snapshots")).json() == []
        assert (await other_api.get("/snapshots", params={"sandboxID": a["sandboxID"]})).json() == []
    assert_error(await api.get("/snapshots", params={"nextToken": "garbage!"}), 400, "nextToken")
    assert_error(await api.get("/snapshots", params={"limit": 0}), 400, "limit")
    assert_error(await api.get("/snapshots", params={"limit": 101}), 400, "limit")


# --------------------------------------------------------------------------- create from a snapshot


async def test_create_from_snapshot_restores_on_its_node(api, create, snap_mock):
    sb = await create(envVars={"A": "1"})
    snap_id = (await _snap(api, sb["sandboxID"], name="golden"))["snapshotID"]
    await Snapshot.objects.filter(pk=snap_id).aupdate(cpu_count=4, memory_mb=1024)
    source_token = (await Snapshot.objects.aget(pk=snap_id)).envd_access_token
    for ref in (snap_id, "golden", "team-a/golden:default"):
        resp = await api.post("/v2/sandboxes", json={"templateID": ref, "envVars": {"B": "2"}, "timeout": 60})
        assert resp.status_code == 201, resp.text
        new = await Sandbox.objects.aget(pk=resp.json()["sandboxID"])
        assert new.source_snapshot_id == snap_id and new.template_id == "base" and new.state == "running"
        assert (new.cpu_count, new.memory_mb) == (4, 1024)
        kwargs = snap_mock.client.restore_sandbox.await_args.kwargs
        assert kwargs["snapshot_id"] == snap_id and kwargs["sandbox_id"] == new.id
        assert kwargs["env_vars"] == {"B": "2"} and kwargs["source_token"] == source_token
        assert kwargs["access_token"] == new.envd_access_token != source_token
        assert resp.json()["envdAccessToken"] == new.envd_access_token
        assert snap_mock.client.restore_sandbox.await_args.args[0].id == "n1"
    assert snap_mock.placement.place.await_count == 1  # only the first, template create


async def test_v1_create_from_secure_snapshot_is_secure(api, create, snap_mock):
    sb = await create()
    snap_id = (await _snap(api, sb["sandboxID"]))["snapshotID"]
    resp = await api.post("/sandboxes", json={"templateID": snap_id, "secure": False})
    assert resp.status_code == 201, resp.text
    assert resp.json()["envdAccessToken"]  # the restored envd needs a token: the client gets it


async def test_create_from_other_teams_or_unready_snapshot(api, other_api, create, snap_mock, assert_error):
    sb = await create()
    snap_id = (await _snap(api, sb["sandboxID"]))["snapshotID"]
    async with other_api:
        assert_error(await other_api.post("/v2/sandboxes", json={"templateID": snap_id}), 400, "not found")
    await Snapshot.objects.filter(pk=snap_id).aupdate(state="creating")
    assert_error(await api.post("/v2/sandboxes", json={"templateID": snap_id}), 409, "being created")
    snap_mock.client.restore_sandbox.assert_not_awaited()


async def test_restore_failure_marks_error(api, create, snap_mock, assert_error):
    sb = await create()
    snap_id = (await _snap(api, sb["sandboxID"]))["snapshotID"]
    snap_mock.client.restore_sandbox.side_effect = snap_mock.client.NodeTaskFailed("envd", kind="EnvdInitFailed")
    assert_error(await api.post("/v2/sandboxes", json={"templateID": snap_id}), 500, "EnvdInitFailed")
    failed = await Sandbox.objects.filter(source_snapshot_id=snap_id).aget()
    assert failed.state == "error"


async def test_restore_when_snapshot_node_is_gone_is_503(api, create, snap_mock, assert_error):
    sb = await create()
    snap_id = (await _snap(api, sb["sandboxID"]))["snapshotID"]
    from nodes.models import Node

    await Node.objects.filter(pk="n1").aupdate(last_heartbeat_at=timezone.now() - timezone.timedelta(hours=1))
    assert_error(await api.post("/v2/sandboxes", json={"templateID": snap_id}), 503, "not available")
    snap_mock.client.restore_sandbox.assert_not_awaited()


# --------------------------------------------------------------------------- delete


async def test_delete_refused_while_restored_sandbox_lives(api, create, snap_mock, assert_error):
    sb = await create()
    snap_id = (await _snap(api, sb["sandboxID"]))["snapshotID"]
    restored = (await api.post("/v2/sandboxes", json={"templateID": snap_id})).json()
    body = assert_error(await api.delete(f"/templates/{snap_id}"), 409, "still used")
    assert restored["sandboxID"] in body["message"]
    assert (await Snapshot.objects.aget(pk=snap_id)).state == "ready"
    snap_mock.client.delete_snapshot_files.assert_not_awaited()
    # the source sandbox itself does not pin the snapshot; a restored one does until killed
    assert (await api.delete(f"/sandboxes/{restored['sandboxID']}")).status_code == 204
    resp = await api.delete(f"/templates/{snap_id}")
    assert resp.status_code == 204 and resp.content == b""
    assert snap_mock.client.delete_snapshot_files.await_args.kwargs["snapshot_id"] == snap_id
    assert not await Snapshot.objects.filter(pk=snap_id).aexists()
    assert (await Sandbox.objects.aget(pk=restored["sandboxID"])).source_snapshot_id is None
    assert_error(await api.delete(f"/templates/{snap_id}"), 404, "not found")


async def test_delete_by_name_unknown_and_other_team(api, other_api, create, snap_mock, assert_error):
    sb = await create()
    snap_id = (await _snap(api, sb["sandboxID"], name="named"))["snapshotID"]
    assert_error(await api.delete("/templates/nope"), 404)
    assert_error(await api.delete("/templates/base"), 404, "names a template, not a snapshot")
    async with other_api:
        assert_error(await other_api.delete(f"/templates/{snap_id}"), 404)
    assert await Snapshot.objects.filter(pk=snap_id).aexists()
    assert (await api.delete("/templates/team-a%2Fnamed")).status_code == 204  # SDK-encoded namespaced name
    assert not await Snapshot.objects.filter(pk=snap_id).aexists()


async def test_delete_when_node_fails_keeps_snapshot(api, create, snap_mock, assert_error):
    sb = await create()
    snap_id = (await _snap(api, sb["sandboxID"]))["snapshotID"]
    snap_mock.client.delete_snapshot_files.side_effect = snap_mock.client.NodeUnavailable("down")
    assert_error(await api.delete(f"/templates/{snap_id}"), 503)
    assert (await Snapshot.objects.aget(pk=snap_id)).state == "ready"
    assert len((await api.get("/snapshots")).json()) == 1


async def test_delete_while_creating_is_409(api, create, snap_mock, assert_error):
    sb = await create()
    snap_id = (await _snap(api, sb["sandboxID"]))["snapshotID"]
    await Snapshot.objects.filter(pk=snap_id).aupdate(state="creating")
    assert_error(await api.delete(f"/templates/{snap_id}"), 409, "being created")


async def test_schema_lists_snapshot_routes(api):
    resp = await api.get("/api/schema", headers={"Accept": "application/vnd.oai.openapi+json"})
    paths = resp.json()["paths"]
    assert "post" in paths["/sandboxes/{sandbox_id}/snapshots"] and "post" in paths["/sandboxes/{sandbox_id}/fork"]
    assert "get" in paths["/snapshots"]
    assert any(p.startswith("/templates/") and "delete" in v for p, v in paths.items())


async def test_restore_racing_a_delete_loses_cleanly(api, create, snap_mock, assert_error):
    """The snapshot went ``deleting`` between resolving it and placing the restore: 409,
    the new sandbox ends ``error`` and no node work starts."""
    sb = await create()
    snap_id = (await _snap(api, sb["sandboxID"]))["snapshotID"]
    with mock.patch("lifecycle.sources.snapshot_still_ready", mock.AsyncMock(return_value=False)):
        assert_error(await api.post("/v2/sandboxes", json={"templateID": snap_id}), 409, "being deleted")
    lost = await Sandbox.objects.filter(source_snapshot_id=snap_id).aget()
    assert lost.state == "error"
    snap_mock.client.restore_sandbox.assert_not_awaited()
    # a dependent in "error" does not pin the snapshot
    assert (await api.delete(f"/templates/{snap_id}")).status_code == 204


async def test_timed_out_snapshot_settled_by_the_node_is_not_killed(api, create, snap_mock, assert_error):
    """A node worker restarted mid-snapshot continues the VM and sets the sandbox running
    (its reconcile); the API call that then times out must not kill that VM."""
    sb = await create()

    async def reconciled_then_timeout(node, **kw):
        await Sandbox.objects.filter(pk=kw["sandbox_id"]).aupdate(state="running")
        raise snap_mock.client.NodeTimeout("worker restarted")

    snap_mock.client.snapshot_sandbox.side_effect = reconciled_then_timeout
    snap_mock.client.kill_sandbox.reset_mock()
    assert_error(await api.post(f"/sandboxes/{sb['sandboxID']}/snapshots", json={}), 504)
    assert (await Sandbox.objects.aget(pk=sb["sandboxID"])).state == "running"
    snap_mock.client.kill_sandbox.assert_not_awaited()
    assert (await Snapshot.objects.aget()).state == "error"


async def test_restore_on_a_full_node_is_503(api, create, snap_mock, assert_error):
    sb = await create()
    snap_id = (await _snap(api, sb["sandboxID"]))["snapshotID"]
    from nodes.models import Node

    await Node.objects.filter(pk="n1").aupdate(memory_mb_capacity=700)  # the source holds 512
    assert_error(await api.post("/v2/sandboxes", json={"templateID": snap_id}), 503, "no room")
    snap_mock.client.restore_sandbox.assert_not_awaited()


@pytest.mark.parametrize("backend, deleter", [("s3", "spare"), ("posix_fs", None)])
async def test_delete_when_the_snapshots_node_is_gone(api, create, snap_mock, settings, backend, deleter):
    """With s3 the bucket is the truth: another alive node deletes the files when the
    snapshot's node is dead. posix_fs files exist only on that node: the delete fails
    with 503 and the snapshot stays usable."""
    from datetime import timedelta  # noqa: PLC0415

    from nodes.models import Node  # noqa: PLC0415

    settings.AENV_SNAPSHOT_BACKEND = backend
    sb = await create()
    snap = await _snap(api, sb["sandboxID"])
    await Node.objects.acreate(id="spare", address="127.0.0.9", vcpu_capacity=8, memory_mb_capacity=4096,
                               last_heartbeat_at=timezone.now())
    await Node.objects.filter(pk=snap_mock.node.pk).aupdate(last_heartbeat_at=timezone.now() - timedelta(hours=1))
    if deleter is None:
        snap_mock.client.delete_snapshot_files.side_effect = snap_mock.client.NodeUnavailable("node is dead")
    resp = await api.delete(f"/templates/{snap['snapshotID']}")
    used = snap_mock.client.delete_snapshot_files.await_args.args[0].pk
    if deleter:
        assert resp.status_code == 204, resp.text
        assert used == deleter
        assert not await Snapshot.objects.filter(pk=snap["snapshotID"]).aexists()
    else:
        assert resp.status_code == 503, resp.text
        assert used == snap_mock.node.pk
        assert (await Snapshot.objects.aget(pk=snap["snapshotID"])).state == "ready"


async def _wait_state(sandbox_id: str, state: str) -> None:
    for _ in range(200):
        if (await Sandbox.objects.aget(pk=sandbox_id)).state == state:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{sandbox_id} never became {state}")


async def _never(*args, **kwargs):
    await asyncio.sleep(3600)


@pytest.mark.parametrize("reconciled", ["running", "error"])
async def test_snapshot_waiter_follows_a_reconcile(api, create, snap_mock, assert_error, reconciled):
    """A node worker that restarts mid-capture never answers; its reconcile settles the
    sandbox, and the waiting request answers from that at once with the snapshot failed."""
    from snapshots.models import Snapshot  # noqa: PLC0415

    sb = await create()
    snap_mock.client.snapshot_sandbox.side_effect = _never
    request = asyncio.ensure_future(api.post(f"/sandboxes/{sb['sandboxID']}/snapshots", json={}))
    await _wait_state(sb["sandboxID"], "snapshotting")
    await Sandbox.objects.filter(pk=sb["sandboxID"]).aupdate(state=reconciled)
    resp = await asyncio.wait_for(request, 5)
    assert_error(resp, 503, "interrupted")
    snap = await Snapshot.objects.aget(source_sandbox_id=sb["sandboxID"])
    assert snap.state == "error" and "node restarted" in snap.error_reason
    assert ("aborted", "snapshotting", "") in await _events(sb["sandboxID"], "snapshot")


async def test_fork_waiter_follows_a_reconcile(api, create, snap_mock, assert_error):
    sb = await create()
    snap_mock.client.fork_sandbox = mock.AsyncMock(side_effect=_never)
    request = asyncio.ensure_future(api.post(f"/sandboxes/{sb['sandboxID']}/fork", json={"count": 2}))
    await _wait_state(sb["sandboxID"], "forking")
    await Sandbox.objects.filter(pk=sb["sandboxID"]).aupdate(state="running")
    resp = await asyncio.wait_for(request, 5)
    assert_error(resp, 503, "interrupted")
    kids = [k async for k in Sandbox.objects.filter(forked_from_id=sb["sandboxID"])]
    assert len(kids) == 2 and {k.state for k in kids} == {"error"}


async def test_a_kill_during_the_capture_still_waits_for_the_node(api, create, snap_mock):
    """A kill is not a reconcile: the capture's answer is still awaited and the snapshot kept."""
    sb = await create()
    gate = asyncio.Event()

    async def slow(*args, **kwargs):
        await gate.wait()
        return dict(SNAP_RESULT)

    snap_mock.client.snapshot_sandbox.side_effect = slow
    request = asyncio.ensure_future(api.post(f"/sandboxes/{sb['sandboxID']}/snapshots", json={}))
    await _wait_state(sb["sandboxID"], "snapshotting")
    await Sandbox.objects.filter(pk=sb["sandboxID"]).aupdate(state="killing")
    await asyncio.sleep(1.2)  # longer than the watch's poll: it must not give up
    assert not request.done()
    gate.set()
    resp = await asyncio.wait_for(request, 5)
    assert resp.status_code == 201, resp.text


async def test_a_restore_whose_saved_state_did_not_load_in_time_is_503(api, create, snap_mock, assert_error):
    sb = await create()
    snap_id = (await _snap(api, sb["sandboxID"]))["snapshotID"]
    snap_mock.client.restore_sandbox.side_effect = snap_mock.client.NodeTaskFailed(
        "incoming from /x/device.state: still inmigrate after 60.0s", kind="StateLoadTimeout")
    resp = await api.post("/v2/sandboxes", json={"templateID": snap_id})
    assert_error(resp, 503, "too busy to start this sandbox now")
    assert resp.headers["Retry-After"]
