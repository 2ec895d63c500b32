"""State dirs: vm.json round trip, liveness, list() and idempotent kill() without real VMs."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from vmm.driver import BootSpec, VMError, get_driver
from vmm.qemu import QemuDriver
from vmm.qemu.state import VMState, process_alive, valid_sandbox_id
from vmm.vm_status import VmLifecycle


def state_for(tmp_path, sid, pid, marker):
    d = tmp_path / "home" / "sandboxes" / sid
    d.mkdir(parents=True)
    s = VMState(sandbox_id=sid, pid=pid, accel="tcg", host_address="127.0.0.1", host_port=41000, state_dir=str(d),
                top=str(d / "top.qcow2"), qmp=marker, console=str(d / "console.log"), pidfile=str(d / "qemu.pid"),
                ram=str(tmp_path / f"aenv-{sid}.ram"), image="base", image_dir="/img", kernel="/img/vmlinuz",
                initrd="/img/initrd.cpio", rootfs="/img/rootfs.qcow2", tools="/img/tools.img", cpu_count=1,
                memory_mb=128, disk_size_mb=2048, argv=["x"], created_at=time.time(), timings={"total_ms": 1.0})
    s.save()
    (d / "qemu.pid").write_text(f"{pid}\n")
    return s


def test_ids():
    assert valid_sandbox_id("sb-1_x.Y")
    for bad in ("", "../x", "a/b", "..", "-x", "x" * 65):
        assert not valid_sandbox_id(bad)


def test_round_trip_and_garbage(tmp_path):
    s = state_for(tmp_path, "a", 1, "m")
    assert VMState.load(Path(s.state_dir)) == s
    (Path(s.state_dir) / "vm.json").write_text("{not json")
    assert VMState.load(Path(s.state_dir)) is None


def test_list_info_kill_with_a_stand_in_process(tmp_path):
    marker = str(tmp_path / "marker-qmp.sock")
    proc = subprocess.Popen([sys.executable, "-c", "import time,sys; time.sleep(60)", marker])
    try:
        driver = QemuDriver(home=tmp_path / "home", images_dir=tmp_path / "images", accel="tcg")
        state_for(tmp_path, "live", proc.pid, marker)
        state_for(tmp_path, "dead", 999999, "nope")
        ram = tmp_path / "aenv-live.ram"
        ram.write_bytes(b"x")
        assert [i.sandbox_id for i in driver.list()] == ["live"]
        info = driver.info("live")
        assert info.envd_port == 41000 and info.pid == proc.pid and info.timings == {"total_ms": 1.0}
        assert driver.info("dead") is None and driver.info("../etc") is None
        assert process_alive(proc.pid, marker) and not process_alive(proc.pid, "other")
        assert driver.kill("live") is True
        proc.wait(timeout=10)  # SIGTERM reached it (no QMP socket)
        assert not (tmp_path / "home/sandboxes/live").exists() and not ram.exists()
        assert driver.kill("live") is False and driver.kill("dead") is True and driver.kill("dead") is False
    finally:
        proc.kill()
        proc.wait()


def test_boot_without_image_raises(tmp_path):
    driver = QemuDriver(home=tmp_path / "home", images_dir=tmp_path / "images", accel="tcg")
    from vmm.driver import ImageNotFound

    with pytest.raises(ImageNotFound):
        driver.boot(BootSpec("x1"))
    with pytest.raises(VMError):
        driver.boot(BootSpec("../x"))


def test_capacity_and_factory(tmp_path):
    driver = get_driver("qemu", tmp_path / "home", tmp_path / "images")
    cap = driver.capacity()
    assert cap["vcpus"] >= 1 and cap["memory_mb"] > 0
    with pytest.raises(VMError):
        get_driver("xen", tmp_path, tmp_path)


def test_firecracker_refuses_clearly(tmp_path):
    with pytest.raises(VMError, match="firecracker"):
        get_driver("firecracker", tmp_path, tmp_path)


def test_failed_boot_retries_once_and_leaves_nothing(tmp_path):
    import json

    from vmm.images import _point

    img = tmp_path / "images" / "base-x"
    img.mkdir(parents=True)
    (img / "image.json").write_text(json.dumps({"name": "base", "recipe_hash": "x"}))
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(img / "rootfs.qcow2"), "64M"], check=True)
    _point(tmp_path / "images", "base", img)
    fake = tmp_path / "fake-qemu"
    fake.write_text("#!/bin/sh\n"
                    "echo started >> %s\necho 'could not set up host forwarding rule' >&2\nexit 1\n"
                    % (tmp_path / "calls"))
    fake.chmod(0o755)
    driver = QemuDriver(home=tmp_path / "home", images_dir=tmp_path / "images", accel="tcg", qemu=str(fake),
                        shm_dir=tmp_path)
    with pytest.raises(VMError, match="forwarding") as err:
        driver.boot(BootSpec("f1", disk_size_mb=128))
    assert "BootTimeout" not in type(err.value).__name__
    assert (tmp_path / "calls").read_text().count("started") == 2  # retried once
    assert list((tmp_path / "home" / "sandboxes").iterdir()) == []


def test_paused_to_disk_is_listed_and_kill_spares_a_snapshot_ram_file(tmp_path):
    """No process after pause_to_disk, yet info/list report it; a restored sandbox's RAM file
    belongs to the snapshot and kill() leaves it; old vm.json records load with defaults."""
    driver = QemuDriver(home=tmp_path / "home", images_dir=tmp_path / "images", accel="tcg")
    s = state_for(tmp_path, "pz", 0, "nope")
    assert VMState.load(Path(s.state_dir)).status == "running"
    s.move(VmLifecycle.PAUSED_DISK)
    s.device_state = str(Path(s.state_dir) / "device.state")
    s.save()
    info = driver.info("pz")
    assert info.status == "saved" and info.pid == 0
    assert driver.inspect("pz").status == "saved" and driver.inspect("restored").status == "unknown"
    assert [i.sandbox_id for i in driver.list()] == ["pz"]
    r = state_for(tmp_path, "restored", 999999, "nope")
    snap_ram = tmp_path / "snap-memory.ram"
    snap_ram.write_bytes(b"x")
    r.ram, r.ram_owned = str(snap_ram), False
    r.save()
    assert driver.kill("restored") is True and snap_ram.exists()
    assert driver.kill("pz") is True and driver.info("pz") is None and driver.list() == []


def test_inspect_leftovers_and_files_in_use_without_real_vms(tmp_path):
    """The verbs reconcile and the snapshot cache use, on records and stand-in processes:
    inspect() statuses, a QEMU left running for a VM saved to disk (found, then stopped by
    gc()), an orphan fork capture, and every path vm.json names as a file in use."""
    marker = str(tmp_path / "marker-qmp.sock")
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", marker]) for _ in range(2)]
    try:
        driver = QemuDriver(home=tmp_path / "home", images_dir=tmp_path / "images", accel="tcg")
        state_for(tmp_path, "live", procs[0].pid, marker)
        state_for(tmp_path, "dead", 999999, "nope")
        saved = state_for(tmp_path, "saved", procs[1].pid, marker)
        saved.move(VmLifecycle.PAUSED_DISK)
        saved.pid, saved.chain = 0, ["/snaps/s1/layer-0.qcow2"]
        saved.capture_ref = str(tmp_path / "home" / "forks" / "used-1")
        saved.save()
        (tmp_path / "home" / "sandboxes" / "cut").mkdir()  # a boot cut off before its record
        for capture in ("used-1", "orphan-2"):
            (tmp_path / "home" / "forks" / capture).mkdir(parents=True)

        status = {sid: driver.inspect(sid).status for sid in ("live", "dead", "saved", "cut", "nobody", "../x")}
        assert status == {"live": "running", "dead": "stopped", "saved": "saved", "cut": "stopped",
                          "nobody": "unknown", "../x": "unknown"}
        assert driver.inspect("live").pid == procs[0].pid and driver.inspect("saved").memory is True
        assert driver.sandbox_ids() == {"live", "dead", "saved", "cut"}
        assert [(x.kind, x.name) for x in driver.stray()] == [("process", "saved"), ("fork capture", "orphan-2")]
        assert driver.stray("live") == [] and len(driver.stray("saved")) == 1
        used = driver.files_in_use()
        assert {"/snaps/s1/layer-0.qcow2", saved.ram, saved.capture_ref, "/img/vmlinuz"} <= used

        assert [(x.kind, x.name) for x in driver.gc()] == [("process", "saved"), ("fork capture", "orphan-2")]
        procs[1].wait(timeout=10)  # the saved VM's leftover process got SIGTERM
        assert driver.stray() == [] and driver.inspect("saved").status == "saved"
        assert (tmp_path / "home" / "forks" / "used-1").exists()
        assert not (tmp_path / "home" / "forks" / "orphan-2").exists()
        assert process_alive(procs[0].pid, marker)  # a running VM is no leftover
    finally:
        for p in procs:
            p.kill()
