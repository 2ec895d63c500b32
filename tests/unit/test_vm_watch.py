"""agent.vm_watch with vmm's fake driver: a running sandbox whose VM died or whose guest's disk
requests failed becomes error (reason, reconcile event) and its VM is removed; the reason names
the snapshot store when the VM reads a lazy mount whose reads failed; healthy, recently changed,
paused and other nodes' sandboxes are left alone, and an operation that started meanwhile wins.
(The signals themselves on a real VM: tests/vmm/test_lazy_restore_vm.py.)"""
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from agent import vm_watch
from nodes.models import Node
from sandboxes.models import Sandbox, SandboxEvent, Team, Template
from vmm.driver import BootSpec
from vmm.fake import FakeDriver

pytestmark = pytest.mark.django_db(transaction=True)

LAZY = Path("/srv/aenv/lazy/snapshots")


class Lazy:
    """Stands in for agent.stores.lazy.LazyRestores: its paths and its daemon's mount stats."""

    def __init__(self, errors: dict):
        self.errors = errors

    def path(self, mount_id):
        return LAZY / mount_id

    def running_client(self):
        return self

    def stats(self):
        return {"cache": {}, "mounts": {m: {"errors": n, "reads": 9} for m, n in self.errors.items()}}


@pytest.fixture
def rows(db):
    team = Team.objects.create(name="t", slug="t")
    tpl = Template.objects.create(id="base")
    for node in ("n1", "n2"):
        Node.objects.create(id=node, address="127.0.0.1", last_heartbeat_at=timezone.now())
    driver = FakeDriver()

    def make(state="running", node="n1", age=10.0, uses=()):
        sb = Sandbox.objects.create(team=team, template=tpl, state=state, node_id=node,
                                    end_at=timezone.now() + timedelta(minutes=5))
        driver.boot(BootSpec(sb.pk, cpu_count=1, memory_mb=256))
        driver.vms[sb.pk].uses = tuple(uses)
        Sandbox.objects.filter(pk=sb.pk).update(updated_at=timezone.now() - timedelta(seconds=age))
        return sb.pk

    return driver, make


def _state(sid):
    row = Sandbox.objects.get(pk=sid)
    return row.state, row.error_reason


def test_a_dead_vm_and_a_failing_disk_make_their_sandboxes_error(rows):
    driver, make = rows
    died, failing, healthy = make(), make(), make()
    fresh, paused, elsewhere = make(age=0), make(state="paused"), make(node="n2")
    driver.crash(died)
    driver.fail_disk(failing, 3)
    for sid in (fresh, paused, elsewhere):
        driver.crash(sid)
    done = dict(vm_watch.watch_node("n1", driver))
    assert set(done) == {died, failing}
    state, reason = _state(died)
    assert state == "error" and reason == "VM died: its process exited while the sandbox was running"
    state, reason = _state(failing)
    assert state == "error" and reason.startswith("the guest's disk failed: 3 disk request(s) got an I/O error")
    assert "snapshot store" not in reason  # its files are no lazy mount's
    event = SandboxEvent.objects.get(sandbox_id=failing, operation="reconcile")
    assert (event.from_state, event.to_state, event.actor) == ("running", "error", "node:n1")
    assert event.details == {"vm": "running", "disk_errors": 3}
    assert died not in driver.vms and failing not in driver.vms  # removed
    assert _state(healthy)[0] == "running" and healthy in driver.vms
    assert _state(fresh)[0] == "running"  # changed just now: an operation's
    assert _state(paused)[0] == "paused" and _state(elsewhere)[0] == "running"
    assert vm_watch.watch_node("n1", driver) == []  # once


def test_the_reason_names_the_store_when_the_vms_lazy_mount_failed_reads(rows):
    driver, make = rows
    lazy = Lazy({"pause-a": 2, "pause-b": 0, "other": 5})
    on_a = make(uses=[f"{LAZY}/pause-a/rootfs.qcow2", "/srv/aenv/images/base/vmlinuz"])
    on_b = make(uses=[f"{LAZY}/pause-b/mem.ram"])
    driver.fail_disk(on_a)
    driver.crash(on_b)
    done = dict(vm_watch.watch_node("n1", driver, lazy=lambda: lazy))
    assert done[on_a].endswith("; " + vm_watch.STORE_REASON)
    event = SandboxEvent.objects.get(sandbox_id=on_a, operation="reconcile")
    assert event.details["lazy_read_errors"] == {"pause-a": 2}
    assert done[on_b] == "VM died: its process exited while the sandbox was running"  # its mount read fine


def test_an_operation_that_started_meanwhile_wins(rows, monkeypatch):
    driver, make = rows
    sid = make()
    driver.crash(sid)
    real = vm_watch.failure

    def racing(drv, sandbox_id):
        found = real(drv, sandbox_id)
        Sandbox.objects.filter(pk=sandbox_id).update(state="killing", updated_at=timezone.now())  # an API kill
        return found

    monkeypatch.setattr(vm_watch, "failure", racing)
    assert vm_watch.watch_node("n1", driver) == []
    assert _state(sid)[0] == "killing" and sid in driver.vms  # the kill's to finish


def test_one_failing_look_does_not_stop_the_others(rows, monkeypatch):
    driver, make = rows
    first, second = make(), make()
    driver.crash(first)
    driver.crash(second)
    real = driver.inspect

    def inspect(sandbox_id):
        if sandbox_id == first:
            raise OSError("vm.json unreadable")
        return real(sandbox_id)

    monkeypatch.setattr(driver, "inspect", inspect)
    assert [sid for sid, _ in vm_watch.watch_node("n1", driver)] == [second]


def test_with_suspects_a_failing_disk_waits_one_look_and_a_dead_vm_does_not(rows):
    """The watch's own loop keeps suspects: a guest whose disk failed is made error at the
    second look that sees it failing (its client first gets the I/O error), a dead VM at once;
    a disk that stopped failing in between is forgotten."""
    driver, make = rows
    died, failing = make(), make()
    driver.crash(died)
    driver.fail_disk(failing, 1)
    suspects: set[str] = set()
    assert [sid for sid, _ in vm_watch.watch_node("n1", driver, suspects=suspects)] == [died]
    assert suspects == {failing} and _state(failing)[0] == "running" and failing in driver.vms
    assert [sid for sid, _ in vm_watch.watch_node("n1", driver, suspects=suspects)] == [failing]
    assert _state(failing)[0] == "error" and failing not in driver.vms and suspects == set()
    watch = vm_watch.VmWatch("n1", driver, interval=60)
    other = make()
    driver.fail_disk(other, 2)
    watch.round()
    assert watch.suspects == {other} and _state(other)[0] == "running"
    watch.round()
    assert _state(other)[0] == "error"


def test_a_running_sandbox_with_no_vm_left_on_the_node_is_lost(rows):
    """Nothing of the VM on the node (the chaos bench: a reconcile acting on a stale row
    removed a running sandbox's VM): error with its event at the next look, not running
    with commands that hang until the worker's next start."""
    driver, make = rows
    gone, healthy = make(), make()
    driver.kill(gone)
    done = dict(vm_watch.watch_node("n1", driver))
    assert set(done) == {gone}
    assert _state(gone) == ("error", "VM lost: the node has no VM for this sandbox (it was running)")
    event = SandboxEvent.objects.get(sandbox_id=gone, operation="reconcile")
    assert (event.from_state, event.to_state, event.details) == ("running", "error", {"vm": None})
    assert _state(healthy) == ("running", "")
