"""A node dies (its worker and its VMs SIGKILLed), with the S3 store (a moto server): its
heartbeat stops, so it is dead after AENV_NODE_LOST_AFTER and the sweeper declares its
running sandbox lost (error, with a ``lost`` event); its paused sandbox, whose pause was
exported to the store, resumes on the other node with its memory (the same process, still
counting) and its files. When the dead node comes back it removes its stale copy.

Node B lacks the base disk (a node that never saw the image: the pause image brings it, read
lazily). Then the store goes away (the moto server SIGSTOPped) while that sandbox reads its disk
past every cache: the guest gets an I/O error within the read deadline, node B's VM watch makes
the sandbox ``error`` with the store named and removes its VM, and the API and node B keep
answering. (Memory that cannot be fetched, a corrupt chunk, a warm restart:
tests/vmm/test_lazy_restore_vm.py.)"""
from __future__ import annotations

import os
import signal
import threading
import time
import uuid

import httpx
import pytest
from e2b import CommandExitException, Sandbox

from cluster.processes import qemu_pids
from harness.moto_s3 import CREDENTIALS, moto_server, silenced

from .conftest import running_stack
from harness.guest_counter import read_counter, start_counter
from harness.second_node import SecondNode, short_root  # noqa: F401 - a fixture

pytestmark = [pytest.mark.vm, pytest.mark.timeout(900)]

BUCKET = "aenv-death"


@pytest.fixture(scope="module")
def death_stack():
    with moto_server(BUCKET) as url:
        env = {"AENV_SNAPSHOT_BACKEND": "s3", "AENV_S3_ENDPOINT": url, "AENV_S3_BUCKET": BUCKET,
               "AENV_S3_REGION": "us-east-1", "AENV_S3_PREFIX": f"d-{uuid.uuid4().hex[:6]}", **CREDENTIALS,
               "AENV_NODE_HEARTBEAT_INTERVAL": "1", "AENV_NODE_HEARTBEAT_TIMEOUT": "5",
               "AENV_NODE_LOST_AFTER": "10", "AENV_PAUSE_EXPORT_DELAY": "0.5",
               "AENV_CHUNK_READ_DEADLINE": "5", "AENV_VM_WATCH_INTERVAL": "1"}
        with running_stack("death", extra_env=env) as s:
            s.moto_url = url
            yield s


def _row(stack, sandbox_id: str, field: str) -> str:
    return stack.db(f"from sandboxes.models import Sandbox as S; print(S.objects.get(pk='{sandbox_id}').{field})").strip()


def _drain(stack, node_id: str, on: bool) -> None:
    stack.db(f"from nodes.models import Node; Node.objects.filter(pk='{node_id}').update(draining={on})")


def test_a_dead_nodes_running_sandbox_is_lost_and_its_paused_one_moves(death_stack, short_root, monkeypatch):
    stack = death_stack
    for key, value in (("E2B_API_URL", stack.api_url), ("E2B_SANDBOX_URL", stack.sandbox_url),
                       ("E2B_API_KEY", stack.api_key)):
        monkeypatch.setenv(key, value)
    node_b = SecondNode(stack, short_root, base_disk=False)
    try:
        _drain(stack, node_b.id, True)  # both sandboxes on node A
        running = Sandbox.create(timeout=600)
        paused = Sandbox.create(timeout=600)
        _drain(stack, node_b.id, False)
        assert {_row(stack, s.sandbox_id, "node_id") for s in (running, paused)} == {stack.node_id}
        paused.files.write("/home/user/keep.txt", "kept across nodes")
        pid, _ = start_counter(paused)
        paused.pause()
        deadline = time.monotonic() + 120
        while _row(stack, paused.sandbox_id, "pause_image_at") == "None":  # exported to the store
            assert time.monotonic() < deadline, stack.log("node")
            time.sleep(0.5)

        # node A dies: its worker and every VM of its home, at once
        stack.kill_node()
        for qemu in stack.qemu_pids(running.sandbox_id):
            os.kill(qemu, signal.SIGKILL)
        deadline = time.monotonic() + 90
        while _row(stack, running.sandbox_id, "state") != "error":
            assert time.monotonic() < deadline, stack.log("lifecycle")
            time.sleep(1)
        assert _row(stack, running.sandbox_id, "error_reason").startswith(f"lost: node {stack.node_id}")
        lost_events = stack.db("from sandboxes.models import SandboxEvent as E; "
                               f"print(E.objects.filter(sandbox_id='{running.sandbox_id}', operation='lost').count())")
        assert lost_events.strip() == "1"
        assert _row(stack, paused.sandbox_id, "state") == "paused"  # its files outlive its node

        back = Sandbox.connect(paused.sandbox_id, timeout=300)
        assert _row(stack, paused.sandbox_id, "node_id") == node_b.id
        # from lazily filled files (AENV_LAZY_RESTORE), not a whole download of its pause image
        image = f"pause-{paused.sandbox_id}"[:64]
        assert (node_b.home / "lazy" / "snapshots" / image / "manifest.json").is_file()
        assert not (node_b.home / "cache" / "snapshots" / image).exists()
        assert back.files.read("/home/user/keep.txt") == "kept across nodes"
        now_pid, n1 = read_counter(back)
        assert now_pid == pid  # its memory came along: the same process
        time.sleep(0.6)
        assert read_counter(back)[1] > n1

        stack.start_node()  # node A returns: its copy of the moved sandbox goes
        deadline = time.monotonic() + 60
        while (stack.home / "sandboxes" / paused.sandbox_id).exists():
            assert time.monotonic() < deadline, stack.log("node")
            time.sleep(0.5)
        assert "runs on node" in stack.new_log("node")
        _the_store_goes_away(stack, back, node_b)
    finally:
        node_b.stop()


