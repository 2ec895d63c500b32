"""Forks across nodes (issue 24 item 4) with the node side mocked: where ``place_fork`` puts
the children (the parent's node first, at most AENV_FORK_MAX_PER_NODE a node, the rest spread
or packed over the other nodes, all or nothing), and POST /sandboxes/{id}/fork with the S3
store when the parent's node cannot take them all: one stored capture (hidden from the team),
every child restored from it on its node with its own token, a child failing alone, a failed
capture failing the fork, the count limit, and the capture released once no child is live."""
import asyncio
from datetime import timedelta
from unittest import mock

import pytest
from asgiref.sync import sync_to_async
from django.utils import timezone

from lifecycle.snapshots import fork_spread
from nodes.models import Node
from nodes.placement import NoNodeAvailable, place_fork_sync
from sandboxes.models import Sandbox, SandboxEvent
from snapshots.models import Snapshot

pytestmark = pytest.mark.django_db(transaction=True)

SNAP_RESULT = {"manifest": {"layers": ["/base.qcow2", "/s/layer-0.qcow2"], "memory_file": "/s/memory.ram"},
               "size_bytes": 123456, "memory": True, "timings": {"pause_ms": 40.0, "task_ms": 900.0}}


def _node(node_id, *, vcpus=64, memory=65536, age_s=0, draining=False):
    return Node.objects.create(id=node_id, address="127.0.0.1", vcpu_capacity=vcpus, memory_mb_capacity=memory,
                               draining=draining, last_heartbeat_at=timezone.now() - timedelta(seconds=age_s))


def _counts(allotment):
    return [(node.pk, n) for node, n in allotment]


# ------------------------------------------------------------------ placement


def test_a_fork_that_fits_stays_on_the_parents_node(db):
    home = _node("home")
    _node("other")
    claimed = []
    assert _counts(place_fork_sync(2, 128, 4, "home", per_node=4, spill=True, claim=claimed.append)) == [("home", 4)]
    assert _counts(claimed[0]) == [("home", 4)]
    assert Node.objects.get(pk="home").placements == home.placements + 1
    assert Node.objects.get(pk="other").placements == 0


def test_the_rest_spreads_over_the_other_nodes_within_the_per_node_limit(db, settings):
    settings.AENV_PLACEMENT = "spread"
    for name in ("home", "n2", "n3"):
        _node(name)
    _node("dead", age_s=3600)
    _node("drain", draining=True)
    got = _counts(place_fork_sync(2, 128, 5, "home", per_node=2, spill=True))
    assert got[0] == ("home", 2)
    assert sorted(got[1:]) == [("n2", 2), ("n3", 1)] or sorted(got[1:]) == [("n2", 1), ("n3", 2)]
    assert sum(n for _, n in got) == 5


def test_room_not_only_the_limit_caps_each_node(db, settings):
    settings.AENV_PLACEMENT = "spread"
    _node("home", vcpus=4)  # two children of 2 vCPU
    _node("n2", vcpus=2)  # one
    _node("n3")
    got = dict(_counts(place_fork_sync(2, 128, 8, "home", per_node=5, spill=True)))
    assert got == {"home": 2, "n2": 1, "n3": 5}


def test_pack_fills_the_most_loaded_other_node_first(db, settings):
    settings.AENV_PLACEMENT = "pack"
    _node("home", vcpus=2)
    _node("n2", vcpus=8)
    busy = _node("n3", vcpus=8)
    from sandboxes.models import Team, Template  # noqa: PLC0415

    team = Team.objects.create(slug="t", name="t")
    Sandbox.objects.create(team=team, template=Template.objects.get_or_create(id="base")[0], node=busy,
                           state="running", cpu_count=2, memory_mb=512, end_at=timezone.now() + timedelta(minutes=5))
    assert dict(_counts(place_fork_sync(2, 128, 4, "home", per_node=4, spill=True))) == {"home": 1, "n3": 3}


def test_without_spill_or_room_nothing_is_reserved(db):
    _node("home", vcpus=4)
    _node("n2", vcpus=4)
    claimed = []
    with pytest.raises(NoNodeAvailable, match="node home has no room for 3 .room for 2"):
        place_fork_sync(2, 128, 3, "home", per_node=8, spill=False, claim=claimed.append)
    with pytest.raises(NoNodeAvailable, match="no room in the cluster for 5 .room for 4, 2 of them on node home"):
        place_fork_sync(2, 128, 5, "home", per_node=8, spill=True, claim=claimed.append)
    assert claimed == [] and sum(Node.objects.values_list("placements", flat=True)) == 0
    assert dict(_counts(place_fork_sync(2, 128, 4, "home", per_node=8, spill=True))) == {"home": 2, "n2": 2}


