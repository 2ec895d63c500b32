"""A pause to disk on a node whose disk is full (the chaos bench's disk row with 20 clients:
three pauses answered 500 OSError ENOSPC, the sandboxes were then "running" with no VM process,
their commands 502 and their forks 500 "paused to disk").

- Before the VM is recorded as saved, a full disk is HostDiskFull (a 503 at the API) and the
  VM runs on: continued, vm.json still saying running, no half-written device state.
- Once it is recorded as saved, the pause has happened: a full disk while giving back its
  network slot or recording its timings is logged, not raised, and the slot stays the VM's
  record (the resume runs in it, a kill frees it)."""
import errno
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vmm.driver import HostDiskFull, VMError
from vmm.qemu import QemuDriver
from vmm.qemu import lifecycle as qemu_lifecycle
from vmm.qemu.lifecycle import disk_full
from vmm.qemu.state import VMState, process_alive
from vmm.vm_status import VmLifecycle


class FakeQMP:
    """QMP to a stand-in process: records the commands; ``quit`` ends the process."""

    def __init__(self, proc, log):
        self.proc, self.log = proc, log

    def __call__(self, *args, **kwargs):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def execute(self, command, **kwargs):
        self.log.append(command)
        if command == "query-status":
            return {"status": "running"}
        if command == "quit":
            self.proc.kill()
            self.proc.wait(timeout=10)
        return {}


class FakeNet:
    def __init__(self):
        self.detached = []

    def attachment_of(self, sandbox_id, slot):
        return ("netns", sandbox_id, slot)

    def detach(self, attachment, state_dir):
        self.detached.append(attachment)

    def check(self, spec):
        pass


@pytest.fixture
def vm(tmp_path, monkeypatch):
    marker = str(tmp_path / "marker-qmp.sock")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", marker])
    end = time.monotonic() + 30  # until it has exec'd (its command line names the marker)
    while not process_alive(proc.pid, marker):
        assert time.monotonic() < end, "the stand-in process did not start"
        time.sleep(0.01)
    d = tmp_path / "home" / "sandboxes" / "full1"
    d.mkdir(parents=True)
    state = VMState(sandbox_id="full1", pid=proc.pid, accel="tcg", host_address="10.0.0.2", host_port=49983,
                    state_dir=str(d), top=str(d / "top.qcow2"), qmp=marker, console=str(d / "console.log"),
                    pidfile=str(d / "qemu.pid"), ram=str(tmp_path / "aenv-full1.ram"), image="base",
                    image_dir="/img", kernel="/img/vmlinuz", initrd="/img/initrd.cpio", rootfs="/img/rootfs.qcow2",
                    tools="/img/tools.img", cpu_count=1, memory_mb=128, disk_size_mb=2048, argv=["x"],
                    created_at=time.time(), net_mode="netns", net_slot=3)
    state.ram_share = True
    state.save()
    driver = QemuDriver(home=tmp_path / "home", images_dir=tmp_path / "images", accel="tcg", shm_dir=tmp_path)
    driver.net = FakeNet()
    commands = []
    monkeypatch.setattr(qemu_lifecycle, "QMP", FakeQMP(proc, commands))
    monkeypatch.setattr(qemu_lifecycle, "migrate_to_file", lambda q, path: Path(path).write_bytes(b"device"))
    monkeypatch.setattr(qemu_lifecycle, "set_ignore_shared", lambda q, on: None)
    monkeypatch.setattr(QemuDriver, "_qemu_version", lambda self, state: "10.0.0")
    monkeypatch.setattr(QemuDriver, "_spill_later", lambda self, sid: None)
    try:
        yield driver, d, commands
    finally:
        proc.kill()
        proc.wait(timeout=10)


def full_disk_after(monkeypatch, saves_ok: int) -> None:
    """vm.json's saves succeed ``saves_ok`` times, then the disk is full."""
    real, calls = VMState.save, []

    def save(self):
        calls.append(1)
        if len(calls) > saves_ok:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self)

    monkeypatch.setattr(VMState, "save", save)


def test_a_full_disk_before_the_save_is_recorded_is_host_disk_full_and_the_vm_runs_on(vm, monkeypatch):
    driver, d, commands = vm
    full_disk_after(monkeypatch, 0)
    with pytest.raises(HostDiskFull, match="no room on the node's disk"):
        driver.pause_to_disk("full1")
    assert commands[-1] == "cont" and "quit" not in commands  # continued, not left stopped
    assert VMState.load(d).status is VmLifecycle.RUNNING
    assert not (d / "device.state").exists()
    assert driver.net.detached == []


