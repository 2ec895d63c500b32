"""Real QEMU microVMs: filesystem-only pause (pause_to_disk(memory=False)) and cold boots over a
given read-only layer chain (BootSpec.layers).

A file written without `sync` sits only in the guest page cache; it must survive the pause (the
driver has envd sync first). A background process must not survive (the resume is a cold boot).
"""

import os
from pathlib import Path

import pytest

from tests.vmm.test_lifecycle_vm import assert_gone, current, exists, real_driver, sh
from tests.vmm.test_qemu_vm import IMAGES_DIR, endpoint, live_qemu_processes
from vmm.driver import BootSpec, BootTimeout, MemoryLost, VMError, get_driver
from vmm.qemu import envd_healthy

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    with real_driver(tmp_path_factory.mktemp("fspause") / "home") as d:
        yield d


def guest_pids(vm, pattern: str) -> list[str]:
    """pids matching a pgrep -f pattern (write it as 'slee[p] 1' so the shell running pgrep does not match);
    vm: an endpoint (host, port) or a VMInfo."""
    return sh(vm, f"pgrep -f '{pattern}' || true").split()


def test_fs_pause_keeps_files_not_processes(driver, tmp_path):
    info = driver.boot(BootSpec("fs-1", cpu_count=1, memory_mb=256))
    ep = endpoint(info)
    # 8 MiB of page cache that no one synced, plus a long-running process.
    sh(ep, "head -c 8388608 /dev/urandom > /home/user/big.bin && md5sum /home/user/big.bin > /home/user/big.md5"
           " && echo hello > /home/user/note.txt")
    sh(ep, "setsid nohup sleep 100000 >/dev/null 2>&1 </dev/null &")
    assert guest_pids(ep, "slee[p] 100000")
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
    assert endpoint(still) == ep  # and still on its network
    assert Path(f"/dev/shm/aenv-{info.sandbox_id}.ram").exists()
    assert not envd_healthy(*ep, timeout=0.5)  # its vCPUs were stopped again
    timings = driver.pause_to_disk(info.sandbox_id, memory=False)
    print(f"\npause_to_disk(memory=False): {timings}")
    assert timings["sync_ms"] >= 0 and timings["total_ms"] > 0
    paused = driver.info(info.sandbox_id)
    assert paused.status == "saved" and paused.pid == 0
    assert driver.inspect(info.sandbox_id).memory is False  # saved without its memory
    assert live_qemu_processes(str(info.state_dir)) == []
    assert not Path(f"/dev/shm/aenv-{info.sandbox_id}.ram").exists()  # the RAM is not kept
    assert not (info.state_dir / "device.state").exists()
    if driver.net.name == "netns":
        assert paused.envd_host == ""  # the slot was given back
    assert not envd_healthy(*ep, timeout=0.5)
    assert driver.pause_to_disk(info.sandbox_id, memory=False) == {}  # idempotent
    with pytest.raises(VMError):
        driver.pause(info.sandbox_id)
    with pytest.raises(VMError):
        driver.pause_to_disk(info.sandbox_id)  # with memory: nothing left to save
    # A restarted worker (new driver object on the same home) sees it paused.
    again = get_driver("qemu", driver.home, IMAGES_DIR)
    assert [(v.sandbox_id, v.status, v.pid) for v in again.list()] == [(info.sandbox_id, "saved", 0)]

    resumed = again.resume(info.sandbox_id)
    print(f"resume (cold boot): {resumed.timings}, envd {endpoint(resumed)} (was {ep})")
    assert resumed.status == "running" and resumed.pid > 0
    assert resumed.timings["cold_boot"] == 1
    # Maybe a new endpoint (netns: a fresh slot): both drivers report the resume's, envd answers there.
    ep = endpoint(resumed)
    assert current(again, info) == current(driver, info) == ep and envd_healthy(*ep)
    assert sh(ep, "cat /home/user/note.txt").strip() == "hello"
    assert sh(ep, "md5sum -c /home/user/big.md5 >/dev/null && echo ok").strip() == "ok"
    assert guest_pids(ep, "slee[p] 100000") == []  # processes are gone

    # Layers: a snapshot's chain boots a new VM that sees the files; its writes stay its own.
    sh(ep, "echo layered > /home/user/layer.txt")  # not synced: snapshot(memory=False) syncs
    manifest = driver.snapshot(info.sandbox_id, tmp_path / "snap", memory=False)
    print(f"snapshot(memory=False): {manifest.timings}")
    assert manifest.memory_file == "" and manifest.device_state_file == ""
    names = {p.name for p in (tmp_path / "snap").iterdir()}
    assert "manifest.json" in names and all(n.startswith("layer-") for n in names - {"manifest.json"}), names
    assert manifest.timings["memory_copy_ms"] < 5 and driver.info(info.sandbox_id).status == "running"
    child = driver.boot(BootSpec("fs-2", cpu_count=1, memory_mb=256, layers=manifest.layers))
    try:
        print(f"boot over layers: {child.timings}")
        assert endpoint(child) != ep and current(driver, info) == ep
        assert sh(child, "cat /home/user/layer.txt /home/user/note.txt").split() == ["layered", "hello"]
        sh(child, "echo mine > /home/user/child-only.txt && sync")
        assert not exists(ep, "/home/user/child-only.txt")
        # The chain stays read-only: pausing and resuming the child leaves its layers untouched.
        before = [os.stat(p).st_mtime_ns for p in manifest.layers]
        driver.pause_to_disk(child.sandbox_id, memory=False)
        back = driver.resume(child.sandbox_id)
        assert back.status == "running" and current(driver, child) == endpoint(back)
        assert exists(back, "/home/user/child-only.txt")
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
    snapshot is discarded, the VM cold-boots on its disk with the same id (and the endpoint the
    resume returns: a fresh slot under netns); files the guest had synced are there, processes
    are not, and no RAM or device state is left."""
    info = driver.boot(BootSpec("fs-reboot", cpu_count=1, memory_mb=256))
    ep = endpoint(info)
    sh(ep, "echo kept > /home/user/synced.txt && sync")
    sh(ep, "setsid nohup sleep 100001 >/dev/null 2>&1 </dev/null &")
    assert guest_pids(ep, "slee[p] 100001")
    driver.pause_to_disk(info.sandbox_id)
    state_dir = driver.sandboxes_dir / info.sandbox_id
    assert (state_dir / "device.state").exists()
    resumed = driver.resume(info.sandbox_id, memory=False)
    assert resumed.timings.get("cold_boot") == 1
    assert resumed.sandbox_id == info.sandbox_id and resumed.status == "running"
    assert current(driver, info) == endpoint(resumed) and envd_healthy(*endpoint(resumed))
    assert sh(resumed, "cat /home/user/synced.txt").strip() == "kept"
    assert guest_pids(resumed, "slee[p] 100001") == []
    assert not (state_dir / "device.state").exists()
    driver.kill(info.sandbox_id)
    assert not state_dir.exists()
    assert not list(Path(driver.shm_dir).glob(f"aenv-{info.sandbox_id}*"))


def test_a_resume_that_fails_after_the_guest_ran_gives_up_the_memory_not_the_disk(driver, monkeypatch):
    """Once a resumed guest runs on its RAM file (still in tmpfs: the pause's copy to disk had not
    happened), the saved device state no longer matches that memory. A resume that fails after
    that (here envd never answers) must not leave the pair to be loaded again (a corrupt guest):
    the memory is given up, the disk kept, and the next resume cold-boots on it."""
    info = driver.boot(BootSpec("fs-ran", cpu_count=1, memory_mb=256))
    sh(endpoint(info), "echo kept > /home/user/synced.txt && sync")
    monkeypatch.setattr(driver, "_spill_later", lambda sandbox_id: None)  # its RAM stays in tmpfs
    driver.pause_to_disk(info.sandbox_id)
    state_dir = driver.sandboxes_dir / info.sandbox_id
    assert (state_dir / "device.state").exists() and driver.inspect(info.sandbox_id).memory is True

    def envd_silent(state, timeout):
        raise BootTimeout(f"sandbox {state.sandbox_id}: no /health (test)")

    monkeypatch.setattr(driver, "_wait_health", envd_silent)
    with pytest.raises(MemoryLost, match="its memory is lost"):
        driver.resume(info.sandbox_id)
    monkeypatch.undo()
    saved = driver.info(info.sandbox_id)
    assert saved.status == "saved" and saved.pid == 0
    assert driver.inspect(info.sandbox_id).memory is False
    assert not (state_dir / "device.state").exists()
    assert live_qemu_processes(str(state_dir)) == []
    assert not list(Path(driver.shm_dir).glob(f"aenv-{info.sandbox_id}*"))
    resumed = driver.resume(info.sandbox_id)
    assert resumed.status == "running" and resumed.timings.get("cold_boot") == 1
    assert sh(resumed, "cat /home/user/synced.txt").strip() == "kept"
    driver.kill(info.sandbox_id)
    assert not state_dir.exists()
