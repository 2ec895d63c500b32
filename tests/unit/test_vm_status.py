"""The VM lifecycle status table (vmm.vm_status): every legal move is allowed, every other
pair raises IllegalVmTransition, records change their status only through move(), and the
values on disk are the ones older vm.json files hold."""

import itertools
import json
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from vmm.driver import BootSpec, VMError, VMStatus
from vmm.fake import FakeDriver
from vmm.qemu.state import VMState
from vmm.vm_status import OFFLINE, TRANSITIONS, IllegalVmTransition, MovesByTable, VmLifecycle

L = VmLifecycle
ALL_PAIRS = list(itertools.product(L, L))
LEGAL = [(a, b) for a, b in ALL_PAIRS if b in TRANSITIONS[a]]
ILLEGAL = [(a, b) for a, b in ALL_PAIRS if b not in TRANSITIONS[a]]


def test_the_table_covers_every_status_and_names_only_statuses():
    assert set(TRANSITIONS) == set(L)
    assert all(isinstance(b, L) for targets in TRANSITIONS.values() for b in targets)


def test_the_table_is_the_one_the_drivers_rely_on():
    assert {(a.value, b.value) for a, b in LEGAL} == {
        ("running", "running"), ("running", "paused"), ("running", "paused_disk"), ("running", "paused_fs"),
        ("paused", "running"), ("paused", "paused"), ("paused", "paused_disk"), ("paused", "paused_fs"),
        ("paused_disk", "running"), ("paused_disk", "paused_fs"),
        ("paused_fs", "running"),
    }


@pytest.mark.parametrize(("current", "new"), LEGAL, ids=[f"{a.value}->{b.value}" for a, b in LEGAL])
def test_every_legal_move(current, new):
    assert current.can(new)
    assert current.to(new) is new
    rec = Record(current)
    rec.move(new)
    assert rec.status is new


@pytest.mark.parametrize(("current", "new"), ILLEGAL, ids=[f"{a.value}->{b.value}" for a, b in ILLEGAL])
def test_every_illegal_move_raises(current, new):
    assert not current.can(new)
    with pytest.raises(IllegalVmTransition) as e:
        current.to(new)
    assert (e.value.current, e.value.new) == (current, new)
    assert isinstance(e.value, VMError)  # callers see a failed verb, not a crash
    assert f"{current.value} -> {new.value}" in str(e.value)
    rec = Record(current)
    with pytest.raises(IllegalVmTransition):
        rec.move(new)
    assert rec.status is current  # nothing recorded


def test_there_are_illegal_moves_at_all():
    assert {(a.value, b.value) for a, b in ILLEGAL} == {
        ("paused_disk", "paused"), ("paused_disk", "paused_disk"),
        ("paused_fs", "paused"), ("paused_fs", "paused_disk"), ("paused_fs", "paused_fs"),
    }


def test_unknown_statuses_are_refused():
    with pytest.raises(ValueError):
        L.RUNNING.to("booting")
    with pytest.raises(ValueError):
        L("stopped")


def test_offline_and_reported():
    assert OFFLINE == {L.PAUSED_DISK, L.PAUSED_FS}
    assert [s for s in L if s.offline] == [L.PAUSED_DISK, L.PAUSED_FS]
    assert {s: s.reported for s in L} == {L.RUNNING: VMStatus.RUNNING, L.PAUSED: VMStatus.PAUSED,
                                          L.PAUSED_DISK: VMStatus.SAVED, L.PAUSED_FS: VMStatus.SAVED}


@dataclass
class Record(MovesByTable):
    status: VmLifecycle


def test_a_record_status_changes_only_through_move():
    rec = Record(L.RUNNING)
    with pytest.raises(AttributeError):
        rec.status = L.PAUSED
    assert rec.status is L.RUNNING


# -- vm.json: the values on disk stay the old strings ----------------------------------------

def vm_state(tmp_path, **extra) -> VMState:
    d = tmp_path / "sbx"
    d.mkdir(exist_ok=True)
    return VMState(sandbox_id="sbx", pid=0, accel="tcg", host_address="127.0.0.1", host_port=1, state_dir=str(d),
                   top="", qmp="", console="", pidfile="", ram="", image="base", image_dir="", kernel="", initrd="",
                   rootfs="", tools="", cpu_count=1, memory_mb=1, disk_size_mb=1, argv=[], created_at=time.time(),
                   **extra)


@pytest.mark.parametrize("value", ["running", "paused", "paused_disk", "paused_fs"])
def test_old_vm_json_values_load_as_the_enum_and_are_written_back_unchanged(tmp_path, value):
    s = vm_state(tmp_path)
    s.save()
    path = Path(s.state_dir) / "vm.json"
    data = json.loads(path.read_text())
    data["status"] = value  # as the old code wrote it
    path.write_text(json.dumps(data))
    loaded = VMState.load(Path(s.state_dir))
    assert loaded.status is L(value)
    loaded.save()
    assert json.loads(path.read_text())["status"] == value


def test_a_record_without_status_is_running(tmp_path):
    s = vm_state(tmp_path)
    s.save()
    path = Path(s.state_dir) / "vm.json"
    data = json.loads(path.read_text())
    del data["status"]
    path.write_text(json.dumps(data))
    assert VMState.load(Path(s.state_dir)).status is L.RUNNING


def test_vm_state_moves_by_the_table(tmp_path):
    s = vm_state(tmp_path)
    assert s.status is L.RUNNING
    with pytest.raises(AttributeError):
        s.status = L.PAUSED
    s.move(L.PAUSED_FS)
    with pytest.raises(IllegalVmTransition):
        s.move(L.PAUSED)
    assert s.status is L.PAUSED_FS
    s.move(L.RUNNING)
    assert s.status is L.RUNNING


def test_a_constructed_vm_state_takes_the_old_strings(tmp_path):
    assert vm_state(tmp_path, status="paused_disk").status is L.PAUSED_DISK


# -- the fake driver records its VMs' status by the same table --------------------------------

def test_the_fake_driver_moves_by_the_table(tmp_path):
    d = FakeDriver(tmp_path)
    d.boot(BootSpec("a"))
    assert d.vms["a"].status is L.RUNNING
    d.pause_to_disk("a", memory=False)
    assert d.vms["a"].status is L.PAUSED_FS and d.inspect("a").status is VMStatus.SAVED
    with pytest.raises(AttributeError):
        d.vms["a"].status = L.PAUSED
    with pytest.raises(VMError):
        d.pause("a")  # the verb's own refusal, before the table
    d.resume("a")
    assert d.vms["a"].status is L.RUNNING
    d.crash("a")
    assert d.inspect("a").status is VMStatus.STOPPED and d.vms["a"].status is L.RUNNING
