"""POST /sandboxes/{id}/fork through the ASGI app with the node side mocked: validation,
the per-node limit, per-child results, parent and child states, tokens, expiry and
team isolation."""
from datetime import timedelta
from unittest import mock

import httpx
import pytest
from django.utils import timezone

from sandboxes.models import Sandbox, SandboxEvent

pytestmark = pytest.mark.django_db(transaction=True)


def _fork_result(fail: set[int] = frozenset()):
    async def run(node, *, sandbox_id, env_vars, access_token, children, deadline=None):
        out = []
        for i, c in enumerate(children):
            if i in fail:
                out.append({"sandbox_id": c["sandbox_id"], "ok": False, "kind": "VMError", "message": "restore broke"})
            else:
                out.append({"sandbox_id": c["sandbox_id"], "ok": True, "envd_host": "127.0.0.1",
                            "envd_port": 41000 + i, "pid": 500 + i, "accel": "tcg", "timings": {"init": 3.0}})
        return {"parent": {"ok": True}, "children": out, "timings": {"fork_ms": 80.0, "total_ms": 600.0}}

    return run


@pytest.fixture
def fork_mock(nodes_mock):
    nodes_mock.client.fork_sandbox = mock.AsyncMock(side_effect=_fork_result())
    return nodes_mock


async def _fork(api, sandbox_id, **body):
    return await api.post(f"/sandboxes/{sandbox_id}/fork", json=body)


async def test_fork_into_three_with_one_failed_child(api, create, fork_mock):
    fork_mock.client.fork_sandbox.side_effect = _fork_result(fail={1})
    parent = await create(metadata={"k": "v"}, envVars={"E": "1"}, timeout=120)
    before = await Sandbox.objects.aget(pk=parent["sandboxID"])
    resp = await _fork(api, parent["sandboxID"], count=3, timeout=90)
    assert resp.status_code == 201, resp.text
    results = resp.json()
    assert [sorted(r) for r in results] == [["sandbox"], ["error"], ["sandbox"]]
    assert results[1]["error"]["code"] == 500 and "restore broke" in results[1]["error"]["message"]
    kids = [r["sandbox"] for r in results if "sandbox" in r]
    sent = fork_mock.client.fork_sandbox.await_args.kwargs
    assert sent["sandbox_id"] == parent["sandboxID"] and sent["access_token"] == before.envd_access_token
    assert sent["env_vars"] == {"E": "1"}
    tokens = {c["access_token"] for c in sent["children"]}
    assert len(tokens) == 3 and before.envd_access_token not in tokens
    now = timezone.now()
    for kid in kids:
        row = await Sandbox.objects.aget(pk=kid["sandboxID"])
        assert row.state == "running" and row.forked_from_id == parent["sandboxID"] and row.node_id == "n1"
        assert row.metadata == {"k": "v"} and row.env_vars == {"E": "1"} and row.secure
        assert kid["envdAccessToken"] == row.envd_access_token
        assert abs((row.end_at - now) - timedelta(seconds=90)) < timedelta(seconds=5)
    failed_id = sent["children"][1]["sandbox_id"]
    failed = await Sandbox.objects.aget(pk=failed_id)
    assert failed.state == "error" and "restore broke" in failed.error_reason
    after = await Sandbox.objects.aget(pk=parent["sandboxID"])
    assert after.state == "running" and after.end_at == before.end_at  # parent keeps id and expiry
    ops = [(e.outcome, e.from_state, e.to_state) async for e in
           SandboxEvent.objects.filter(sandbox_id=parent["sandboxID"], operation="fork").order_by("id")]
    assert ops == [("started", "running", "forking"), ("ok", "forking", "running")]
    listed = {s["sandboxID"] for s in (await api.get("/v2/sandboxes")).json()}
    assert listed == {parent["sandboxID"], *(k["sandboxID"] for k in kids)}


