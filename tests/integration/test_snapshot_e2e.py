"""Snapshots end to end with real VMs and the official SDK: two sandboxes started from
one snapshot both see the file and the still-running background process; deleting the
snapshot is refused while one of them lives; a full snapshot store fails cleanly."""
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox
from e2b.exceptions import SandboxException

from cluster.processes import qemu_pids

from harness.guest_counter import read_counter, start_counter

pytestmark = pytest.mark.vm


def _shm_files(sandbox_id: str) -> list[str]:
    """Guest RAM files of a sandbox (its own, or a fork capture of it) in /dev/shm."""
    return sorted(p.name for p in Path("/dev/shm").glob("aenv-*")
                  if p.name == f"aenv-{sandbox_id}.ram" or p.name.startswith(f"aenv-fork-{sandbox_id}-"))


def _snapshot_dirs(stack) -> list[str]:
    root = stack.home / "snapshots"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_snapshot_restore_twice_then_delete(stack, sdk_env):
    src = Sandbox.create(timeout=600, envs={"ORIGIN": "source"})
    restored = []
    snap_id = None
    try:
        src.files.write("/home/user/state.txt", "captured")
        pid, n0 = start_counter(src)
        info = src.create_snapshot(name="e2e-snap")
        snap_id = info.snapshot_id
        assert info.names == ["e2e-snap"]
        assert snap_id in _snapshot_dirs(stack)
        # the source keeps running with the same id (and its counter keeps counting)
        assert src.is_running()
        time.sleep(0.6)
        assert read_counter(src)[0] == pid and read_counter(src)[1] > n0
        listed = Sandbox.list_snapshots(sandbox_id=src.sandbox_id).next_items()
        assert [s.snapshot_id for s in listed] == [snap_id]
        assert [s.snapshot_id for s in Sandbox.list_snapshots(name="e2e-snap").next_items()] == [snap_id]

        # the source changes after the snapshot: the restored sandboxes must not see it
        src.files.write("/home/user/state.txt", "changed later")
        for ref in (snap_id, "e2e-snap"):  # by id and by name
            restored.append(Sandbox.create(ref, timeout=300, envs={"ORIGIN": "restored"}))
        tokens = {s.sandbox_id: s._envd_access_token for s in restored}
        assert len(set(tokens.values()) | {src._envd_access_token}) == 3, "each sandbox needs its own token"
        for sbx in restored:
            assert sbx.sandbox_id != src.sandbox_id
            assert sbx.files.read("/home/user/state.txt") == "captured"
            p1, n1 = read_counter(sbx)
            assert p1 == pid, "the background process was restarted, not restored"
            time.sleep(0.6)
            p2, n2 = read_counter(sbx)
            assert p2 == pid and n2 > n1, "the restored counter does not run"
            assert sbx.commands.run("echo $ORIGIN").stdout.strip() == "restored"
            guest_now = float(sbx.commands.run("date +%s.%N").stdout)
            assert abs(guest_now - time.time()) < 10, "guest clock was not re-synced after the restore"
        # restored sandboxes are independent of each other
        restored[0].files.write("/home/user/only0.txt", "x")
        assert not restored[1].files.exists("/home/user/only0.txt")
        # the source's token does not open a restored sandbox
        r = httpx.get(f"{stack.sandbox_url}/envs", headers={"E2b-Sandbox-Id": restored[0].sandbox_id,
                                                            "X-Access-Token": src._envd_access_token})
        assert r.status_code == 401, r.text

        with pytest.raises(SandboxException) as err:
            Sandbox.delete_snapshot(snap_id)
        assert "409" in str(err.value) and "still used" in str(err.value)
        restored[0].kill()
        with pytest.raises(SandboxException):
            Sandbox.delete_snapshot(snap_id)  # the second one still uses it
        restored[1].kill()
        assert Sandbox.delete_snapshot(snap_id) is True
        assert snap_id not in _snapshot_dirs(stack)
        assert Sandbox.delete_snapshot(snap_id) is False  # 404
        assert Sandbox.list_snapshots(sandbox_id=src.sandbox_id).next_items() == []
    finally:
        for sbx in restored:
            sbx.kill()
        src.kill()
        if snap_id:
            Sandbox.delete_snapshot(snap_id)
    left = stack.vm_leftovers()
    for sid in [src.sandbox_id] + [s.sandbox_id for s in restored]:
        assert sid not in left["state_dirs"] and qemu_pids(sid) == [] and _shm_files(sid) == []


def test_snapshot_of_unknown_or_paused_sandbox(stack, sdk_env):
    h = stack.headers()
    r = httpx.post(f"{stack.api_url}/sandboxes/inope/snapshots", json={}, headers=h)
    assert r.status_code == 404 and r.json()["code"] == 404
    sbx = Sandbox.create(timeout=300)
    try:
        assert sbx.pause() is True
        r = httpx.post(f"{stack.api_url}/sandboxes/{sbx.sandbox_id}/snapshots", json={}, headers=h)
        assert r.status_code == 409 and "not running" in r.json()["message"], r.text
        assert Sandbox.connect(sbx.sandbox_id).commands.run("echo ok").stdout == "ok\n"
    finally:
        sbx.kill()
    assert qemu_pids(sbx.sandbox_id) == []