def test_a_full_disk_after_the_save_is_recorded_does_not_fail_the_pause(vm, monkeypatch):
    driver, d, commands = vm
    full_disk_after(monkeypatch, 1)  # the save that makes it paused, then nothing
    timings = driver.pause_to_disk("full1")
    assert timings["total_ms"] > 0 and commands[-1] == "quit" and "cont" not in commands
    state = VMState.load(d)
    assert state.status is VmLifecycle.PAUSED_DISK and (d / "device.state").exists()
    # not recorded as given back, so not given back: the record and the slot agree
    assert state.net_slot == 3 and driver.net.detached == []


def test_a_save_that_fails_for_another_reason_still_continues_the_vm(vm, monkeypatch):
    driver, d, commands = vm

    def broken(q, path):
        raise qemu_lifecycle.QMPError("migrate: failed")

    monkeypatch.setattr(qemu_lifecycle, "migrate_to_file", broken)
    with pytest.raises(qemu_lifecycle.QMPError):  # plenty of room: not the disk's fault
        driver.pause_to_disk("full1")
    assert commands[-1] == "cont" and VMState.load(d).status is VmLifecycle.RUNNING


def test_a_resume_whose_slot_cannot_be_recorded_gives_it_back_and_is_host_disk_full(vm, monkeypatch):
    """The chaos bench's disk row after the pause fix: two resumes answered 500 OSError ENOSPC
    and a network slot (netns + nftables table) stayed with no record naming it."""
    from types import SimpleNamespace

    driver, d, commands = vm
    state = VMState.load(d)
    state.move(VmLifecycle.PAUSED_DISK)
    state.device_state, state.net_slot, state.host_address, state.pid = str(d / "device.state"), 0, "", 0
    state.save()
    attached = SimpleNamespace(slot=5, host_address="10.0.0.6")
    driver.net.attach = lambda sid, state_dir, spec: attached
    full_disk_after(monkeypatch, 0)
    with pytest.raises(HostDiskFull, match="stays paused"):
        driver.resume("full1")
    assert driver.net.detached == [attached]  # nothing names the slot: it went back
    after = VMState.load(d)
    assert after.status is VmLifecycle.PAUSED_DISK and after.net_slot == 0


def test_a_restore_whose_record_cannot_be_saved_leaves_nothing_and_is_host_disk_full(tmp_path, monkeypatch):
    """The chaos bench's disk row: a create answered 500 "already exists": the template
    restore's last vm.json save (its pid) failed with ENOSPC after QEMU had started, the VM and
    its state dir stayed, and the node's fallback cold boot found the dir. Now the restore
    removes what it started and says the disk is full (no cold boot: it would not find room)."""
    from types import SimpleNamespace

    from vmm.driver import BootSpec, SnapshotManifest

    driver = QemuDriver(home=tmp_path / "home", images_dir=tmp_path / "images", accel="tcg", shm_dir=tmp_path)
    net = FakeNet()
    network = SimpleNamespace(backend="netns", slot=7, host_address="10.0.0.8", forwards={},
                              host_port=lambda port: port)
    net.attach = lambda sid, state_dir, spec: network
    driver.net = net
    manifest = SnapshotManifest(dir=tmp_path / "snap", layers=[str(tmp_path / "base.qcow2")],
                                memory_file=str(tmp_path / "snap.ram"), device_state_file=str(tmp_path / "dev"),
                                cpu_count=1, memory_mb=128, disk_size_mb=2048,
                                machine={"accel": "tcg", "kernel": "k", "initrd": "i", "tools": "t", "tsc_khz": 0,
                                         "resize": False, "qemu": "qemu-system-x86_64"})
    monkeypatch.setattr(QemuDriver, "check_snapshot", lambda self, m: None)
    monkeypatch.setattr(QemuDriver, "_check_shm", lambda self, mb, sid: None)
    monkeypatch.setattr("vmm.qemu.snapshots.create_top", lambda tops, layer, size, top: Path(top).write_bytes(b"t"))
    stopped = []
    monkeypatch.setattr(QemuDriver, "_stop_process", lambda self, paths: stopped.append(paths.pidfile))

    def spawn(self, state, device_state, before_incoming=None, **kwargs):
        state.pid = 4242  # QEMU runs; vm.json does not say so yet
        return {"total_ms": 1.0}

    monkeypatch.setattr(QemuDriver, "_spawn_incoming", spawn)
    full_disk_after(monkeypatch, 0)
    with pytest.raises(HostDiskFull, match="no room on the node's disk"):
        driver.restore(manifest, BootSpec("rfull"))
    assert stopped and not (tmp_path / "home" / "sandboxes" / "rfull").exists()
    assert net.detached == [network]


