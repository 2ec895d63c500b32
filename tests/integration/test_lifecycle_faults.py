"""Faults in the middle of lifecycle operations, with real VMs: a kill during a pause,
and the node worker SIGKILLed in the middle of a pause and started again. Each ends in
a consistent state the API reports truthfully, answers without waiting for the node
deadline, and leaves no QEMU process, state dir or RAM file once killed."""
import threading
import time
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

from harness.guest_counter import read_counter, start_counter

pytestmark = pytest.mark.vm


def _nothing_left(stack, sandbox_id: str) -> None:
    end = time.monotonic() + 30
    while time.monotonic() < end:
        left = (stack.qemu_pids(sandbox_id), sandbox_id in stack.vm_leftovers()["state_dirs"],
                Path(f"/dev/shm/aenv-{sandbox_id}.ram").exists())
        if left == ([], False, False):
            return
        time.sleep(0.3)
    raise AssertionError(f"{sandbox_id} left (processes, state dir, ram file) = {left}")


def _db(stack, sandbox_id: str) -> str:
    return stack.db("from sandboxes.models import Sandbox\n"
                    f"print(Sandbox.objects.get(pk='{sandbox_id}').state)").strip()


def _in_thread(fn):
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("result", fn()), daemon=True)
    t.start()
    return t, box


def test_kill_during_pause(stack, sdk_env):
    sbx = Sandbox.create(timeout=600)
    h = stack.headers()
    pause, box = _in_thread(lambda: httpx.post(f"{stack.api_url}/sandboxes/{sbx.sandbox_id}/pause",
                                               headers=h, timeout=300))
    time.sleep(0.2)
    killed = httpx.delete(f"{stack.api_url}/sandboxes/{sbx.sandbox_id}", headers=h, timeout=300)
    pause.join(120)
    assert not pause.is_alive(), "the pause request hung"
    assert killed.status_code == 204, killed.text
    # the pause lost (404) or had finished first (204); never a 500
    assert box["result"].status_code in (204, 404), box["result"].text
    assert _db(stack, sbx.sandbox_id) == "killed"
    assert httpx.get(f"{stack.api_url}/sandboxes/{sbx.sandbox_id}", headers=h).status_code == 404
    _nothing_left(stack, sbx.sandbox_id)


def test_worker_killed_mid_pause_reconciles(stack, sdk_env):
    sbx = Sandbox.create(timeout=600)
    try:
        sbx.files.write("/home/user/keep.txt", "kept")
        counter_pid, _ = start_counter(sbx)

        t0 = time.monotonic()
        pause, box = _in_thread(lambda: httpx.post(f"{stack.api_url}/sandboxes/{sbx.sandbox_id}/pause",
                                                   headers=stack.headers(), timeout=600))
        end = time.monotonic() + 60
        while "nodes.pause_sandbox" not in stack.new_log("node") and time.monotonic() < end:
            time.sleep(0.005)
        stack.kill_node()  # mid-pause (or just after it)
        stack.start_node()
        pause.join(60)
        assert not pause.is_alive(), "the pause request waited for the node deadline"
        answered = time.monotonic() - t0
        status = box["result"].status_code
        state = _db(stack, sbx.sandbox_id)
        print(f"\npause answered {status} after {answered:.1f} s; sandbox {state}")
        assert (status, state) in ((204, "paused"), (409, "running")), (status, state, box["result"].text)
        if state == "paused":
            assert stack.qemu_pids(sbx.sandbox_id) == []  # no QEMU left behind by the dead worker
            sbx = Sandbox.connect(sbx.sandbox_id, timeout=600)
        else:
            assert len(stack.qemu_pids(sbx.sandbox_id)) == 1
        # either way the sandbox works and its process and file are intact
        assert sbx.commands.run("echo ok").stdout == "ok\n"
        assert sbx.files.read("/home/user/keep.txt") == "kept"
        assert read_counter(sbx)[0] == counter_pid
        events = stack.db("from sandboxes.models import SandboxEvent as E\n"
                          f"for e in E.objects.filter(sandbox_id='{sbx.sandbox_id}', operation='reconcile'):\n"
                          "    print(e.from_state, e.to_state, e.actor)")
        assert f"pausing {state} node:{stack.node_id}" in events
    finally:
        if "node" not in stack.procs:
            stack.start_node()
        Sandbox.kill(sbx.sandbox_id)
    _nothing_left(stack, sbx.sandbox_id)


def test_worker_killed_mid_resume_reconciles(stack, sdk_env):
    sbx = Sandbox.create(timeout=600)
    try:
        sbx.files.write("/home/user/keep.txt", "kept")
        counter_pid, _ = start_counter(sbx)
        assert sbx.pause() is True

        connect, box = _in_thread(lambda: httpx.post(f"{stack.api_url}/sandboxes/{sbx.sandbox_id}/connect",
                                                     json={"timeout": 600}, headers=stack.headers(), timeout=600))
        end = time.monotonic() + 60
        while "nodes.resume_sandbox" not in stack.new_log("node") and time.monotonic() < end:
            time.sleep(0.005)
        stack.kill_node()  # mid-resume
        stack.start_node()
        connect.join(60)
        assert not connect.is_alive(), "the connect request waited for the node deadline"
        status, state = box["result"].status_code, _db(stack, sbx.sandbox_id)
        print(f"\nconnect answered {status}; sandbox {state}")
        # an unacknowledged resume leaves the sandbox paused (VM saved again, no stray QEMU);
        # a resume whose answer was out before the kill simply stands
        assert (status, state) in ((503, "paused"), (201, "running")), box["result"].text
        if state == "paused":
            assert stack.qemu_pids(sbx.sandbox_id) == []
        again = Sandbox.connect(sbx.sandbox_id, timeout=600)
        assert again.files.read("/home/user/keep.txt") == "kept"
        assert read_counter(again)[0] == counter_pid
        assert len(stack.qemu_pids(sbx.sandbox_id)) == 1
    finally:
        if "node" not in stack.procs:
            stack.start_node()
        Sandbox.kill(sbx.sandbox_id)
    _nothing_left(stack, sbx.sandbox_id)
