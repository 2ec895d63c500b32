"""The live capture's pure parts (vmm.qemu.live_capture, vmm.qemu.uffd; the real captures are
in tests/vmm/test_capture_vm.py): the vessel's command line, the vCPU stop read from QEMU's
events, which way a capture takes, and the kernel probe."""

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from vmm.driver import VMError
from vmm.net import ENVD_PORT, Attachment
from vmm.qemu import live_capture, snapshots, uffd
from vmm.qemu.cmdline import VMPaths, qemu_command


def source_argv(backend="slirp", share=True):
    paths = VMPaths.for_sandbox(Path("/h/sandboxes/sb1"), "sb1")
    network = (Attachment("slirp", "sb1", "127.0.0.1", {ENVD_PORT: 41234, 8080: 41235}) if backend == "slirp"
               else Attachment("netns", "sb1", "10.0.0.2", {}, slot=3))
    return qemu_command(paths=paths, kernel=Path("/img/vmlinuz"), initrd=Path("/img/initrd"),
                        tools=Path("/img/tools.img"), accel="tcg", cpu_count=1, memory_mb=256,
                        network=network, tsc_khz=2445406, ram_share=share, incoming=True)


def opt(argv, flag):
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def vessel(argv):
    return live_capture.vessel_argv(argv, ram=Path("/dev/shm/cap.ram"), qmp=Path("/w/qmp.sock"),
                                    console=Path("/w/console.log"), disk_bytes=5 << 30, tools_bytes=1 << 20)


def test_vessel_has_the_capture_as_its_shared_ram_and_files_of_its_own():
    v = vessel(source_argv(share=False))
    assert opt(v, "-object") == ["memory-backend-file,id=ram0,size=256M,mem-path=/dev/shm/cap.ram,share=on"]
    assert opt(v, "-qmp") == ["unix:/w/qmp.sock,server=on,wait=off"]
    assert opt(v, "-serial") == ["file:/w/console.log"]
    assert "-daemonize" not in v and "-pidfile" not in v
    assert opt(v, "-incoming") == ["defer"] and "-S" in v


def test_vessel_disks_are_null_devices_of_the_same_sizes():
    v = vessel(source_argv())
    blockdevs = opt(v, "-blockdev")
    assert "driver=null-co,node-name=rootfile,size=5368709120" in blockdevs
    assert "driver=raw,node-name=root,file=rootfile" in blockdevs
    assert "driver=null-co,node-name=toolsfile,size=1048576,read-only=on" in blockdevs
    assert not [b for b in blockdevs if "filename=" in b]  # never the parent's disk files
    assert opt(v, "-device") == opt(source_argv(), "-device")  # the same devices, same ids


def test_vessel_network_keeps_its_kind_without_forwards():
    assert opt(vessel(source_argv("slirp")), "-netdev") == ["user,id=net0,restrict=on"]
    tap = opt(source_argv("netns"), "-netdev")
    assert opt(vessel(source_argv("netns")), "-netdev") == tap  # made anew in a netns of its own


def ev(name, t):
    return {"event": name, "timestamp": {"seconds": int(t), "microseconds": round((t % 1) * 1e6)}}


def test_stopped_ms_from_the_last_stop_to_its_resume():
    events = [ev("STOP", 10.0), ev("RESUME", 10.5), ev("MIGRATION", 11.0), ev("STOP", 12.25), ev("RESUME", 12.2625)]
    assert live_capture.stopped_ms(events) == pytest.approx(12.5, abs=0.01)
    assert live_capture.stopped_ms([ev("STOP", 1.0)]) is None
    assert live_capture.stopped_ms([]) is None


class FakeDriver(snapshots.SnapshotMixin):
    shm_dir = Path("/dev/shm")

    def __init__(self, version="QEMU emulator version 7.2.22 (Debian 1:7.2+dfsg-7+deb12u18+b3)"):
        self.version = version

    def _qemu_version(self, state=None, *, required=False):
        return self.version


def vm(accel="tcg", share=True):
    return SimpleNamespace(ram_share=share, accel=accel, qemu="qemu-system-x86_64", sandbox_id="sb1")


@pytest.mark.parametrize("mode,uffd_ok,accel,want", [
    ("auto", True, "tcg", "background"),  # QEMU 7.2 under TCG: pre-copy unsafe
    ("auto", True, "kvm", "pre-copy"),  # where pre-copy is safe it comes first: a shorter stop
    ("auto", False, "tcg", "stop-copy"),  # pre-copy is not safe under TCG before QEMU 9.0
    ("auto", False, "kvm", "pre-copy"),
    ("pre-copy", True, "kvm", "pre-copy"),
    ("pre-copy", True, "tcg", "background"),  # refused here (a warning): the safe live way
    ("pre-copy", False, "tcg", "stop-copy"),
    ("background", True, "tcg", "background"),
    ("background", False, "kvm", "stop-copy"),  # the kernel refuses: today's way
    ("stop-copy", True, "kvm", "stop-copy"),
])
def test_capture_how(monkeypatch, mode, uffd_ok, accel, want):
    monkeypatch.setattr(uffd, "tmpfs_write_protect", lambda shm_dir: uffd_ok)
    d = FakeDriver()
    d.capture_mode = mode
    assert d._capture_how(vm(accel)) == want