def test_a_draining_parent_node_takes_no_fork(db):
    _node("home", draining=True)
    _node("n2")
    with pytest.raises(NoNodeAvailable, match="node home is not available"):
        place_fork_sync(2, 128, 1, "home", per_node=8, spill=True)


# ------------------------------------------------------------------ the API


@pytest.fixture
def spread_mock(nodes_mock, settings):
    """Three nodes of the S3 store, at most two fork children a node; the parent lands on n1."""
    settings.AENV_SNAPSHOT_BACKEND = "s3"
    settings.AENV_FORK_MAX_PER_NODE = 2
    _node("n2")
    _node("n3")
    c = nodes_mock.client
    c.fork_sandbox = mock.AsyncMock(side_effect=AssertionError("a spread fork uses no driver fork"))
    c.snapshot_sandbox = mock.AsyncMock(return_value=dict(SNAP_RESULT))
    c.commit_snapshot = mock.AsyncMock(return_value={"timings": {"commit_ms": 700.0}})
    ports = iter(range(42000, 43000))

    async def restore(node, *, sandbox_id, **kwargs):
        return {"envd_host": f"10.0.{node.pk[-1]}.2", "envd_port": next(ports), "pid": 9, "accel": "tcg",
                "timings": {"total_ms": 300.0, "init": 5.0}}

    c.restore_sandbox = mock.AsyncMock(side_effect=restore)
    c.delete_snapshot_files = mock.AsyncMock(return_value={"deleted": True})
    return nodes_mock


async def _fork(api, sandbox_id, **body):
    return await api.post(f"/sandboxes/{sandbox_id}/fork", json=body)


async def test_a_fork_larger_than_the_parents_node_runs_across_nodes(api, create, spread_mock, assert_error):
    parent = await create(envVars={"E": "1"}, metadata={"k": "v"})
    before = await Sandbox.objects.aget(pk=parent["sandboxID"])
    resp = await _fork(api, parent["sandboxID"], count=5, timeout=90)
    assert resp.status_code == 201, resp.text
    kids = [r["sandbox"] for r in resp.json()]
    assert len(kids) == 5
    rows = {s.pk: s async for s in Sandbox.objects.filter(forked_from_id=parent["sandboxID"])}
    per_node = {}
    for row in rows.values():
        per_node[row.node_id] = per_node.get(row.node_id, 0) + 1
        assert row.state == "running" and row.env_vars == {"E": "1"} and row.metadata == {"k": "v"}
    assert per_node["n1"] == 2 and sorted(per_node.values()) == [1, 2, 2] and set(per_node) == {"n1", "n2", "n3"}

    # one capture, stored: a snapshot of its own that the team never sees
    spread_mock.client.snapshot_sandbox.assert_awaited_once()
    snap_call = spread_mock.client.snapshot_sandbox.await_args
    assert snap_call.args[0].pk == "n1" and snap_call.kwargs["sandbox_id"] == parent["sandboxID"]
    assert snap_call.kwargs["commit"] is False  # stored by its own call, beside n1's restores
    spread_mock.client.commit_snapshot.assert_awaited_once()
    assert spread_mock.client.commit_snapshot.await_args.kwargs["snapshot_id"] == snap_call.kwargs["snapshot_id"]
    capture = await Snapshot.objects.aget(pk=snap_call.kwargs["snapshot_id"])
    assert capture.fork_capture and capture.state == "ready" and capture.node_id == "n1"
    assert capture.envd_access_token == before.envd_access_token and capture.size_bytes == 123456
    assert (await api.get("/snapshots")).json() == []
    assert_error(await api.post("/v2/sandboxes", json={"templateID": capture.id}), 400, "not found")
    assert all(row.source_snapshot_id == capture.id for row in rows.values())

    # every child restored from it on its own node, with its own token and the parent's as the source's
    calls = spread_mock.client.restore_sandbox.await_args_list
    assert sorted(c.kwargs["sandbox_id"] for c in calls) == sorted(rows)
    for call in calls:
        row = rows[call.kwargs["sandbox_id"]]
        assert call.args[0].pk == row.node_id and call.kwargs["snapshot_id"] == capture.id
        assert call.kwargs["source_token"] == before.envd_access_token
        assert call.kwargs["access_token"] == row.envd_access_token != before.envd_access_token
        assert call.kwargs["env_vars"] == {"E": "1"} and call.kwargs["template"] is False
        assert row.envd_host == f"10.0.{row.node_id[-1]}.2"
    assert len({c.kwargs["access_token"] for c in calls}) == 5

    after = await Sandbox.objects.aget(pk=parent["sandboxID"])
    assert after.state == "running" and after.end_at == before.end_at
    ops = [(e.outcome, e.from_state, e.to_state, e.details) async for e in
           SandboxEvent.objects.filter(sandbox_id=parent["sandboxID"], operation="fork").order_by("id")]
    assert [o[:3] for o in ops] == [("started", "running", "forking"), ("ok", "forking", "running"),
                                    ("stored", "", "")]
    assert ops[0][3]["nodes"]["n1"] == 2 and ops[1][3]["capture"] == capture.id

    # used while a child lives (a paused one too); released once none does, on every node that held it
    from lifecycle.snapshots import captures  # noqa: PLC0415

    assert await captures.release_unused() == []
    ids = sorted(rows)
    for sid in ids[:-1]:
        assert (await api.delete(f"/sandboxes/{sid}")).status_code == 204
    await Sandbox.objects.filter(pk=ids[-1]).aupdate(state="paused")
    assert await captures.release_unused() == []
    await Sandbox.objects.filter(pk=ids[-1]).aupdate(state="killed")
    assert await captures.release_unused() == [capture.id]
    assert not await Snapshot.objects.filter(pk=capture.id).aexists()
    deleted_on = sorted(c.args[0].pk for c in spread_mock.client.delete_snapshot_files.await_args_list)
    assert deleted_on == ["n1", "n2", "n3"]
    assert spread_mock.client.delete_snapshot_files.await_args_list[-1].args[0].pk == "n1"  # the bucket's last