def _the_store_goes_away(stack, back, node_b) -> None:
    """``back`` runs on node B from lazily filled files; the store stops answering while its
    guest reads its whole disk past every cache (O_DIRECT): chunks node B never fetched."""
    back.commands.run("dd --version >/dev/null")  # dd itself in the guest's page cache
    beat = _node_row(stack, node_b.id, "last_heartbeat_at")
    outcome, stderr = {}, []

    def read():
        t0 = time.monotonic()
        try:
            back.commands.run("dd if=/dev/vda of=/dev/null bs=1M iflag=direct", user="root", timeout=120,
                              on_stderr=stderr.append)
            outcome["out"] = "rc=0"
        except CommandExitException as exc:
            outcome["out"] = f"rc={exc.exit_code} {exc.stderr}"
        except Exception as exc:  # noqa: BLE001 - the VM removed before the exit code came back
            outcome["out"] = f"{type(exc).__name__} after stderr {''.join(stderr)!r}"
        finally:
            outcome["took"] = time.monotonic() - t0

    with silenced(stack.moto_url):
        reader = threading.Thread(target=read)
        t0 = time.monotonic()
        reader.start()
        with httpx.Client(base_url=stack.api_url, headers=stack.headers(), timeout=30) as api:
            assert api.get("/sandboxes").status_code == 200  # the API answers meanwhile
        reader.join(120)
        assert not reader.is_alive(), "the guest's read hangs"
        deadline = time.monotonic() + 60
        while _row(stack, back.sandbox_id, "state") != "error":
            assert time.monotonic() < deadline, (node_b.home / "node.log").read_text(errors="replace")[-3000:]
            time.sleep(1)
        failed = time.monotonic() - t0
    reason = _row(stack, back.sandbox_id, "error_reason")
    print(f"store silent: the guest's read failed after {outcome['took']:.1f} s ({outcome['out'][:200]!r}); "
          f"the sandbox was error {failed:.1f} s after the read began: {reason!r}")
    assert "Input/output error" in outcome["out"]
    assert reason.startswith("the guest's disk failed") and "snapshot store" in reason, reason
    events = stack.db("from sandboxes.models import SandboxEvent as E; print(E.objects.filter("
                      f"sandbox_id='{back.sandbox_id}', operation='reconcile', to_state='error').count())")
    assert events.strip() == "1"
    assert not qemu_pids(str(node_b.home), back.sandbox_id)
    assert not (node_b.home / "sandboxes" / back.sandbox_id).exists()  # what was left of the VM is removed
    assert _node_row(stack, node_b.id, "last_heartbeat_at") != beat  # node B kept beating


def _node_row(stack, node_id: str, field: str) -> str:
    return stack.db(f"from nodes.models import Node as N; print(N.objects.get(pk='{node_id}').{field})").strip()
