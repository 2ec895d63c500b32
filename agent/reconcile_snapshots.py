"""Node-side reconcile of interrupted snapshots and forks (a node worker that died
mid-capture), in the style of ``agent.reconcile`` and meant to be called from it:

- a sandbox left ``snapshotting`` / ``forking``: the capture stopped its vCPUs and may
  never have continued them, so the VM is continued and its envd re-initialised →
  ``running`` (no VM → ``error``). Fork children left ``creating`` are
  ``agent.reconcile``'s (removed, ``error``);
- a Snapshot left ``creating`` on this node: its partial files are removed → ``error``;
- what the driver left that no VM needs (fork captures no child uses, a process of a VM
  saved to disk) is removed: ``driver.gc()``.

All of it only at start, before the worker consumes tasks: then nothing can still be
capturing. A periodic pass must not judge by age (a long capture under TCG is not an
interrupted one); while the worker runs, the API's own deadline handles a lost capture.

Every change is conditional on the row being as read (state and updated_at), so an
operation that started meanwhile is never overwritten."""
from __future__ import annotations

import logging
from datetime import datetime

from sandboxes.models import Sandbox, SandboxEvent
from sandboxes.states import TRANSITIONS, SandboxState

from snapshots.models import Snapshot, SnapshotState
from snapshots.transitions import transition_sync

from agent.settle import continue_vm, move
from agent.stores import get_store

log = logging.getLogger(__name__)

S = SandboxState
INTERRUPTED = {TRANSITIONS[op].in_flight: op for op in ("snapshot", "fork")}


def reconcile_interrupted(node_id: str, driver, *, older_than: datetime, at_start: bool) -> list[tuple]:
    """Returns ``[(kind, id, what_was_done)]``; one failing row does not stop the others.
    Does nothing unless ``at_start`` (see the module docstring)."""
    if not at_start:
        return []

    actor = f"node:{node_id}"
    done: list[tuple] = []
    rows = Sandbox.objects.filter(node_id=node_id, state__in=list(INTERRUPTED), updated_at__lt=older_than)
    for row in list(rows):
        try:
            done.append(("sandbox", row.pk, _settle_sandbox(driver, row, actor)))
        except Exception:  # noqa: BLE001 - the next pass retries
            log.exception("reconcile of %s sandbox %s failed", row.state, row.pk)
    for snap in list(Snapshot.objects.filter(node_id=node_id, state=SnapshotState.CREATING,
                                             updated_at__lt=older_than)):
        done.append(("snapshot", snap.pk, _fail_snapshot(snap)))
    # what the driver left that no VM needs: fork captures (a fork killed between capture and
    # children: the driver deletes a capture only when its last child goes), stray processes
    done += [(left.kind, left.name, "removed") for left in driver.gc()]
    return done


def _settle_sandbox(driver, row: Sandbox, actor: str) -> str:
    op = INTERRUPTED[row.state]
    info = driver.info(row.pk)
    details = {"vm": None if info is None else info.status, "interrupted": op}
    if info is None:
        driver.kill(row.pk)  # whatever files are left
        reason = f"VM lost: the node has no VM for this sandbox (it was {row.state})"
        move(row, S.ERROR, actor, reason, details, error_reason=reason)
        return "lost"
    fields = continue_vm(driver, row)
    move(row, S.RUNNING, actor, f"{op} was interrupted by a node restart; the VM was continued",
               details, **fields)
    return "running"


def _fail_snapshot(snap: Snapshot) -> str:
    removed = get_store().delete(snap.pk)
    reason = "the node worker stopped while capturing; nothing was kept"
    transition_sync(snap.pk, "reconcile", where={"updated_at": snap.updated_at}, actor=f"node:{snap.node_id}",
                    message=reason, details={"files_removed": removed}, error_reason=reason)
    if snap.source_sandbox_id:
        SandboxEvent.objects.create(sandbox_id=snap.source_sandbox_id, operation="reconcile",
                                    message=f"snapshot {snap.pk} abandoned: {reason}",
                                    details={"snapshot": snap.pk, "files_removed": removed})
    return "error"