async def test_a_child_failing_on_one_node_leaves_its_siblings_running(api, create, spread_mock):
    restore = spread_mock.client.restore_sandbox.side_effect

    async def broken_n3(node, **kwargs):
        if node.pk == "n3":
            raise spread_mock.client.NodeTaskFailed("lazy mount refused", kind="SnapshotStoreError")
        return await restore(node, **kwargs)

    spread_mock.client.restore_sandbox.side_effect = broken_n3
    parent = await create()
    resp = await _fork(api, parent["sandboxID"], count=6)
    assert resp.status_code == 201, resp.text
    results = resp.json()
    failed = [r["error"] for r in results if "error" in r]
    assert len(failed) == 2 and all("lazy mount refused" in e["message"] and "n3" in e["message"] for e in failed)
    assert sum("sandbox" in r for r in results) == 4
    states = {(s.node_id, s.state) async for s in Sandbox.objects.filter(forked_from_id=parent["sandboxID"])}
    assert states == {("n1", "running"), ("n2", "running"), ("n3", "error")}
    killed = {c.kwargs["sandbox_id"] for c in spread_mock.client.kill_sandbox.await_args_list}
    assert killed == {s.pk async for s in Sandbox.objects.filter(node_id="n3", forked_from_id=parent["sandboxID"])}
    event = await SandboxEvent.objects.filter(sandbox__node_id="n3", operation="create", outcome="error").afirst()
    assert event.details["kind"] == "SnapshotStoreError" and event.details["capture"]


async def test_a_failed_capture_fails_the_fork_and_every_child(api, create, spread_mock, assert_error):
    spread_mock.client.snapshot_sandbox.side_effect = spread_mock.client.NodeTaskFailed(
        "no space left in the snapshot store", kind="StorageFull")
    parent = await create()
    assert_error(await _fork(api, parent["sandboxID"], count=3), 507, "full")
    assert (await Sandbox.objects.aget(pk=parent["sandboxID"])).state == "running"
    assert {s.state async for s in Sandbox.objects.filter(forked_from_id=parent["sandboxID"])} == {"error"}
    spread_mock.client.restore_sandbox.assert_not_awaited()
    capture = await Snapshot.objects.aget(fork_capture=True)
    assert capture.state == "error"
    from lifecycle.snapshots import captures  # noqa: PLC0415

    assert await captures.release_unused() == [capture.id]