async def test_fork_defaults_count_one_and_inherits_timeout(api, create, fork_mock):
    parent = await create(timeout=200)
    assert (await api.post(f"/sandboxes/{parent['sandboxID']}/timeout", json={"timeout": 700})).status_code == 204
    resp = await api.post(f"/sandboxes/{parent['sandboxID']}/fork")  # no body at all
    assert resp.status_code == 201, resp.text
    [only] = resp.json()
    row = await Sandbox.objects.aget(pk=only["sandbox"]["sandboxID"])
    assert abs((row.end_at - timezone.now()) - timedelta(seconds=700)) < timedelta(seconds=5)
    # a fork with an explicit child timeout does not change what the parent's next children inherit
    assert (await _fork(api, parent["sandboxID"], timeout=30)).status_code == 201
    kid = (await _fork(api, parent["sandboxID"])).json()[0]["sandbox"]
    row = await Sandbox.objects.aget(pk=kid["sandboxID"])
    assert abs((row.end_at - timezone.now()) - timedelta(seconds=700)) < timedelta(seconds=5)
    fresh = await create(timeout=150)
    kid = (await _fork(api, fresh["sandboxID"])).json()[0]["sandbox"]
    row = await Sandbox.objects.aget(pk=kid["sandboxID"])
    assert abs((row.end_at - timezone.now()) - timedelta(seconds=150)) < timedelta(seconds=5)


async def test_fork_children_inherit_every_setting_of_the_parent(api, create, fork_mock):
    """All of a parent's options reach each child, autoPauseMemory included (a child of a
    filesystem-only-on-expiry parent once paused with memory)."""
    parent = await create(metadata={"k": "v"}, envVars={"E": "1"}, autoPause=True, autoPauseMemory=False,
                          autoResume={"enabled": True})
    kid = (await _fork(api, parent["sandboxID"], count=1)).json()[0]["sandbox"]
    row = await Sandbox.objects.aget(pk=kid["sandboxID"])
    assert (row.auto_pause, row.auto_pause_memory, row.auto_resume) == (True, False, True)
    assert row.metadata == {"k": "v"} and row.env_vars == {"E": "1"} and row.secure
    parent_row = await Sandbox.objects.aget(pk=parent["sandboxID"])
    from lifecycle.sandboxes.options import SandboxOptions  # noqa: PLC0415

    assert SandboxOptions.of(row) == SandboxOptions.of(parent_row)


@pytest.mark.parametrize("body, text", [({"count": 0}, "between 1 and 100"), ({"count": 101}, "between 1 and 100"),
                                        ({"count": "2"}, "count"), ({"count": True}, "count"),
                                        ({"timeout": -1}, "timeout"), ({"count": 2.5}, "count")])
async def test_fork_bad_input_is_400(api, create, fork_mock, assert_error, body, text):
    parent = await create()
    assert_error(await _fork(api, parent["sandboxID"], **body), 400, text)
    fork_mock.client.fork_sandbox.assert_not_awaited()
    assert await Sandbox.objects.acount() == 1


async def test_fork_over_the_node_limit_names_it(api, create, fork_mock, assert_error, settings):
    parent = await create()
    body = assert_error(await _fork(api, parent["sandboxID"], count=33), 400)
    assert "AENV_FORK_MAX_PER_NODE=32" in body["message"]
    settings.AENV_FORK_MAX_PER_NODE = 2
    assert_error(await _fork(api, parent["sandboxID"], count=3), 400, "AENV_FORK_MAX_PER_NODE=2")
    assert (await _fork(api, parent["sandboxID"], count=2)).status_code == 201
    fork_mock.client.fork_sandbox.assert_awaited_once()


async def test_fork_paused_unknown_other_team(api, create, fork_mock, assert_error, asgi_app, other_key):
    assert_error(await _fork(api, "nope", count=1), 404, "not found")
    parent = await create()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi_app), base_url="http://testserver",
                                 headers={"X-API-Key": other_key}) as other:
        assert_error(await _fork(other, parent["sandboxID"], count=1), 404)
    assert (await api.post(f"/sandboxes/{parent['sandboxID']}/pause")).status_code == 204
    assert_error(await _fork(api, parent["sandboxID"], count=1), 409, "not running")
    fork_mock.client.fork_sandbox.assert_not_awaited()
    assert (await Sandbox.objects.aget(pk=parent["sandboxID"])).state == "paused"
    assert await Sandbox.objects.acount() == 1


async def test_capture_failure_is_500_parent_runs_children_error(api, create, fork_mock, assert_error):
    parent = await create()
    fork_mock.client.fork_sandbox.side_effect = fork_mock.client.NodeTaskFailed("stop failed", kind="VMError")
    assert_error(await _fork(api, parent["sandboxID"], count=2), 500, "fork failed")
    assert (await Sandbox.objects.aget(pk=parent["sandboxID"])).state == "running"
    kids = [s async for s in Sandbox.objects.filter(forked_from_id=parent["sandboxID"])]
    assert len(kids) == 2 and {k.state for k in kids} == {"error"}
    fork_mock.client.kill_sandbox.assert_not_awaited()


