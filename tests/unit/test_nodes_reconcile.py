"""agent.reconcile with a fake driver: rows a dead worker left mid-operation settle to
the VM's real state, settled rows are checked at start, VMs of dead rows are removed,
and every change is conditional with a reconcile event by the node."""
from datetime import timedelta

import pytest
from django.utils import timezone

from agent import reconcile, settle
from nodes.models import Node
from sandboxes.models import Sandbox, SandboxEvent, Team, Template
from vmm.driver import BootSpec
from vmm.fake import FakeDriver

pytestmark = pytest.mark.django_db(transaction=True)


class RecordingDriver(FakeDriver):
    """vmm's in-memory driver (the one the driver contract checks), recording the verbs
    reconcile sends. ``put(id, status)`` makes a VM in that state."""

    def __init__(self):
        super().__init__()
        self.calls = []
        self.net._ports = iter(range(41000, 42000))  # not the rows' 40000: a moved port shows

    def put(self, sid, status):
        FakeDriver.boot(self, BootSpec(sid, cpu_count=1, memory_mb=256))
        if status == "paused":
            FakeDriver.pause(self, sid)
        elif status == "saved":
            FakeDriver.pause_to_disk(self, sid)
        elif status == "stopped":
            self.crash(sid)

    def status(self, sid):
        return self.inspect(sid).status

    def resume(self, sid, memory=True):
        self.calls.append(("resume", sid))
        return super().resume(sid, memory)

    def pause_to_disk(self, sid, memory=True):
        self.calls.append(("pause_to_disk", sid))
        return super().pause_to_disk(sid, memory)

    def kill(self, sid):
        self.calls.append(("kill", sid))
        return super().kill(sid)


@pytest.fixture
def fake(monkeypatch):
    driver = RecordingDriver()
    inits = []
    monkeypatch.setattr(settle, "init_envd", lambda host, port, env_vars, token: inits.append((host, port)))
    driver.inits = inits
    return driver


@pytest.fixture
def make(db):
    team = Team.objects.create(name="t", slug="t")
    tpl = Template.objects.create(id="base")
    Node.objects.create(id="n1", address="127.0.0.1", last_heartbeat_at=timezone.now())

    def _make(state, vm=None, driver=None, node="n1"):
        sb = Sandbox.objects.create(team=team, template=tpl, state=state, node_id=node, envd_host="127.0.0.1",
                                    envd_port=40000, end_at=timezone.now() + timedelta(minutes=5))
        if vm is not None:
            driver.put(sb.pk, vm)
        return sb

    return _make


def _run(driver, settled=True, older_than=None):
    return reconcile.reconcile_node("n1", driver, settled=settled,
                                    older_than=older_than or timezone.now() + timedelta(seconds=1))


def _state(sb):
    return Sandbox.objects.get(pk=sb.pk).state


def _reconcile_events(sb):
    return list(SandboxEvent.objects.filter(sandbox_id=sb.pk, operation="reconcile")
                .values_list("from_state", "to_state", "actor"))


def test_interrupted_pause_settles_to_the_vm(fake, make):
    saved = make("pausing", "saved", fake)
    mid = make("pausing", "running", fake)  # the worker died before QEMU saved anything
    _run(fake)
    assert _state(saved) == "paused" and _reconcile_events(saved) == [("pausing", "paused", "node:n1")]
    assert _state(mid) == "running" and ("resume", mid.pk) in fake.calls and len(fake.inits) == 1
    assert Sandbox.objects.get(pk=mid.pk).envd_port == fake.info(mid.pk).envd_port >= 41000


def test_unacknowledged_resume_stays_paused(fake, make):
    ran = make("resuming", "running", fake)
    not_yet = make("resuming", "saved", fake)
    _run(fake)
    assert _state(ran) == "paused" and fake.status(ran.pk) == "saved"
    assert _state(not_yet) == "paused" and ("pause_to_disk", not_yet.pk) not in fake.calls


def test_abandoned_create_and_kill(fake, make):
    creating = make("creating", "running", fake)
    killing = make("killing", "saved", fake)
    _run(fake)
    assert _state(creating) == "error" and creating.pk not in fake.vms
    assert "restarted" in Sandbox.objects.get(pk=creating.pk).error_reason
    row = Sandbox.objects.get(pk=killing.pk)
    assert row.state == "killed" and row.killed_at is not None and killing.pk not in fake.vms