def test_a_copy_on_write_vm_is_captured_stopped(monkeypatch):
    monkeypatch.setattr(uffd, "tmpfs_write_protect", lambda shm_dir: True)
    d = FakeDriver()
    for mode, accel in (("auto", "tcg"), ("background", "tcg"), ("auto", "kvm"), ("pre-copy", "kvm")):
        d.capture_mode = mode
        assert d._capture_how(vm(accel, share=False)) == "stop-copy"
    d.capture_mode = "background"
    assert d._capture_how(vm("tcg", share=True)) == "background"


@pytest.mark.parametrize("uffd_ok", [False, True])
def test_precopy_under_tcg_from_qemu_9(monkeypatch, uffd_ok):
    """From QEMU 9.0 "auto" takes pre-copy under TCG too, even where background-snapshot
    works: QEMU 10.0 stopped a 2 GiB guest 9-13 ms that way against 81-130 ms."""
    monkeypatch.setattr(uffd, "tmpfs_write_protect", lambda shm_dir: uffd_ok)
    for version in ("QEMU emulator version 9.2.0", "QEMU emulator version 10.0.2 (Debian 1:10.0.2+ds-2+deb13u1~bpo12+1)"):
        d = FakeDriver(version)
        d.capture_mode = "auto"
        assert d._capture_how(vm("tcg")) == "pre-copy"
        assert d._capture_how(vm("tcg"), for_fork=True) == "stop-copy"


@pytest.mark.parametrize("accel,version,safe", [
    ("kvm", "QEMU emulator version 7.2.22", True), ("tcg", "QEMU emulator version 7.2.22", False),
    ("tcg", "QEMU emulator version 8.2.2 (Debian 1:8.2.2+ds-0ubuntu1)", False),
    ("tcg", "QEMU emulator version 9.0.0", True), ("tcg", "QEMU emulator version 10.1.0", True), ("tcg", "", False),
])
def test_precopy_safe(accel, version, safe):
    assert live_capture.precopy_safe(accel, version) is safe


def test_a_vm_not_running_is_captured_stopped(monkeypatch):
    monkeypatch.setattr(uffd, "tmpfs_write_protect", lambda shm_dir: True)
    d = FakeDriver()
    for mode in ("auto", "pre-copy", "background"):
        d.capture_mode = mode
        assert d._capture_how(vm("kvm"), running=False) == "stop-copy"


def test_unknown_capture_mode_is_refused():
    d = FakeDriver()
    d.capture_mode = "live"
    with pytest.raises(VMError, match="capture mode"):
        d._capture_how(vm())


def test_kernel_probe_answers_for_every_backend():
    found = uffd.probe_all()
    assert found["kernel"]
    kernel = found["userfaultfd"]
    if not kernel["available"]:
        assert kernel["error"] and found["backends"] == []
        return
    kinds = {b["backend"] for b in found["backends"]}
    assert kinds == {"anonymous", "memfd", "tmpfs-file"}
    for b in found["backends"]:
        # a protected write is either caught at the right page and goes through once released,
        # or the probe says why not: never a silent half-answer
        assert b["fault_caught"] or b["error"] or not b["writeprotect_ioctl"], b


def test_tmpfs_probe_matches_the_backend_probe(tmp_path):
    uffd._tmpfs_wp.pop(str(tmp_path), None)
    assert uffd.tmpfs_write_protect(tmp_path) == uffd.probe_backend("tmpfs-file", tmp_path)["fault_caught"]


def test_prefill_allocates_the_holes_and_keeps_the_data():
    shm = Path("/dev/shm")
    ram = shm / f"aenv-test-prefill-{os.getpid()}.ram"
    fd = os.open(ram, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, 8 << 20)
        os.pwrite(fd, b"guest data" * 400, 3 << 20)
        before = os.fstat(fd).st_blocks * 512
        added = live_capture.prefill(ram)
        assert before < 1 << 20 and added == os.fstat(fd).st_blocks * 512 - before
        assert os.fstat(fd).st_blocks * 512 >= 8 << 20  # every page allocated
        assert os.pread(fd, 4000, 3 << 20) == b"guest data" * 400  # what was there stays
        assert os.pread(fd, 4096, 5 << 20) == bytes(4096)
    finally:
        os.close(fd)
        ram.unlink()


def test_a_fork_under_auto_is_captured_stopped_unless_background_is_asked(monkeypatch):
    monkeypatch.setattr(uffd, "tmpfs_write_protect", lambda shm_dir: True)
    d = FakeDriver()
    d.capture_mode = "auto"
    assert d._capture_how(vm("tcg"), for_fork=True) == "stop-copy"
    assert d._capture_how(vm("tcg")) == "background"  # a snapshot still goes live
    d.capture_mode = "background"
    assert d._capture_how(vm("tcg"), for_fork=True) == "background"