async def test_capture_storage_full_is_507(api, create, fork_mock, assert_error):
    parent = await create()
    fork_mock.client.fork_sandbox.side_effect = fork_mock.client.NodeTaskFailed("ENOSPC", kind="StorageFull")
    body = assert_error(await _fork(api, parent["sandboxID"], count=1), 507)
    assert body["error_code"] == "insufficient_storage"
    assert (await Sandbox.objects.aget(pk=parent["sandboxID"])).state == "running"


async def test_fork_node_timeout_removes_everything(api, create, fork_mock, assert_error):
    parent = await create()
    fork_mock.client.fork_sandbox.side_effect = fork_mock.client.NodeTimeout("slow")
    assert_error(await _fork(api, parent["sandboxID"], count=2), 504)
    assert (await Sandbox.objects.aget(pk=parent["sandboxID"])).state == "error"
    kids = [s.id async for s in Sandbox.objects.filter(forked_from_id=parent["sandboxID"], state="error")]
    killed = {c.kwargs["sandbox_id"] for c in fork_mock.client.kill_sandbox.await_args_list}
    assert killed == {parent["sandboxID"], *kids} and len(kids) == 2


async def test_parent_killed_during_fork_keeps_consistent_states(api, create, fork_mock):
    parent = await create()
    inner = _fork_result()

    async def kill_midway(node, **kw):
        await Sandbox.objects.filter(pk=kw["sandbox_id"]).aupdate(state="killed")  # a kill won meanwhile
        await Sandbox.objects.filter(pk=kw["children"][0]["sandbox_id"]).aupdate(state="killed")
        return await inner(node, **kw)

    fork_mock.client.fork_sandbox.side_effect = kill_midway
    resp = await _fork(api, parent["sandboxID"], count=2)
    assert resp.status_code == 201, resp.text
    first, second = resp.json()
    assert first["error"]["code"] == 409 and "killed" in first["error"]["message"]
    assert (await Sandbox.objects.aget(pk=second["sandbox"]["sandboxID"])).state == "running"
    assert (await Sandbox.objects.aget(pk=parent["sandboxID"])).state == "killed"
    aborted = await SandboxEvent.objects.filter(sandbox_id=parent["sandboxID"], operation="fork",
                                                outcome="aborted").aexists()
    assert aborted
    # the killed child's VM, started after its kill, was removed
    killed = [c.kwargs["sandbox_id"] for c in fork_mock.client.kill_sandbox.await_args_list]
    assert fork_mock.client.fork_sandbox.await_args.kwargs["children"][0]["sandbox_id"] in killed


async def test_timed_out_fork_spares_rows_settled_meanwhile(api, create, fork_mock, assert_error):
    parent = await create()

    async def reconciled_then_timeout(node, **kw):
        await Sandbox.objects.filter(pk=kw["sandbox_id"]).aupdate(state="running")
        await Sandbox.objects.filter(pk=kw["children"][0]["sandbox_id"]).aupdate(state="error")
        raise fork_mock.client.NodeTimeout("worker restarted")

    fork_mock.client.fork_sandbox.side_effect = reconciled_then_timeout
    fork_mock.client.kill_sandbox.reset_mock()
    assert_error(await _fork(api, parent["sandboxID"], count=2), 504)
    assert (await Sandbox.objects.aget(pk=parent["sandboxID"])).state == "running"
    sent = [c["sandbox_id"] for c in fork_mock.client.fork_sandbox.await_args.kwargs["children"]]
    killed = [c.kwargs["sandbox_id"] for c in fork_mock.client.kill_sandbox.await_args_list]
    assert killed == [sent[1]]  # only the child this request itself moved to error


async def test_fork_beyond_node_capacity_is_503(api, create, fork_mock, assert_error, settings):
    """Children reserve AENV_FORK_CHILD_MEMORY_MB each (they share the parent's memory); a
    node truly full still refuses, saying what a child reserves."""
    settings.AENV_FORK_CHILD_MEMORY_MB = 128
    parent = await create()  # 2 vCPU / 512 MiB; the node has 64 vCPU / 65536 MiB
    from nodes.models import Node

    await Node.objects.filter(pk="n1").aupdate(memory_mb_capacity=512 + 128 * 3)
    resp = await _fork(api, parent["sandboxID"], count=4)
    assert_error(resp, 503, "no room")
    assert "each reserving 2 vCPU / 128 MiB while it shares its parent's memory" in resp.json()["message"]
    assert (await _fork(api, parent["sandboxID"], count=3)).status_code == 201
    assert_error(await _fork(api, parent["sandboxID"], count=1), 503, "no room")  # now full
    assert (await Sandbox.objects.aget(pk=parent["sandboxID"])).state == "running"