def test_settled_rows_only_at_start(fake, make):
    lost = make("running")  # its VM is gone
    stale_running = make("running", "saved", fake)
    woke = make("paused", "running", fake)
    fine = make("running", "running", fake)
    _run(fake, settled=False)
    assert (_state(lost), _state(stale_running), _state(woke)) == ("running", "running", "paused")
    assert fake.calls == []
    _run(fake, settled=True)
    assert _state(lost) == "error" and "VM lost" in Sandbox.objects.get(pk=lost.pk).error_reason
    assert _state(stale_running) == "paused"
    assert _state(woke) == "paused" and fake.status(woke.pk) == "saved"
    assert _state(fine) == "running" and _reconcile_events(fine) == []


def test_vm_of_a_killed_sandbox_is_removed(fake, make):
    dead = make("killed", "running", fake)
    _run(fake)
    assert ("kill", dead.pk) in fake.calls and dead.pk not in fake.vms
    assert _state(dead) == "killed"


def test_leftover_dir_of_a_failed_create_is_removed(fake, make):
    failed = make("error", "stopped", fake)  # what a boot cut off early left: it cannot run
    _run(fake, settled=False)
    assert ("kill", failed.pk) in fake.calls and _state(failed) == "error"


def test_rows_changed_after_the_cutoff_are_left_alone(fake, make):
    sb = make("pausing", "saved", fake)
    _run(fake, older_than=timezone.now() - timedelta(minutes=1))
    assert _state(sb) == "pausing" and fake.calls == []


def test_other_nodes_rows_are_not_touched(fake, make):
    Node.objects.create(id="n2", address="x")
    sb = make("pausing", "saved", fake, node="n2")
    _run(fake)
    assert _state(sb) == "pausing"


def test_a_failing_sandbox_does_not_stop_the_others(fake, make, monkeypatch):
    bad = make("pausing", "running", fake)
    good = make("resuming", "saved", fake)

    def broken_resume(sid):
        raise RuntimeError("qmp gone")

    monkeypatch.setattr(fake, "resume", broken_resume)
    done = dict((sid, what) for sid, _, what in _run(fake))
    assert done[bad.pk].startswith("failed") and _state(bad) == "pausing"
    assert _state(good) == "paused"



def test_interrupted_snapshot_or_fork_is_handed_to_snapshots_reconcile(fake, make):
    snap = make("snapshotting", "running", fake)
    fork = make("forking", "paused", fake)  # stopped in memory for the capture
    done = _run(fake)
    assert _state(snap) == "running" and _state(fork) == "running"
    assert ("resume", fork.pk) in fake.calls and fake.status(fork.pk) == "running"
    assert {d[0] for d in done} >= {snap.pk, fork.pk}


def test_a_process_left_after_a_save_is_stopped_by_the_driver(fake, make):
    sb = make("paused", "saved", fake)
    fake.leave_process(sb.pk)  # the worker died between the save and the process's exit
    done = _run(fake)
    assert (sb.pk, "paused", "stray stopped") in done and fake.stray() == []
    assert _state(sb) == "paused" and fake.status(sb.pk) == "saved"
    event = SandboxEvent.objects.get(sandbox_id=sb.pk, operation="reconcile")
    assert event.details == {"vm": "saved", "stray_process_stopped": True}


@pytest.mark.parametrize("state, verb", [("creating", "kill"), ("resuming", "pause_to_disk")])
def test_a_row_whose_operation_ended_while_the_pass_ran_is_left_alone(fake, make, monkeypatch, state, verb):
    """The pass lists its rows, then acts on one after another (seconds each under load): a
    sandbox whose create or resume finished meanwhile is running, and its VM stays (the chaos
    bench with 20 clients: the listed copy's "creating" killed a running sandbox's VM)."""
    a, b = make(state, "running", fake), make(state, "running", fake)
    acted = []
    original = getattr(fake, verb)

    def act_and_finish_the_other(sid, *args, **kwargs):
        if not acted:  # while the first is handled, the other's operation ends
            other = b.pk if sid == a.pk else a.pk
            Sandbox.objects.filter(pk=other).update(state="running", updated_at=timezone.now())
        acted.append(sid)
        return original(sid, *args, **kwargs)

    monkeypatch.setattr(fake, verb, act_and_finish_the_other)
    _run(fake)
    first = acted[0]
    other = b if first == a.pk else a
    assert acted == [first], f"{verb} reached the sandbox that was running by then"
    assert _state(other) == "running" and fake.status(other.pk) == "running"
    assert _reconcile_events(other) == []