async def test_the_count_limit_is_the_clusters_with_s3(api, create, spread_mock, assert_error, settings):
    parent = await create()
    assert_error(await _fork(api, parent["sandboxID"], count=101), 400, "between 1 and 100")
    # 3 nodes × 2: seven do not fit anywhere, nothing is reserved
    body = assert_error(await _fork(api, parent["sandboxID"], count=7), 503, "no room in the cluster for 7")
    assert "n1" in body["message"]
    assert await Sandbox.objects.acount() == 1 and not await Snapshot.objects.aexists()
    settings.AENV_SNAPSHOT_BACKEND = "posix_fs"  # the parent's node only: the per-node limit at the edge
    assert_error(await _fork(api, parent["sandboxID"], count=3), 400, "AENV_FORK_MAX_PER_NODE=2")


async def test_a_fork_that_fits_uses_the_drivers_fork_even_with_s3(api, create, spread_mock):
    async def driver_fork(node, *, sandbox_id, env_vars, access_token, children, deadline=None):
        return {"parent": {"ok": True}, "timings": {"total_ms": 100.0},
                "children": [{"sandbox_id": c["sandbox_id"], "ok": True, "envd_host": "127.0.0.1",
                              "envd_port": 41000 + i, "pid": 1, "timings": {}} for i, c in enumerate(children)]}

    spread_mock.client.fork_sandbox.side_effect = driver_fork
    parent = await create()
    assert (await _fork(api, parent["sandboxID"], count=2)).status_code == 201
    spread_mock.client.snapshot_sandbox.assert_not_awaited()
    assert not await Snapshot.objects.aexists()
    assert {s.source_snapshot_id async for s in Sandbox.objects.filter(forked_from_id=parent["sandboxID"])} == {None}


async def test_sweeper_releases_an_unused_capture(api, create, spread_mock):
    parent = await create()
    assert (await _fork(api, parent["sandboxID"], count=3)).status_code == 201
    capture = await Snapshot.objects.aget(fork_capture=True)
    await Sandbox.objects.filter(forked_from_id=parent["sandboxID"]).aupdate(state="killed")
    from lifecycle.expiry import sweep_once  # noqa: PLC0415

    assert (capture.id, "release_capture", "deleted") in await sweep_once()
    assert not await Snapshot.objects.filter(pk=capture.id).aexists()


async def test_a_node_that_does_not_answer_fails_its_children_and_removes_their_vms(api, create, spread_mock):
    restore = spread_mock.client.restore_sandbox.side_effect

    async def silent_n2(node, **kwargs):
        if node.pk == "n2":
            raise spread_mock.client.NodeTimeout("no answer")
        return await restore(node, **kwargs)

    spread_mock.client.restore_sandbox.side_effect = silent_n2
    parent = await create()
    results = (await _fork(api, parent["sandboxID"], count=6)).json()
    assert sum("error" in r for r in results) == 2
    on_n2 = {s.pk async for s in Sandbox.objects.filter(node_id="n2", forked_from_id=parent["sandboxID"],
                                                         state="error")}
    assert len(on_n2) == 2
    assert {c.kwargs["sandbox_id"] for c in spread_mock.client.kill_sandbox.await_args_list} == on_n2


async def test_a_node_restart_during_the_capture_fails_the_fork(api, create, spread_mock, assert_error):
    parent = await create()

    async def restarted(node, *, sandbox_id, **kwargs):  # the node's reconcile continues the parent
        await Sandbox.objects.filter(pk=sandbox_id).aupdate(state="running")
        await asyncio.sleep(30)

    spread_mock.client.snapshot_sandbox.side_effect = restarted
    assert_error(await _fork(api, parent["sandboxID"], count=3), 503, "interrupted")
    assert {s.state async for s in Sandbox.objects.filter(forked_from_id=parent["sandboxID"])} == {"error"}
    assert (await Snapshot.objects.aget(fork_capture=True)).state == "error"
    spread_mock.client.restore_sandbox.assert_not_awaited()