async def test_sixteen_fork_children_fit_a_two_core_node_and_are_counted_as_they_cost(
        api, create, fork_mock, settings):
    """AgentENV's "fork into up to 16 children on the same node" on the node of issue 13 (2
    cores, 24 GiB; the vCPU overcommit of that time, 16 a core): 17 full 2 vCPU / 512 MiB
    VMs would not fit, 16 children at their charge do; the nodes API (and so the dashboard
    and Prometheus) shows what placement counts; a resumed child reserves its whole shape."""
    from nodes.models import Node
    from nodes.placement import with_reservations

    settings.AENV_FORK_CHILD_MEMORY_MB, settings.AENV_FORK_VCPU_OVERCOMMIT = 96, 2
    await Node.objects.filter(pk="n1").aupdate(vcpu_capacity=2 * 16, memory_mb_capacity=int(24 * 1024 * 1.5))
    parent = await create()
    resp = await _fork(api, parent["sandboxID"], count=16)
    assert resp.status_code == 201 and all("sandbox" in r for r in resp.json()), resp.text
    children = [r["sandbox"]["sandboxID"] for r in resp.json()]
    node = await with_reservations(Node.objects.filter(pk="n1")).aget()
    assert (node.cpu_reserved, node.memory_reserved) == (2 + 16 * 1, 512 + 16 * 96)
    settings.AENV_ADMIN_TOKEN = "op-" + "x" * 40  # the operators' view has placement's figures
    listed = (await api.get("/nodes", headers={"X-Admin-Token": settings.AENV_ADMIN_TOKEN})).json()[0]["metrics"]
    assert listed["allocatedCPU"] == 18 and listed["allocatedMemoryBytes"] == (512 + 16 * 96) << 20
    # the shape the API reports is still the guest's
    info = (await api.get(f"/sandboxes/{children[0]}")).json()
    assert info["cpuCount"] == 2 and info["memoryMB"] == 512

    await Sandbox.objects.filter(pk=children[0]).aupdate(state="paused")
    resumed = await api.post(f"/sandboxes/{children[0]}/connect", json={"timeout": 60})
    assert resumed.status_code == 201, resumed.text
    row = await Sandbox.objects.aget(pk=children[0])
    assert (row.reserved_vcpus, row.reserved_memory_mb) == (None, None)
    node = await with_reservations(Node.objects.filter(pk="n1")).aget()
    assert (node.cpu_reserved, node.memory_reserved) == (2 + 15 + 2, 512 + 15 * 96 + 512)


def test_fork_child_charge_never_exceeds_the_shape(settings):
    from nodes.placement import fork_child_charge

    settings.AENV_FORK_CHILD_MEMORY_MB, settings.AENV_FORK_VCPU_OVERCOMMIT = 128, 1
    assert fork_child_charge(2, 512) == (2, 128)
    assert fork_child_charge(1, 64) == (1, 64)
    settings.AENV_FORK_VCPU_OVERCOMMIT = 3
    assert fork_child_charge(4, 2048) == (2, 128) and fork_child_charge(1, 512) == (1, 128)


async def test_fork_of_a_sandbox_whose_vm_is_gone_is_409_and_the_sandbox_lost(api, create, fork_mock, assert_error):
    """The node has no VM for a sandbox its row says runs (the chaos bench with 20 clients: a
    500 "VMNotFound"): a 409 saying the sandbox is lost, its row error with the fork's event."""
    parent = await create()
    fork_mock.client.fork_sandbox.side_effect = fork_mock.client.NodeTaskFailed(
        "unknown sandbox 'x'", kind="VMNotFound")
    body = assert_error(await _fork(api, parent["sandboxID"], count=1), 409, "lost")
    assert body["error_code"] == "sandbox_lost"
    row = await Sandbox.objects.aget(pk=parent["sandboxID"])
    assert row.state == "error" and "no VM" in row.error_reason
    assert await SandboxEvent.objects.filter(sandbox_id=row.pk, operation="fork", outcome="error",
                                             to_state="error").aexists()
