"""Node-side reconcile: make the database agree with the VMs this node really has.

Why here: only the node can look at its VMs (through its driver's ``inspect()``: no
code here knows a hypervisor's files or processes), and a node worker
that died mid-operation leaves sandboxes in ``pausing`` / ``resuming`` / ``creating`` /
``killing`` with nobody to finish them — the API call that started the operation waits
for a task result that will never come. On start (before consuming tasks) the worker
reconciles every such row; later, a periodic pass picks up rows whose caller gave up
long ago (AENV_RECONCILE_STALE). The VM's real state wins for interrupted operations:

- pausing:  VM saved to disk → ``paused``; VM still running (or stopped mid-save) →
  continued and its envd re-initialised → ``running``;
- resuming: the resume's caller was answered with an error or is gone, so the VM is put
  back to disk if it runs → ``paused`` (a later connect resumes it again);
- creating: the boot was never acknowledged → VM removed, ``error``;
- killing:  VM removed → ``killed``;
- snapshotting / forking (and snapshot records, fork captures): ``agent.reconcile_snapshots``,
  called from here;
- settled rows (startup only): ``running`` whose VM is saved to disk → ``paused``;
  ``paused`` whose VM runs → saved to disk again; a row whose VM is gone → ``error``.
A VM saved to disk never keeps a hypervisor process (a worker killed between the save and
the process's exit leaves one; the driver's ``gc()`` stops it). VMs whose sandbox is killed or failed
(an unconfirmed kill while the node was away) are removed.

Every change is a conditional update on (state, updated_at) with a SandboxEvent
(operation ``reconcile``, actor ``node:<id>``), so an operation that started meanwhile
is never overwritten."""
from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.utils import timezone

from sandboxes.models import Sandbox, SandboxEvent
from sandboxes.states import DEAD, SandboxState
from vmm.driver import VMStatus

from agent.periodic import Periodic
from agent import volumes as guest_volumes
from agent.reconcile_snapshots import reconcile_interrupted
from agent.settle import continue_vm, move

log = logging.getLogger(__name__)

S = SandboxState
TRANSITIONAL = [S.CREATING, S.PAUSING, S.RESUMING, S.KILLING]
SETTLED = [S.RUNNING, S.PAUSED]


def reconcile_sandbox(driver, row: Sandbox, actor: str) -> str | None:
    """Brings one row and its VM into agreement; returns what was done (for the log)."""
    stray = bool(driver.gc(row.pk))  # e.g. a process left running by a VM saved to disk
    vm = driver.inspect(row.pk).status
    present = vm in (VMStatus.RUNNING, VMStatus.PAUSED, VMStatus.SAVED)  # stopped / unknown: lost
    on_disk = vm is VMStatus.SAVED  # saved to disk, with or without memory: no process
    running = vm is VMStatus.RUNNING
    details = {"vm": vm.value if present else None, "stray_process_stopped": stray}

    if row.state == S.KILLING or row.state in DEAD:
        driver.kill(row.pk)  # also what a boot cut off early left
        if row.state == S.KILLING:
            move(row, S.KILLED, actor, "kill finished by the node", details, killed_at=timezone.now())
        else:
            SandboxEvent.objects.create(sandbox_id=row.pk, operation="reconcile", from_state=row.state,
                                        to_state=row.state, message="removed a VM left behind", details=details,
                                        actor=actor)
        return "removed"
    if row.state == S.CREATING:
        # the row first, the VM only once it is ours: a create that ended meanwhile keeps its VM
        if not move(row, S.ERROR, actor, "node restarted while the sandbox was being created", details,
                    error_reason="node worker restarted while the sandbox was being created"):
            return "changed meanwhile"
        driver.kill(row.pk)
        return "create abandoned"
    if not present:
        driver.kill(row.pk)  # whatever files are left
        reason = f"VM lost: the node has no VM for this sandbox (it was {row.state})"
        move(row, S.ERROR, actor, reason, details, error_reason=reason)
        return "lost"
    if row.state == S.PAUSING:
        if on_disk:
            move(row, S.PAUSED, actor, "pause had finished on the node", details)
            return "paused"
        fields = continue_vm(driver, row)
        move(row, S.RUNNING, actor, "pause was interrupted; the VM was continued", details, **fields)
        return "running"
    if row.state == S.RESUMING or (row.state == S.PAUSED and running):
        if running:
            driver.pause_to_disk(row.pk)
            details["repaused"] = True
        if row.state == S.RESUMING:
            move(row, S.PAUSED, actor, "resume was not acknowledged; the sandbox stays paused", details)
        else:
            SandboxEvent.objects.create(sandbox_id=row.pk, operation="reconcile", from_state=row.state,
                                        to_state=row.state, message="VM was running; saved to disk again",
                                        details=details, actor=actor)
        return "paused"
    if row.state == S.RUNNING and on_disk:
        move(row, S.PAUSED, actor, "the VM is saved to disk", details)
        return "paused"
    if stray:
        SandboxEvent.objects.create(sandbox_id=row.pk, operation="reconcile", from_state=row.state,
                                    to_state=row.state, message="stopped a VM process left after a pause",
                                    details=details, actor=actor)
        return "stray stopped"
    return None


