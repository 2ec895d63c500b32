"""A paused VM's RAM moving from tmpfs to disk (vmm.qemu.ram_moves._spill), without QEMU:
the copy runs outside the VM's lock, and becomes the VM's memory only if the VM is still
in the very pause that was copied; otherwise it is dropped and the tmpfs RAM stays."""
import os
import threading
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path

import pytest

from vmm.qemu import ram_moves
from vmm.qemu.ram_moves import RAM_ON_DISK, RamMovesMixin
from vmm.qemu.state import VMState
from vmm.vm_status import VmLifecycle

MiB = 1 << 20


class Node(RamMovesMixin):
    """Just what _spill uses of a QemuDriver: its dirs and a per-VM lock."""

    def __init__(self, home: Path):
        self.sandboxes_dir = home / "sandboxes"
        self.sandboxes_dir.mkdir(parents=True)
        self.vm_lock = threading.Lock()
        self._spill_mutex = threading.Lock()
        self._spill_pool = None
        self._spills = []

    @contextmanager
    def _lock(self, sandbox_id):
        with self.vm_lock:
            yield


def paused_vm(node: Node, shm: Path, sandbox_id="sbx") -> VMState:
    state_dir = node.sandboxes_dir / sandbox_id
    state_dir.mkdir()
    ram = shm / f"aenv-{sandbox_id}.ram"
    with open(ram, "wb") as f:  # 8 MiB, data at two places and holes between
        f.truncate(8 * MiB)
        f.seek(MiB)
        f.write(b"A" * 4096)
        f.seek(6 * MiB)
        f.write(b"B" * MiB)
    (state_dir / "device.state").write_bytes(b"devices")
    defaults = {f.name: "" for f in fields(VMState) if f.type == "str"}
    state = VMState(**{**defaults, "sandbox_id": sandbox_id, "pid": 0, "host_port": 0, "cpu_count": 1,
                       "memory_mb": 8, "disk_size_mb": 0, "argv": [], "created_at": 0.0,
                       "state_dir": str(state_dir), "ram": str(ram), "status": "paused_disk",
                       "device_state": str(state_dir / "device.state")})
    state.save()
    return state


@pytest.fixture
def node(tmp_path):
    return Node(tmp_path / "home")


@pytest.fixture
def shm(tmp_path):
    (tmp_path / "shm").mkdir()
    return tmp_path / "shm"


def test_the_ram_moves_to_disk_sparse_and_the_tmpfs_file_goes(node, shm):
    state = paused_vm(node, shm)
    original = Path(state.ram).read_bytes()
    node._spill("sbx")
    now = VMState.load(Path(state.state_dir))
    on_disk = Path(state.state_dir) / RAM_ON_DISK
    assert now.ram == str(on_disk) and not Path(state.ram).exists()
    assert on_disk.read_bytes() == original
    assert os.stat(on_disk).st_blocks * 512 < 3 * MiB, "the holes were filled"
    assert now.timings["ram_to_disk_mb"] == pytest.approx((4096 + MiB) / MiB, rel=0.5)
    assert list((node.sandboxes_dir.with_name("ram-moves")).iterdir()) == []


def copy_then(action):
    """_copy_synced that runs ``action`` once the copy is written (as if during it)."""
    real = ram_moves._copy_synced

    def copy(src, dst):
        n = real(src, dst)
        action()
        return n
    return copy


def test_the_copy_does_not_hold_the_vms_lock(node, shm, monkeypatch):
    paused_vm(node, shm)
    free = []

    def try_the_lock():
        got = node.vm_lock.acquire(blocking=False)
        free.append(got)
        if got:
            node.vm_lock.release()
    monkeypatch.setattr(ram_moves, "_copy_synced", copy_then(try_the_lock))
    node._spill("sbx")
    assert free == [True], "a resume during the copy would have waited for it"


def test_a_resume_during_the_copy_keeps_its_tmpfs_ram(node, shm, monkeypatch):
    state = paused_vm(node, shm)

    def resume():
        now = VMState.load(Path(state.state_dir))
        now.move(VmLifecycle.RUNNING)
        now.save()
    monkeypatch.setattr(ram_moves, "_copy_synced", copy_then(resume))
    node._spill("sbx")
    now = VMState.load(Path(state.state_dir))
    assert now.ram == state.ram and Path(state.ram).exists()
    assert not (Path(state.state_dir) / RAM_ON_DISK).exists()
    assert list((node.sandboxes_dir.with_name("ram-moves")).iterdir()) == []


def test_a_resume_and_a_new_pause_during_the_copy_drop_the_stale_copy(node, shm, monkeypatch):
    state = paused_vm(node, shm)

    def resume_and_pause_again():  # the guest wrote to its RAM, then a new device state
        with open(state.ram, "r+b") as f:
            f.seek(MiB)
            f.write(b"C" * 4096)
        dev = Path(state.device_state)
        tmp = dev.with_name("device.state.new")
        tmp.write_bytes(b"devices, later")
        os.replace(tmp, dev)
    monkeypatch.setattr(ram_moves, "_copy_synced", copy_then(resume_and_pause_again))
    node._spill("sbx")
    now = VMState.load(Path(state.state_dir))
    assert now.ram == state.ram and Path(state.ram).read_bytes()[MiB:MiB + 4096] == b"C" * 4096
    assert not (Path(state.state_dir) / RAM_ON_DISK).exists()


def test_a_kill_during_the_copy_leaves_nothing(node, shm, monkeypatch):
    state = paused_vm(node, shm)

    def kill():
        for p in Path(state.state_dir).iterdir():
            p.unlink()
        Path(state.state_dir).rmdir()
        Path(state.ram).unlink()
    monkeypatch.setattr(ram_moves, "_copy_synced", copy_then(kill))
    node._spill("sbx")
    assert not Path(state.state_dir).exists()
    assert list((node.sandboxes_dir.with_name("ram-moves")).iterdir()) == []


def test_stale_half_copies_are_removed_fresh_ones_kept(tmp_path):
    old, new = tmp_path / "a.tmp", tmp_path / "b.tmp"
    old.write_bytes(b"x")
    new.write_bytes(b"y")
    os.utime(old, (0, 0))
    ram_moves._remove_stale_copies(tmp_path)
    assert not old.exists() and new.exists()


def test_a_resumed_vms_disk_copy_is_deleted_off_the_resume_path(tmp_path):
    node = Node(tmp_path / "home")
    ram = node.sandboxes_dir / "sbx" / RAM_ON_DISK
    ram.parent.mkdir()
    ram.write_bytes(b"\x01" * MiB)
    node._discard_later(ram)
    assert not ram.exists()  # the name is free at once (the next pause writes it again)
    assert node.settle(timeout=10)
    assert list(node._ram_moves_dir().iterdir()) == []


def test_files_left_being_deleted_go_at_the_next_start_whatever_their_age(tmp_path):
    moves = tmp_path / "ram-moves"
    moves.mkdir()
    (moves / f"memory.ram.abc{ram_moves.DISCARDED}").write_bytes(b"x")
    (moves / "sbx.1-2.tmp").write_bytes(b"x")  # a copy in progress, young: kept
    ram_moves._remove_stale_copies(moves)
    assert [p.name for p in moves.iterdir()] == ["sbx.1-2.tmp"]
