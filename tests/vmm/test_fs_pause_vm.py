"""Real QEMU microVMs: filesystem-only pause (pause_to_disk(memory=False)) and cold boots over a
given read-only layer chain (BootSpec.layers).

A file written without `sync` sits only in the guest page cache; it must survive the pause (the
driver has envd sync first). A background process must not survive (the resume is a cold boot).
"""

import os
from pathlib import Path

import pytest

from tests.vmm.test_lifecycle_vm import assert_gone, exists, real_driver, sh
from tests.vmm.test_qemu_vm import IMAGES_DIR, live_qemu_processes
from vmm.driver import BootSpec, VMError, get_driver
from vmm.qemu import envd_healthy

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    with real_driver(tmp_path_factory.mktemp("fspause") / "home") as d:
        yield d


def guest_pids(port: int, pattern: str) -> list[str]:
    """pids matching a pgrep -f pattern (write it as 'slee[p] 1' so the shell running pgrep does not match)."""
    return sh(port, f"pgrep -f '{pattern}' || true").split()


def test_fs_pause_keeps_files_not_processes(driver, tmp_path):
    info = driver.boot(BootSpec("fs-1", cpu_count=1, memory_mb=256))
    port = info.envd_port
    # 8 MiB of page cache that no one synced, plus a long-running process.
    sh(port, "head -c 8388608 /dev/urandom > /home/user/big.bin && md5sum /home/user/big.bin > /home/user/big.md5"
             " && echo hello > /home/user/note.txt")
    sh(port, "setsid nohup sleep 100000 >/dev/null 2>&1 </dev/null &")
    assert guest_pids(port, "slee[p] 100000")
    driver.pause(info.sandbox_id)  # from an in-memory pause: the driver must run the guest to sync
    # A sync that fails (envd gone, guest hung) aborts the pause and changes nothing.
    real_sync = driver._guest_sync

    def failing_sync(state):
        raise VMError("sync refused (test)")

    driver._guest_sync = failing_sync
    with pytest.raises(VMError, match="sync refused"):
        driver.pause_to_disk(info.sandbox_id, memory=False)
    driver._guest_sync = real_sync
    still = driver.info(info.sandbox_id)
    assert still.status == "paused" and still.pid == info.pid  # the same QEMU, still frozen in memory
    assert Path(f"/dev/shm/aenv-{info.sandbox_id}.ram").exists()
    assert not envd_healthy("127.0.0.1", port, timeout=0.5)  # its vCPUs were stopped again
    timings = driver.pause_to_disk(info.sandbox_id, memory=False)
    print(f"\npause_to_disk(memory=False): {timings}")
    assert timings["sync_ms"] >= 0 and timings["total_ms"] > 0
    paused = driver.info(info.sandbox_id)
    assert paused.status == "saved" and paused.pid == 0
    assert driver.inspect(info.sandbox_id).memory is False  # saved without its memory
    assert live_qemu_processes(str(info.state_dir)) == []
    assert not Path(f"/dev/shm/aenv-{info.sandbox_id}.ram").exists()  # the RAM is not kept
    assert not (info.state_dir / "device.state").exists()
    assert driver.pause_to_disk(info.sandbox_id, memory=False) == {}  # idempotent
    with pytest.raises(VMError):
        driver.pause(info.sandbox_id)
    with pytest.raises(VMError):
        driver.pause_to_disk(info.sandbox_id)  # with memory: nothing left to save
    # A restarted worker (new driver object on the same home) sees it paused.
    again = get_driver("qemu", driver.home, IMAGES_DIR)
    assert [(v.sandbox_id, v.status, v.pid) for v in again.list()] == [(info.sandbox_id, "saved", 0)]

    resumed = again.resume(info.sandbox_id)
    print(f"resume (cold boot): {resumed.timings}")
    assert resumed.status == "running" and resumed.envd_port == port and resumed.pid > 0
    assert resumed.timings["cold_boot"] == 1
    assert sh(port, "cat /home/user/note.txt").strip() == "hello"
    assert sh(port, "md5sum -c /home/user/big.md5 >/dev/null && echo ok").strip() == "ok"
    assert guest_pids(port, "slee[p] 100000") == []  # processes are gone

    # Layers: a snapshot's chain boots a new VM that sees the files; its writes stay its own.
    sh(port, "echo layered > /home/user/layer.txt")  # not synced: snapshot(memory=False) syncs
    manifest = driver.snapshot(info.sandbox_id, tmp_path / "snap", memory=False)
    print(f"snapshot(memory=False): {manifest.timings}")
    assert manifest.memory_file == "" and manifest.device_state_file == ""
    names = {p.name for p in (tmp_path / "snap").iterdir()}
    assert "manifest.json" in names and all(n.startswith("layer-") for n in names - {"manifest.json"}), names
    assert manifest.timings["memory_copy_ms"] < 5 and driver.info(info.sandbox_id).status == "running"
    child = driver.boot(BootSpec("fs-2", cpu_count=1, memory_mb=256, layers=manifest.layers))
    try:
        print(f"boot over layers: {child.timings}")
        assert child.envd_port != port
        assert sh(child.envd_port, "cat /home/user/layer.txt /home/user/note.txt").split() == ["layered", "hello"]
        sh(child.envd_port, "echo mine > /home/user/child-only.txt && sync")
        assert not exists(port, "/home/user/child-only.txt")
        # The chain stays read-only: pausing and resuming the child leaves its layers untouched.
        before = [os.stat(p).st_mtime_ns for p in manifest.layers]
        driver.pause_to_disk(child.sandbox_id, memory=False)
        driver.resume(child.sandbox_id)
        assert exists(child.envd_port, "/home/user/child-only.txt")
        assert [os.stat(p).st_mtime_ns for p in manifest.layers] == before
    finally:
        assert driver.kill(child.sandbox_id)
    assert_gone(driver, child)

    driver.pause_to_disk(info.sandbox_id, memory=False)
    assert driver.kill(info.sandbox_id)
    assert_gone(driver, info)
    assert list((driver.home / "locks").iterdir()) == []  # lock files go with their VMs
    with pytest.raises(VMError):
        driver.boot(BootSpec("fs-3", layers=[str(tmp_path / "missing.qcow2")]))


def test_resume_without_memory_reboots_on_the_disk(driver):
    """resume(memory=False) after a pause to disk (E2B's on_resume="reboot"): the memory
    snapshot is discarded, the VM cold-boots on its disk with the same id and port; files
    the guest had synced are there, processes are not, and no RAM or device state is left."""
    info = driver.boot(BootSpec("fs-reboot", cpu_count=1, memory_mb=256))
    port = info.envd_port
    sh(port, "echo kept > /home/user/synced.txt && sync")
    sh(port, "setsid nohup sleep 100001 >/dev/null 2>&1 </dev/null &")
    assert guest_pids(port, "slee[p] 100001")
    driver.pause_to_disk(info.sandbox_id)
    state_dir = driver.sandboxes_dir / info.sandbox_id
    assert (state_dir / "device.state").exists()
    resumed = driver.resume(info.sandbox_id, memory=False)
    assert resumed.timings.get("cold_boot") == 1
    assert resumed.envd_port == port and resumed.status == "running"
    assert sh(port, "cat /home/user/synced.txt").strip() == "kept"
    assert guest_pids(port, "slee[p] 100001") == []
    assert not (state_dir / "device.state").exists()
    driver.kill(info.sandbox_id)
    assert not state_dir.exists()
    assert not list(Path(driver.shm_dir).glob(f"aenv-{info.sandbox_id}*"))