def test_the_dashboard_never_shows_a_fork_capture(dash, team, base_template, node):
    parent = Sandbox.objects.create(team=team, template=base_template, node=node, state="running",
                                    end_at=timezone.now() + timedelta(minutes=5))
    capture = Snapshot.objects.create(team=team, template=base_template, node=node, source_sandbox=parent,
                                      fork_capture=True, state="ready")
    child = Sandbox.objects.create(team=team, template=base_template, node=node, state="running",
                                   forked_from=parent, source_snapshot=capture,
                                   end_at=timezone.now() + timedelta(minutes=5))
    page = dash.get(f"/dashboard/sandboxes/{child.id}/").content.decode()
    assert parent.id in page and capture.id not in page
    assert capture.id not in dash.get(f"/dashboard/sandboxes/{parent.id}/").content.decode()
    assert capture.id not in dash.get("/dashboard/snapshots/").content.decode()


async def test_the_parents_node_starts_its_children_while_the_capture_is_stored(api, create, spread_mock):
    """n1's restores run before the upload has finished; the other nodes' wait for it."""
    order = []
    gate = asyncio.Event()
    restore = spread_mock.client.restore_sandbox.side_effect

    async def restore_logged(node, **kwargs):
        order.append(("restore", node.pk, gate.is_set()))
        return await restore(node, **kwargs)

    async def slow_commit(node, **kwargs):
        for _ in range(100):  # until both of n1's children were asked for
            if sum(1 for o in order if o[1] == "n1") == 2:
                break
            await asyncio.sleep(0.01)
        gate.set()
        return {"timings": {"commit_ms": 1.0}}

    spread_mock.client.restore_sandbox.side_effect = restore_logged
    spread_mock.client.commit_snapshot.side_effect = slow_commit
    parent = await create()
    assert (await _fork(api, parent["sandboxID"], count=4)).status_code == 201
    assert sorted(o for o in order if o[1] == "n1") == [("restore", "n1", False)] * 2
    assert all(stored for _, node, stored in order if node != "n1") and len(order) == 4


async def test_a_capture_that_cannot_be_stored_fails_only_the_other_nodes_children(api, create, spread_mock):
    spread_mock.client.commit_snapshot.side_effect = spread_mock.client.NodeTaskFailed(
        "upload of snapshot to s3 failed: connection refused", kind="SnapshotStoreError")
    parent = await create()
    results = (await _fork(api, parent["sandboxID"], count=4)).json()
    rows = {(s.node_id, s.state) async for s in Sandbox.objects.filter(forked_from_id=parent["sandboxID"])}
    assert rows == {("n1", "running"), ("n2", "error"), ("n3", "error")}
    errors = [r["error"]["message"] for r in results if "error" in r]
    assert len(errors) == 2 and all("could not be stored" in e and "connection refused" in e for e in errors)
    assert {c.args[0].pk for c in spread_mock.client.restore_sandbox.await_args_list} == {"n1"}
    stored = await SandboxEvent.objects.aget(sandbox_id=parent["sandboxID"], operation="fork", outcome="error")
    assert stored.details["phase"] == "store" and stored.details["kind"] == "SnapshotStoreError"
    assert (await Sandbox.objects.aget(pk=parent["sandboxID"])).state == "running"


async def test_a_parent_node_restarting_during_the_upload_fails_the_other_nodes_children_at_once(
        api, create, spread_mock):
    """Its worker never answers the lost task: the fork does not wait for the deadline."""
    async def lost(node, **kwargs):
        await Node.objects.filter(pk=node.pk).aupdate(started_at=timezone.now() + timedelta(seconds=1))
        await asyncio.sleep(600)

    spread_mock.client.commit_snapshot.side_effect = lost
    parent = await create()
    results = (await asyncio.wait_for(_fork(api, parent["sandboxID"], count=4), timeout=60)).json()
    errors = [r["error"]["message"] for r in results if "error" in r]
    assert len(errors) == 2 and all("restarted while it stored the capture" in e for e in errors)
    rows = {(s.node_id, s.state) async for s in Sandbox.objects.filter(forked_from_id=parent["sandboxID"])}
    assert rows == {("n1", "running"), ("n2", "error"), ("n3", "error")}


# ------------------------------------------------------------------ the early hand-off


