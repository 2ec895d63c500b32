"""A device state saved by one QEMU release is refused up front by another (QEMU 7.2 -> 10.0):
snapshots by their manifest's fingerprint, pause-to-disk images by the version in vm.json."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from vmm.driver import SnapshotManifest, SnapshotUnusable, VMError
from vmm.qemu import driver as qemu_driver
from vmm.qemu import process, snapshots
from vmm.qemu.driver import QemuDriver
from vmm.qemu.process import qemu_release, release_mismatch
from vmm.qemu.state import VMState
from vmm.vm_status import VmLifecycle

Q72 = "QEMU emulator version 7.2.22 (Debian 1:7.2+dfsg-7+deb12u18+b3)"
Q72_OTHER_BUILD = "QEMU emulator version 7.2.19 (Debian 1:7.2+dfsg-7+deb12u16)"
Q10 = "QEMU emulator version 10.0.2 (Debian 1:10.0.2+ds-2+deb13u1~bpo12+1)"


@pytest.mark.parametrize("line,want", [
    (Q72, (7, 2)), (Q10, (10, 0)), ("QEMU emulator version 9.2.0", (9, 2)), ("", None), ("qemu, unknown", None),
])
def test_qemu_release(line, want):
    assert qemu_release(line) == want


def test_release_mismatch():
    assert release_mismatch(Q72, Q72_OTHER_BUILD) == ""  # a stable / Debian update of one release
    assert release_mismatch("", Q10) == ""  # unknown: tried as before
    why = release_mismatch(Q72, Q10)
    assert "QEMU emulator version 7.2.22" in why and "QEMU emulator version 10.0.2" in why
    assert "(Debian" not in why


def bare_driver(monkeypatch, tmp_path, version):
    """A QemuDriver without its constructor (no network, no QEMU on PATH needed)."""
    monkeypatch.setattr(snapshots, "qemu_version", lambda qemu: version)
    d = object.__new__(QemuDriver)
    d.qemu = "qemu-system-x86_64"
    d.net = SimpleNamespace(name="slirp")
    d.images_dir = tmp_path
    return d


def manifest(tmp_path, taken_with):
    files = {}
    for name in ("base.qcow2", "vmlinuz", "initrd.cpio", "tools.img"):
        files[name] = tmp_path / name
        files[name].write_bytes(b"")
    base = files["base.qcow2"]
    machine = {"kernel": str(files["vmlinuz"]), "initrd": str(files["initrd.cpio"]), "tools": str(files["tools.img"])}
    fp = {"driver": "qemu", "accel": "tcg", "net": "slirp"}
    if taken_with is not None:
        fp["qemu"] = taken_with
    return SnapshotManifest(dir=tmp_path / "snap", layers=[str(base)], memory_file="", device_state_file="",
                            cpu_count=1, memory_mb=256, disk_size_mb=1024, machine=machine, fingerprint=fp)


def test_a_snapshot_of_another_release_is_unusable(monkeypatch, tmp_path):
    d = bare_driver(monkeypatch, tmp_path, Q10)
    with pytest.raises(SnapshotUnusable, match=r"7\.2\.22 and this node runs QEMU emulator version 10\.0\.2"):
        d.check_snapshot(manifest(tmp_path, Q72))
    d.check_snapshot(manifest(tmp_path, Q10))
    d.check_snapshot(manifest(tmp_path, None))  # an old manifest without the version: tried


def test_another_build_of_the_same_release_restores(monkeypatch, tmp_path):
    d = bare_driver(monkeypatch, tmp_path, Q72)
    d.check_snapshot(manifest(tmp_path, Q72_OTHER_BUILD))


def paused(tmp_path, saved_by):
    state_dir = tmp_path / "sandboxes" / "sb1"
    state_dir.mkdir(parents=True)
    (state_dir / "device.state").write_bytes(b"QEVM")
    fields = dict(sandbox_id="sb1", pid=0, accel="tcg", host_address="127.0.0.1", host_port=0,
                  state_dir=str(state_dir), top=str(state_dir / "top.qcow2"), qmp=str(state_dir / "qmp.sock"),
                  console=str(state_dir / "console.log"), pidfile=str(state_dir / "qemu.pid"),
                  ram=str(tmp_path / "aenv-sb1.ram"), image="base", image_dir="", kernel="", initrd="",
                  rootfs="", tools="", cpu_count=1, memory_mb=256, disk_size_mb=1024, argv=[], created_at=0.0,
                  status=VmLifecycle.PAUSED_DISK, device_state=str(state_dir / "device.state"),
                  device_state_qemu=saved_by)
    return VMState(**fields)


def test_a_pause_image_of_another_release_does_not_start_qemu(monkeypatch, tmp_path):
    d = bare_driver(monkeypatch, tmp_path, Q10)
    spawned = []
    d._spawn_incoming = lambda *a, **kw: spawned.append(a)
    state = paused(tmp_path, Q72)
    with pytest.raises(SnapshotUnusable, match="without its memory"):
        d._resume_incoming(state)
    assert spawned == []
    assert state.device_state_qemu == Q72  # kept: still the same image


def test_a_pause_image_of_this_release_resumes(monkeypatch, tmp_path):
    d = bare_driver(monkeypatch, tmp_path, Q10)
    spawned = []
    d._spawn_incoming = lambda state, device_state, **kw: spawned.append(device_state) or {}
    state = paused(tmp_path, Q10)
    d._resume_incoming(state)
    assert spawned == [Path(tmp_path / "sandboxes" / "sb1" / "device.state")]
    assert state.device_state == "" and state.device_state_qemu == ""


def test_the_version_is_asked_once_per_binary_and_again_when_it_changes(tmp_path):
    """Fingerprints and capture choices ask it on every snapshot: one --version run per
    binary, and a fresh one after a package upgrade replaced the file under a running node."""
    calls = tmp_path / "calls"
    qemu = tmp_path / "qemu-system-x86_64"
    qemu.write_text(f'#!/bin/sh\necho run >> {calls}\necho "QEMU emulator version 7.2.22 (Debian)"\n')
    qemu.chmod(0o755)
    assert process.qemu_version(str(qemu)) == "QEMU emulator version 7.2.22 (Debian)"
    assert process.qemu_version(str(qemu)) == "QEMU emulator version 7.2.22 (Debian)"
    assert calls.read_text().count("run") == 1
    upgraded = tmp_path / "new"
    upgraded.write_text(f'#!/bin/sh\necho run >> {calls}\necho "QEMU emulator version 10.0.2 (Debian)"\n')
    upgraded.chmod(0o755)
    upgraded.replace(qemu)  # as dpkg does: a new file (inode) under the same name
    assert process.qemu_version(str(qemu)) == "QEMU emulator version 10.0.2 (Debian)"
    assert calls.read_text().count("run") == 2


def test_a_fingerprint_needs_the_version_and_says_why_it_has_none(monkeypatch, tmp_path):
    d = bare_driver(monkeypatch, tmp_path, Q10)
    d.qemu = str(tmp_path / "no-such-qemu")
    monkeypatch.setattr(snapshots, "qemu_version", process.qemu_version)
    with pytest.raises(VMError, match="cannot run .*no-such-qemu --version"):
        d._qemu_version(required=True)
    assert d._qemu_version() == ""  # a capture choice only falls back to the safe way