def reconcile_node(node_id: str, driver, *, older_than: datetime, settled: bool) -> list[tuple[str, str, str]]:
    """Reconciles this node's rows last changed before ``older_than``: transitional ones
    always, running / paused ones too when ``settled`` (at start), plus VMs of dead rows;
    then interrupted snapshots and forks (``agent.reconcile_snapshots``).
    Returns ``[(sandbox_id, state_before, what_was_done)]``; one failing sandbox does not
    stop the others."""
    actor = f"node:{node_id}"
    states = TRANSITIONAL + (SETTLED if settled else [])
    rows = list(Sandbox.objects.filter(node_id=node_id, state__in=states, updated_at__lt=older_than))
    known_vms = driver.sandbox_ids()  # includes dead VMs' leftovers
    rows += list(Sandbox.objects.filter(pk__in=known_vms, state__in=DEAD, updated_at__lt=older_than))
    done = []
    # A sandbox resumed on another node while this one was away (agent.moves): what is left
    # of it here is a stale copy, never to run again.
    for sid, other in Sandbox.objects.filter(pk__in=known_vms).exclude(node_id=node_id).exclude(
            node_id__isnull=True).exclude(state__in=DEAD).values_list("pk", "node_id"):
        driver.kill(sid)
        log.info("reconcile: sandbox %s runs on node %s now; removed its copy here", sid, other)
        done.append((sid, "moved", f"removed: it runs on node {other} now"))
    for row in rows:
        # Read again: the pass acts on one row after another (each may take seconds: a kill,
        # a save), and an operation may have finished since the rows were listed; acting on
        # the listed copy killed or saved VMs of sandboxes that were running by then.
        fresh = Sandbox.objects.filter(pk=row.pk, state=row.state, updated_at=row.updated_at).first()
        if fresh is None:
            continue
        row = fresh
        try:
            what = reconcile_sandbox(driver, row, actor)
        except Exception as exc:  # noqa: BLE001 - reported, the others still run
            log.exception("reconcile of sandbox %s (%s) failed", row.pk, row.state)
            what = f"failed: {type(exc).__name__}: {exc}"
        if what:
            log.info("reconcile: sandbox %s was %s: %s", row.pk, row.state, what)
            done.append((row.pk, row.state, what))
    try:
        for sid in guest_volumes.stop_orphans(driver):
            done.append((sid, "volume server", "stopped: its VM no longer runs here"))
    except Exception:  # noqa: BLE001 - reported; a stray server only holds its slot's exports
        log.exception("stopping orphaned volume servers on node %s failed", node_id)
    try:
        for kind, ident, what in reconcile_interrupted(node_id, driver, older_than=older_than, at_start=settled):
            log.info("reconcile: %s %s: %s", kind, ident, what)
            done.append((ident, kind, what))
    except Exception:  # noqa: BLE001 - reported; the sandboxes above are settled anyway
        log.exception("reconcile of interrupted snapshots / forks on node %s failed", node_id)
    return done


def purge_queue(queue: str) -> int:
    """Drops the tasks sent to this node while its worker was down: their callers have
    either given up or are watching the row the reconcile is about to fix, and running
    them now (a pause of a sandbox just reconciled to running) would undo the reconcile."""
    from nodes.celery_app import app as celery_app  # noqa: PLC0415

    try:
        with celery_app.connection_for_write() as conn:
            return conn.default_channel.queue_purge(queue) or 0
    except Exception:  # noqa: BLE001 - a broker hiccup must not stop the node from starting
        log.exception("could not purge queue %s", queue)
        return 0


class Reconciler(Periodic):
    """The periodic pass: rows stuck in a transitional state longer than ``stale``
    seconds (their API call has long given up) are reconciled like at start."""

    def __init__(self, node_id: str, driver, interval: float, stale: float):
        super().__init__(f"reconcile-{node_id}", interval)
        self.node_id, self.driver, self.stale = node_id, driver, stale

    def round(self) -> None:
        reconcile_node(self.node_id, self.driver, settled=False,
                       older_than=timezone.now() - timedelta(seconds=self.stale))