@pytest.fixture
def handoff_mock(spread_mock):
    """Every node says it takes a capture handed over before its upload ends (peer fetch on);
    the upload waits until the test opens ``gate``; ``order`` logs each restore with whether the
    upload had ended and its ``pending_wait``."""
    Node.objects.all().update(host={"forkHandoff": True})
    c = spread_mock.client
    c.index_snapshot = mock.AsyncMock(return_value={"chunks": 300, "bytes": 3 << 20,
                                                    "timings": {"index_ms": 800.0}})
    restore = c.restore_sandbox.side_effect
    spread_mock.order, spread_mock.gate = [], asyncio.Event()

    async def restore_logged(node, **kwargs):
        spread_mock.order.append((node.pk, spread_mock.gate.is_set(), kwargs.get("pending_wait", 0)))
        return await restore(node, **kwargs)

    async def commit_when_opened(node, **kwargs):
        for _ in range(200):  # until the four children were asked for (or 2 s)
            if len(spread_mock.order) == 4:
                break
            await asyncio.sleep(0.01)
        spread_mock.gate.set()
        if spread_mock.commit_error is not None:
            raise spread_mock.commit_error
        return {"timings": {"commit_ms": 1.0}}

    spread_mock.commit_error = None
    c.restore_sandbox.side_effect = restore_logged
    c.commit_snapshot.side_effect = commit_when_opened
    return spread_mock


async def _fork_events(parent_id):
    return [(e.outcome, e.message, e.details) async for e in
            SandboxEvent.objects.filter(sandbox_id=parent_id, operation="fork").order_by("id")]


async def test_the_hand_off_starts_the_other_nodes_children_beside_the_upload(api, create, handoff_mock, settings):
    parent = await create()
    resp = await _fork(api, parent["sandboxID"], count=4)
    assert resp.status_code == 201, resp.text
    capture_id = handoff_mock.client.snapshot_sandbox.await_args.kwargs["snapshot_id"]
    call = handoff_mock.client.index_snapshot.await_args
    assert call.args[0].pk == "n1" and call.kwargs["snapshot_id"] == capture_id
    # every child asked for before the upload ended; only the other nodes' read a pending capture
    assert sorted(handoff_mock.order) == [("n1", False, 0), ("n1", False, 0),
                                          ("n2", False, settings.AENV_SNAPSHOT_DEADLINE),
                                          ("n3", False, settings.AENV_SNAPSHOT_DEADLINE)]
    rows = {(s.node_id, s.state) async for s in Sandbox.objects.filter(forked_from_id=parent["sandboxID"])}
    assert rows == {("n1", "running"), ("n2", "running"), ("n3", "running")}
    await fork_spread.uploads_settled()
    events = await _fork_events(parent["sandboxID"])
    assert [e[0] for e in events] == ["started", "ok", "handed_over", "stored"]
    assert events[2][2]["chunks"] == 300 and events[2][2]["timings"] == {"index_ms": 800.0}
    handoff_mock.client.kill_sandbox.assert_not_awaited()


def _held_upload(handoff_mock) -> asyncio.Event:
    """The upload runs until the test sets the event it returns."""
    release = asyncio.Event()

    async def held_commit(node, **kwargs):
        await release.wait()
        return {"timings": {"commit_ms": 1.0}}

    handoff_mock.client.commit_snapshot.side_effect = held_commit
    return release


async def test_the_fork_answers_before_the_upload_ends(api, create, handoff_mock):
    """Its children run (the other nodes' from the parent's node's files); the upload goes on."""
    release = _held_upload(handoff_mock)
    parent = await create()
    resp = await asyncio.wait_for(_fork(api, parent["sandboxID"], count=4), timeout=30)
    assert resp.status_code == 201 and len([r for r in resp.json() if "sandbox" in r]) == 4
    assert "handed_over" in resp.headers["server-timing"] and "stored" not in resp.headers["server-timing"]
    assert [e[0] for e in await _fork_events(parent["sandboxID"])] == ["started", "ok", "handed_over"]
    release.set()
    await fork_spread.uploads_settled()
    assert [e[0] for e in await _fork_events(parent["sandboxID"])][-1] == "stored"


