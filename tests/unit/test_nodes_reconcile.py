"""nodes.reconcile with a fake driver: rows a dead worker left mid-operation settle to
the VM's real state, settled rows are checked at start, VMs of dead rows are removed,
and every change is conditional with a reconcile event by the node."""
from datetime import timedelta
from types import SimpleNamespace

import pytest
from django.utils import timezone

from nodes import reconcile
from nodes.models import Node
from sandboxes.models import Sandbox, SandboxEvent, Team, Template

pytestmark = pytest.mark.django_db(transaction=True)


class FakeDriver:
    """VMs by id: "running", "paused" (in memory) or "paused_disk"."""

    sandboxes_dir = None

    def __init__(self, **vms):
        self.vms = dict(vms)
        self.calls = []

    def info(self, sid):
        status = self.vms.get(sid)
        if status is None:
            return None
        return SimpleNamespace(sandbox_id=sid, status="running" if status == "running" else "paused",
                               envd_host="127.0.0.1", envd_port=40100)

    def list(self):
        return [self.info(s) for s in self.vms]

    def resume(self, sid):
        self.calls.append(("resume", sid))
        self.vms[sid] = "running"
        return self.info(sid)

    def pause_to_disk(self, sid):
        self.calls.append(("pause_to_disk", sid))
        self.vms[sid] = "paused_disk"
        return {}

    def kill(self, sid):
        self.calls.append(("kill", sid))
        return self.vms.pop(sid, None) is not None


@pytest.fixture
def fake(monkeypatch):
    driver = FakeDriver()
    monkeypatch.setattr(reconcile, "_vm_record",
                        lambda d, sid: SimpleNamespace(status=d.vms[sid]) if sid in d.vms else None)
    monkeypatch.setattr(reconcile, "_stop_stray_process", lambda record: False)
    inits = []
    monkeypatch.setattr(reconcile, "_reinit_envd", lambda row, info: inits.append(row.pk))
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
            driver.vms[sb.pk] = vm
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
    saved = make("pausing", "paused_disk", fake)
    mid = make("pausing", "running", fake)  # the worker died before QEMU saved anything
    _run(fake)
    assert _state(saved) == "paused" and _reconcile_events(saved) == [("pausing", "paused", "node:n1")]
    assert _state(mid) == "running" and ("resume", mid.pk) in fake.calls and fake.inits == [mid.pk]
    assert Sandbox.objects.get(pk=mid.pk).envd_port == 40100


def test_unacknowledged_resume_stays_paused(fake, make):
    ran = make("resuming", "running", fake)
    not_yet = make("resuming", "paused_disk", fake)
    _run(fake)
    assert _state(ran) == "paused" and fake.vms[ran.pk] == "paused_disk"
    assert _state(not_yet) == "paused" and ("pause_to_disk", not_yet.pk) not in fake.calls


def test_abandoned_create_and_kill(fake, make):
    creating = make("creating", "running", fake)
    killing = make("killing", "paused_disk", fake)
    _run(fake)
    assert _state(creating) == "error" and creating.pk not in fake.vms
    assert "restarted" in Sandbox.objects.get(pk=creating.pk).error_reason
    row = Sandbox.objects.get(pk=killing.pk)
    assert row.state == "killed" and row.killed_at is not None and killing.pk not in fake.vms


def test_settled_rows_only_at_start(fake, make):
    lost = make("running")  # its VM is gone
    stale_running = make("running", "paused_disk", fake)
    woke = make("paused", "running", fake)
    fine = make("running", "running", fake)
    _run(fake, settled=False)
    assert (_state(lost), _state(stale_running), _state(woke)) == ("running", "running", "paused")
    assert fake.calls == []
    _run(fake, settled=True)
    assert _state(lost) == "error" and "VM lost" in Sandbox.objects.get(pk=lost.pk).error_reason
    assert _state(stale_running) == "paused"
    assert _state(woke) == "paused" and fake.vms[woke.pk] == "paused_disk"
    assert _state(fine) == "running" and _reconcile_events(fine) == []


def test_vm_of_a_killed_sandbox_is_removed(fake, make, tmp_path):
    dead = make("killed", "running", fake)
    fake.sandboxes_dir = tmp_path
    (tmp_path / dead.pk).mkdir()
    _run(fake)
    assert ("kill", dead.pk) in fake.calls and dead.pk not in fake.vms
    assert _state(dead) == "killed"


def test_leftover_dir_of_a_failed_create_is_removed(fake, make, tmp_path):
    failed = make("error")  # the driver has no record of it, only a directory
    fake.sandboxes_dir = tmp_path
    (tmp_path / failed.pk).mkdir()
    _run(fake, settled=False)
    assert ("kill", failed.pk) in fake.calls and _state(failed) == "error"


def test_rows_changed_after_the_cutoff_are_left_alone(fake, make):
    sb = make("pausing", "paused_disk", fake)
    _run(fake, older_than=timezone.now() - timedelta(minutes=1))
    assert _state(sb) == "pausing" and fake.calls == []


def test_other_nodes_rows_are_not_touched(fake, make):
    Node.objects.create(id="n2", address="x")
    sb = make("pausing", "paused_disk", fake, node="n2")
    _run(fake)
    assert _state(sb) == "pausing"


def test_a_failing_sandbox_does_not_stop_the_others(fake, make, monkeypatch):
    bad = make("pausing", "running", fake)
    good = make("resuming", "paused_disk", fake)

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
    assert ("resume", fork.pk) in fake.calls and fake.vms[fork.pk] == "running"
    assert {d[0] for d in done} >= {snap.pk, fork.pk}