@pytest.mark.parametrize("failure", [
    OSError(errno.ENOSPC, "No space left on device"),
    # qemu-img making the parent's new top (vmm.qemu.process.run): a 500 in the chaos run after
    VMError("qemu-img create -q -f qcow2 -u -b /h/sandboxes/p/top.qcow2 -F qcow2 /h/sandboxes/p/top-1.qcow2: "
            "qemu-img: /h/sandboxes/p/top-1.qcow2: Could not create '/h/sandboxes/p/top-1.qcow2': "
            "No space left on device"),
])
def test_a_fork_whose_capture_meets_a_full_disk_is_host_disk_full(tmp_path, monkeypatch, failure):
    """The chaos bench's disk row after the fixes above: a fork answered 500 OSError ENOSPC
    (the capture's write), then 500 VMError (qemu-img's new top); its parent is left as any
    failed capture leaves it, so the answer is the 503 of a node with no room now, and the
    partial capture goes."""
    driver = QemuDriver(home=tmp_path / "home", images_dir=tmp_path / "images", accel="tcg", shm_dir=tmp_path)
    state_dir = tmp_path / "home" / "sandboxes" / "parent1"
    state_dir.mkdir(parents=True)
    VMState(sandbox_id="parent1", pid=0, accel="tcg", host_address="", host_port=0, state_dir=str(state_dir),
            top="", qmp="", console="", pidfile="", ram="", image="base", image_dir="", kernel="", initrd="",
            rootfs="", tools="", cpu_count=1, memory_mb=128, disk_size_mb=2048, argv=[], created_at=time.time(),
            status=VmLifecycle.PAUSED_DISK).save()
    monkeypatch.setattr(QemuDriver, "_load", lambda self, sid: VMState.load(state_dir))

    def capture(self, sid, dest, memory_file=None, for_fork=False):
        Path(dest).mkdir(parents=True)
        (Path(dest) / "layer.qcow2").write_bytes(b"partial")
        raise failure

    monkeypatch.setattr(QemuDriver, "_snapshot", capture)
    with pytest.raises(HostDiskFull, match="not forked"):
        driver.fork("parent1", 1, ["child1"])
    assert not any((tmp_path / "home" / "forks").iterdir())


def test_a_network_update_of_a_saved_vm_on_a_full_disk_is_host_disk_full(vm, monkeypatch):
    """The first step of a resume (agent.tasks.resume_sandbox gives the saved VM its row's
    policy): on a full disk the resume answered 500 OSError ENOSPC. Now a 503, the record as
    it was."""
    from vmm.net.spec import NetworkSpec

    driver, d, commands = vm
    state = VMState.load(d)
    state.move(VmLifecycle.PAUSED_DISK)
    state.net_slot, state.pid = 0, 0
    state.save()
    before = VMState.load(d).network
    full_disk_after(monkeypatch, 0)
    with pytest.raises(HostDiskFull, match="network policy not changed"):
        driver.update_network("full1", NetworkSpec.from_json({"allow_out": ["10.1.0.0/16"]}))
    assert VMState.load(d).network == before


def test_a_tool_that_failed_for_another_reason_is_not_a_full_disk(tmp_path):
    assert disk_full(VMError("qemu-img create ...: Could not open backing file: No such file or directory"),
                     tmp_path) == ""


def test_a_guests_console_saying_no_space_is_not_the_nodes_disk(tmp_path):
    """A boot's error carries the guest's console tail, which the guest writes: its own full
    disk (or a hostile guest) must not make the node answer "no room" or skip its fallback."""
    from vmm.driver import BootTimeout

    err = BootTimeout("envd did not answer", console_tail="dd: error writing '/x': No space left on device")
    assert disk_full(err, tmp_path) == ""


def test_a_tool_that_failed_on_a_nearly_full_disk_is_a_full_disk(tmp_path, monkeypatch):
    """qemu-img rebase -u on a full ext4 (a sparse copy's header cluster cannot be allocated)
    says "No space left in the file header": a fork 500 in the chaos run c20-disk10."""
    from vmm.driver import VMNotFound

    rebase = VMError("qemu-img rebase -u -f qcow2 -F qcow2 -b /i/base.qcow2 /h/forks/x/layer-0.qcow2: qemu-img: "
                     "Could not change the backing file to '/i/base.qcow2': No space left in the file header")
    monkeypatch.setattr(qemu_lifecycle.shutil, "disk_usage", lambda where: shutil_usage(free=1 << 20))
    assert "1 MiB free" in disk_full(rebase, tmp_path)
    assert disk_full(VMNotFound("no VM for sandbox x"), tmp_path) == ""  # a lost VM stays lost
    monkeypatch.setattr(qemu_lifecycle.shutil, "disk_usage", lambda where: shutil_usage(free=10 << 30))
    assert disk_full(rebase, tmp_path) == ""


def shutil_usage(free: int):
    from collections import namedtuple

    return namedtuple("usage", "total used free")(free * 2, free, free)