async def test_a_capture_still_uploading_is_not_released_when_its_children_are_gone(api, create, handoff_mock):
    """A handed-over fork answers before its upload ends: its children may all be killed
    meanwhile, and the sweeper must not delete the capture under the upload."""
    from lifecycle.snapshots import captures  # noqa: PLC0415

    release = _held_upload(handoff_mock)
    parent = await create()
    kids = [r["sandbox"]["sandboxID"] for r in (await _fork(api, parent["sandboxID"], count=4)).json()]
    for sid in kids:
        assert (await api.delete(f"/sandboxes/{sid}")).status_code == 204
    capture = await Snapshot.objects.aget(fork_capture=True)
    assert capture.uploading_until is not None
    assert await captures.release_unused() == []  # its upload runs
    handoff_mock.client.delete_snapshot_files.assert_not_awaited()
    release.set()
    await fork_spread.uploads_settled()
    assert (await Snapshot.objects.aget(pk=capture.pk)).uploading_until is None
    assert await captures.release_unused() == [capture.pk]


async def test_an_upload_failing_after_the_hand_off_kills_the_other_nodes_children(api, create, handoff_mock):
    """They ran from the parent's node's files until the upload ended: without it in the store
    none keeps running (as a fork without the hand-off fails them)."""
    handoff_mock.commit_error = handoff_mock.client.NodeTaskFailed(
        "upload of snapshot to s3 failed: connection refused", kind="SnapshotStoreError")
    parent = await create()
    results = (await _fork(api, parent["sandboxID"], count=4)).json()
    assert len([r for r in results if "sandbox" in r]) == 4
    await fork_spread.uploads_settled()
    rows = {s.pk: (s.node_id, s.state) async for s in Sandbox.objects.filter(forked_from_id=parent["sandboxID"])}
    assert sorted(rows.values()) == [("n1", "running"), ("n1", "running"), ("n2", "killed"), ("n3", "killed")]
    killed = sorted((c.args[0].pk, c.kwargs["sandbox_id"]) for c in handoff_mock.client.kill_sandbox.await_args_list)
    assert killed == sorted((node, sid) for sid, (node, _) in rows.items() if node != "n1")
    for sid, (node, _) in rows.items():
        if node != "n1":
            kill = await SandboxEvent.objects.aget(sandbox_id=sid, operation="kill", outcome="started")
            assert "could not be stored" in kill.details["reason"] and "connection refused" in kill.details["reason"]
    assert [e[0] for e in await _fork_events(parent["sandboxID"])] == ["started", "ok", "handed_over", "error"]
    assert await Snapshot.objects.filter(fork_capture=True).aexists()  # n1's children still use it


async def test_no_hand_off_unless_every_node_involved_takes_it(api, create, handoff_mock, settings):
    await Node.objects.filter(pk="n3").aupdate(host={"chunkPeerPort": 9465})  # a worker of before
    parent = await create()
    assert (await _fork(api, parent["sandboxID"], count=4)).status_code == 201
    handoff_mock.client.index_snapshot.assert_not_awaited()
    assert sorted(handoff_mock.order) == [("n1", False, 0), ("n1", False, 0), ("n2", True, 0), ("n3", True, 0)]
    assert [e[0] for e in await _fork_events(parent["sandboxID"])] == ["started", "ok", "stored"]

    handoff_mock.order.clear()
    await Node.objects.filter(pk="n3").aupdate(host={"forkHandoff": True})
    settings.AENV_FORK_HANDOFF = False
    parent = await create()
    assert (await _fork(api, parent["sandboxID"], count=4)).status_code == 201
    handoff_mock.client.index_snapshot.assert_not_awaited()
    assert all(stored for node, stored, _ in handoff_mock.order if node != "n1")


async def test_a_hand_off_that_fails_waits_for_the_upload(api, create, handoff_mock):
    handoff_mock.client.index_snapshot.side_effect = handoff_mock.client.NodeTaskFailed(
        "hand-off failed: throttled", kind="SnapshotStoreError")
    parent = await create()
    assert (await _fork(api, parent["sandboxID"], count=4)).status_code == 201
    assert sorted(handoff_mock.order) == [("n1", False, 0), ("n1", False, 0), ("n2", True, 0), ("n3", True, 0)]
    assert not fork_spread._uploading
    events = await _fork_events(parent["sandboxID"])
    assert [e[0] for e in events] == ["started", "ok", "handoff_skipped", "stored"]
    assert "throttled" in events[2][1]
    rows = {(s.node_id, s.state) async for s in Sandbox.objects.filter(forked_from_id=parent["sandboxID"])}
    assert rows == {("n1", "running"), ("n2", "running"), ("n3", "running")}
