"""Pause / connect end to end with real VMs and the official SDK: a paused sandbox keeps
its files and its running processes (memory snapshot), and nothing is left after kill."""
import time
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox, SandboxQuery, SandboxState

from cluster.processes import qemu_pids

from harness.guest_counter import read_counter, start_counter

pytestmark = pytest.mark.vm

def test_pause_then_connect_keeps_files_and_processes(stack, sdk_env):
    sbx = Sandbox.create(timeout=600)
    try:
        sbx.files.write("/home/user/keep.txt", "still here")
        pid, n_before = start_counter(sbx)
        assert n_before >= 2

        t0 = time.monotonic()
        assert sbx.pause() is True
        pause_s = time.monotonic() - t0
        assert sbx.is_running() is False
        paused = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()
        assert sbx.sandbox_id in [s.sandbox_id for s in paused]
        running = Sandbox.list(query=SandboxQuery(state=[SandboxState.RUNNING])).next_items()
        assert sbx.sandbox_id not in [s.sandbox_id for s in running]
        assert sbx.pause() is False  # 409: already paused
        # the QEMU process is gone while paused to disk; the state dir stays
        assert sbx.sandbox_id in stack.vm_leftovers()["state_dirs"]
        assert qemu_pids(sbx.sandbox_id) == [], "pause to disk should stop the QEMU process"
        time.sleep(3)  # long enough for a stale guest clock to show

        t0 = time.monotonic()
        again = Sandbox.connect(sbx.sandbox_id, timeout=600)
        connect_s = time.monotonic() - t0
        assert again.sandbox_id == sbx.sandbox_id
        assert again.is_running() is True
        assert again.commands.run("echo back").stdout == "back\n"
        assert again.files.read("/home/user/keep.txt") == "still here"
        pid_after, n_after = read_counter(again)
        assert pid_after == pid, "the counter process was restarted, not resumed"
        assert n_after >= n_before
        time.sleep(1.5)
        pid_later, n_later = read_counter(again)
        assert pid_later == pid and n_later > n_after, "the counter does not run after the resume"
        guest_now = float(again.commands.run("date +%s.%N").stdout)
        assert abs(guest_now - time.time()) < 10, "guest clock was not re-synced on resume"

        # a running sandbox: connect only extends (200)
        assert Sandbox.connect(sbx.sandbox_id, timeout=600).is_running()

        # pause to disk again, then the legacy raw-HTTP resume (201): same process, same file
        h = stack.headers()
        assert httpx.post(f"{stack.api_url}/sandboxes/{sbx.sandbox_id}/pause", headers=h).status_code == 204
        assert qemu_pids(sbx.sandbox_id) == []
        resp = httpx.post(f"{stack.api_url}/sandboxes/{sbx.sandbox_id}/resume", json={"timeout": 600},
                          headers=h, timeout=300)
        assert resp.status_code == 201, resp.text
        assert resp.json()["sandboxID"] == sbx.sandbox_id
        assert httpx.post(f"{stack.api_url}/sandboxes/{sbx.sandbox_id}/resume", json={},
                          headers=h).status_code == 409  # already running
        assert again.files.read("/home/user/keep.txt") == "still here"
        pid_resumed, n_resumed = read_counter(again)
        time.sleep(1.5)
        assert pid_resumed == pid and read_counter(again)[1] > n_resumed >= n_later
        print(f"\nPAUSE {pause_s * 1000:.0f} ms, CONNECT(resume) {connect_s * 1000:.0f} ms, "
              f"counter {n_before}->{n_after}->{n_later}")
    finally:
        sbx.kill()
    left = stack.vm_leftovers()
    assert sbx.sandbox_id not in left["state_dirs"]
    assert qemu_pids(sbx.sandbox_id) == []
    assert Sandbox.kill(sbx.sandbox_id) is False


def test_filesystem_pause_keeps_files_and_drops_processes(stack, sdk_env):
    """pause(mode="filesystem") → {"memory": false}: the guest syncs, only the disk is kept,
    connect cold-boots on it. A file written just before the pause (still in the guest's
    page cache, never synced by the test) survives; the background process does not."""
    sbx = Sandbox.create(timeout=600)
    try:
        start_counter(sbx)
        sbx.files.write("/home/user/unsynced.txt", "written right before the pause")
        assert sbx.pause(mode="filesystem") is True
        assert sbx.is_running() is False
        assert qemu_pids(sbx.sandbox_id) == []
        assert not any(Path("/dev/shm").glob(f"aenv-{sbx.sandbox_id}*")), "a filesystem pause keeps no RAM"

        again = Sandbox.connect(sbx.sandbox_id, timeout=600)
        assert again.files.read("/home/user/unsynced.txt") == "written right before the pause"
        assert again.commands.run("echo rebooted").stdout == "rebooted\n"
        procs = again.commands.run("ps -eo args").stdout
        assert "counter.py" not in procs, "processes must not survive a filesystem-only pause"
        guest_now = float(again.commands.run("date +%s.%N").stdout)
        assert abs(guest_now - time.time()) < 10
    finally:
        sbx.kill()
    assert sbx.sandbox_id not in stack.vm_leftovers()["state_dirs"]
    assert qemu_pids(sbx.sandbox_id) == []