def test_snapshot_disk_full_is_a_clean_507(stack, sdk_env):
    """A tiny tmpfs as the snapshot store: the capture fails with 507 {code, message},
    the sandbox keeps running and nothing partial is left in the store."""
    root = stack.home / "snapshots"
    root.mkdir(parents=True, exist_ok=True)
    sbx = Sandbox.create(timeout=300)
    # Over the store (hiding, not touching, the snapshots other tests keep, such as a
    # built template's): empty, so anything found in it below is this capture's leftover.
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "aenv-test-full", str(root)], check=True)
    try:
        sbx.files.write("/home/user/f.txt", "before")
        r = httpx.post(f"{stack.api_url}/sandboxes/{sbx.sandbox_id}/snapshots", json={"name": "full"},
                       headers=stack.headers(), timeout=300)
        assert r.status_code == 507, r.text
        body = r.json()
        assert body["code"] == 507 and "full" in body["message"] and body.get("error_code") == "insufficient_storage"
        assert _snapshot_dirs(stack) == [], "a partial snapshot was left in the store"
        assert sbx.is_running()
        assert sbx.files.read("/home/user/f.txt") == "before"
        assert sbx.commands.run("echo alive").stdout == "alive\n"
        assert Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id).next_items() == []
        info = httpx.get(f"{stack.api_url}/sandboxes/{sbx.sandbox_id}", headers=stack.headers()).json()
        assert info["state"] == "running"
    finally:
        subprocess.run(["umount", str(root)], check=False)
        sbx.kill()
    assert qemu_pids(sbx.sandbox_id) == []


def test_filesystem_only_snapshot_cold_boots_with_its_files(stack, sdk_env):
    src = Sandbox.create(timeout=300)
    snap_id = None
    try:
        src.files.write("/home/user/state.txt", "on disk")
        pid, _ = start_counter(src)
        info = src.create_snapshot(mode="filesystem")
        snap_id = info.snapshot_id
        files = sorted(p.name for p in (stack.home / "snapshots" / snap_id).iterdir())
        assert "memory.ram" not in files and "manifest.json" in files
        assert src.is_running() and read_counter(src)[0] == pid
        found = src.commands.run("pgrep -f 'python3 [/]home/user/counter' || echo none").stdout.split()
        assert str(pid) in found  # the probe below really finds the counter where it runs
        fresh = Sandbox.create(snap_id, timeout=300)
        try:
            assert fresh.files.read("/home/user/state.txt") == "on disk"  # written just before: synced
            assert fresh.files.exists("/home/user/counter.py")
            out = fresh.commands.run("pgrep -f 'python3 [/]home/user/counter' || echo none").stdout.strip()
            assert out == "none", f"a cold boot must not carry processes over: {out}"
            assert fresh.commands.run("echo fresh").stdout == "fresh\n"
        finally:
            fresh.kill()
        assert Sandbox.delete_snapshot(snap_id) is True
        snap_id = None
    finally:
        src.kill()
        if snap_id:
            Sandbox.delete_snapshot(snap_id)
    assert qemu_pids(src.sandbox_id) == [] and qemu_pids(fresh.sandbox_id) == []


def test_snapshot_of_a_restored_sandbox_outlives_its_parent_snapshot(stack, sdk_env):
    """template → snapshot A → sandbox → snapshot B: once A is deleted (allowed after its
    sandbox is killed: B holds its own copies), B still restores with file and process."""
    kept = set(_snapshot_dirs(stack))  # other tests' (a built template's snapshot stays)
    src = Sandbox.create(timeout=300)
    mid = last = None
    snaps = []
    try:
        src.files.write("/home/user/gen.txt", "A")
        pid, _ = start_counter(src)
        snaps.append(src.create_snapshot().snapshot_id)
        src.kill()
        mid = Sandbox.create(snaps[0], timeout=300)
        mid.files.write("/home/user/gen.txt", "B")
        snaps.append(mid.create_snapshot().snapshot_id)
        mid.kill()
        assert Sandbox.delete_snapshot(snaps[0]) is True
        last = Sandbox.create(snaps[1], timeout=300)
        assert last.files.read("/home/user/gen.txt") == "B"
        p1, n1 = read_counter(last)
        time.sleep(0.6)
        p2, n2 = read_counter(last)
        assert p1 == p2 == pid and n2 > n1, "the process captured in A, carried through B, does not run"
        detail = httpx.get(f"{stack.api_url}/sandboxes/{last.sandbox_id}", headers=stack.headers()).json()
        assert detail["state"] == "running"
    finally:
        for sbx in (src, mid, last):
            if sbx is not None:
                sbx.kill()
        for sid in snaps:
            Sandbox.delete_snapshot(sid)
    assert set(_snapshot_dirs(stack)) - kept == set()
    for sbx in (src, mid, last):
        assert qemu_pids(sbx.sandbox_id) == [] and _shm_files(sbx.sandbox_id) == []
