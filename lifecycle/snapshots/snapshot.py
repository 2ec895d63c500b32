"""Snapshot: a running sandbox is captured (``running → snapshotting → running``, a pause
of tens of ms) into its node's snapshot store; it keeps its id and expiry. The snapshot
itself goes ``creating → ready`` (or ``error``) through ``snapshots.transitions``."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from lifecycle.sandboxes import core
from lifecycle.sandboxes.core import S
from sandboxes.errors import Unavailable
from sandboxes.models import Sandbox, Team
from sandboxes.prepared import PreparedGet, insert
from sandboxes.transitions import transition_sync

from snapshots import transitions as snapshot_transitions
from snapshots.models import Snapshot, SnapshotState as SS
from lifecycle.snapshots.common import delete_files_quietly, fail_capture
from lifecycle.volumes import mounts

log = logging.getLogger(__name__)


@dataclass
class Taken:
    """A finished snapshot and the phases (ms) of taking it."""

    snapshot: Snapshot
    phases: dict = field(default_factory=dict)


async def create_snapshot(team: Team, sandbox_id: str, *, name: str | None = None, memory: bool | None = True,
                          actor: str = "") -> Taken:
    """Snapshots a running sandbox, which keeps running with the same id and expiry.

    ``memory=False`` is E2B's filesystem-only snapshot: the guest syncs, only the disk
    is kept, and sandboxes started from it cold-boot (files, no processes).
    Not running: Conflict; unknown or another team's: NotFound; full store: StorageFull."""
    # Shielded from the move to ``snapshotting`` on: a client gone mid-way never leaves it
    # ``snapshotting`` with nothing capturing it.
    return await core.shielded(_begin_and_take(team, sandbox_id, name or "", memory, actor))


async def _begin_and_take(team: Team, sandbox_id: str, name: str, memory, actor: str) -> Taken:
    sandbox, node, snapshot = await _begin_snapshot(team, sandbox_id, name, memory, actor)
    core.fresh(node)  # the node call right after checks it as just read
    return await _snapshot_on_node(sandbox, snapshot, node, memory, actor)


def _mode(memory) -> str:
    return "filesystem" if memory is False else "memory"


@sync_to_async
def _begin_snapshot(team: Team, sandbox_id: str, name: str, memory, actor: str) -> tuple[Sandbox, object, Snapshot]:
    """The sandbox read, checked and moved to ``snapshotting`` with its snapshot's row, in one
    thread hop (issue 26: the read was a hop of its own). NotFound, Conflict (not running,
    also when another request changed it meanwhile), Unavailable (its node is gone)."""
    sandbox = core.shown_sync(team, sandbox_id)
    if sandbox.state != S.RUNNING:
        raise core.not_running(sandbox_id, sandbox.state)
    node = core.node_of_sync(sandbox)
    snapshot = _insert_snapshot(sandbox, node, name, memory, actor)
    if snapshot is None:  # another request changed the sandbox meanwhile
        raise core.not_running(sandbox_id, core.shown_sync(team, sandbox_id).state)
    return sandbox, node, snapshot


def _insert_snapshot(sandbox: Sandbox, node, name: str, memory, actor: str) -> Snapshot | None:
    with transaction.atomic():
        snapshot = Snapshot(
            team_id=sandbox.team_id, name=name, source_sandbox=sandbox, template_id=sandbox.template_id,
            node=node, memory=memory is not False, state=SS.CREATING, cpu_count=sandbox.cpu_count,
            memory_mb=sandbox.memory_mb, disk_size_mb=sandbox.disk_size_mb, envd_version=sandbox.envd_version,
            envd_access_token=sandbox.envd_access_token,
        )
        event = core.event(sandbox.pk, "snapshot", outcome="started", from_state=S.RUNNING, actor=actor,
                           details={"snapshot": snapshot.id, "name": name, "memory": memory, "mode": _mode(memory)})
        if not transition_sync(sandbox.pk, [S.RUNNING], S.SNAPSHOTTING, event):
            return None
        insert(snapshot)  # save(force_insert=True), its INSERT built once (sandboxes.prepared)
        # What starts from it mounts the same volumes again (its memory expects them).
        mounts.record_snapshot(snapshot.id, mounts.of_sandbox(sandbox.pk))
    return snapshot


async def _snapshot_on_node(sandbox: Sandbox, snapshot: Snapshot, node, memory, actor: str) -> Taken:
    client, _ = core.node_api()
    deadline = settings.AENV_SNAPSHOT_DEADLINE
    t0, started = time.monotonic(), timezone.now()
    details = {"node": node.id, "snapshot": snapshot.id, "memory": memory, "mode": _mode(memory)}
    try:
        # A kill meanwhile still needs the node's answer (the capture is kept); any other
        # move is a restarted node's reconcile, answered at once.
        result = await core.await_node(asyncio.wait_for(
            client.snapshot_sandbox(node, sandbox_id=sandbox.id, snapshot_id=snapshot.id, memory=memory is not False,
                                    deadline=deadline),
            timeout=deadline + 15,
        ), sandbox.id, S.SNAPSHOTTING, tolerate=(S.KILLING, S.KILLED))
    except core.Moved as moved:
        reason = f"snapshot of sandbox {sandbox.id} was interrupted (node restarted); the sandbox is {moved.state}"
        await core.record(core.event(sandbox.id, "snapshot", outcome="aborted", from_state=S.SNAPSHOTTING,
                                     started_at=started, duration_ms=core.ms(t0), actor=actor, message=reason,
                                     details=details))
        await snapshot_transitions.transition(snapshot.pk, "fail", actor=actor, message=reason,
                                              details=details, error_reason=reason)
        raise Unavailable(reason) from None
    except Exception as exc:  # mapped below, never a bare 500
        # The node answered: the driver continued the VM and removed the partial capture.
        # No answer: the VM's state is unknown, so it is removed like after a failed pause.
        error, vm_runs, moved = await fail_capture(client, exc, node, sandbox.id, "snapshot", S.SNAPSHOTTING,
                                                   details=details, started=started, t0=t0, actor=actor,
                                                   deadline=deadline)
        reason = error.message
        if moved and not vm_runs:
            # Only the winner of the transition removes the VM: a restarted node worker may
            # have continued it and set the sandbox running again meanwhile.
            cleanup = await core.kill_on_node(node, sandbox.id, core.CLEANUP_DEADLINE)
            await core.record(core.event(sandbox.id, "snapshot", outcome="cleanup", from_state=S.ERROR,
                                         to_state=S.ERROR, actor=actor, details={**details, "cleanup": cleanup}))
        if not vm_runs:
            await delete_files_quietly(node, snapshot.id)
        await snapshot_transitions.transition(snapshot.pk, "fail", actor=actor, message=reason,
                                              details=details, error_reason=reason)
        raise error from exc

    timings = (result or {}).get("timings") or {}
    phases = core.op_phases(t0, timings.get("task_ms"))
    event = core.event(sandbox.id, "snapshot", from_state=S.SNAPSHOTTING, started_at=started,
                       duration_ms=core.ms(t0), actor=actor,
                       details={**details, "size_bytes": result.get("size_bytes"), "timings": timings,
                                "phases": phases})
    running, done = await _finish_snapshot(snapshot, result, event)
    if not running:
        log.info("sandbox %s was killed while snapshotting; snapshot %s is kept", sandbox.id, snapshot.id)
    return Taken(done, phases)


@sync_to_async
def _finish_snapshot(snapshot: Snapshot, result: dict, event) -> tuple[bool, Snapshot]:
    """Snapshot ``ready`` (a name moves here from an older snapshot of the team) and the
    sandbox back to ``running``, in one transaction (a snapshot the node's reconcile failed
    meanwhile stays failed). Returns whether the sandbox is running again (False: killed
    meanwhile; the snapshot is complete and kept all the same) and the snapshot's row as
    the transaction left it (read in it: no second thread hop for the answer)."""
    with transaction.atomic():
        size = int(result.get("size_bytes") or 0)
        if not snapshot_transitions.transition_sync(snapshot.pk, "complete", actor=event.actor,
                                                    details={"sandbox": event.sandbox_id, "size_bytes": size},
                                                    manifest=result.get("manifest") or {}, size_bytes=size):
            # only a restarted node's reconcile moves a capture in progress: it removed the files
            log.warning("snapshot %s was abandoned by its node before its capture was recorded", snapshot.pk)
        elif snapshot.name:
            Snapshot.objects.filter(team_id=snapshot.team_id, name=snapshot.name).exclude(pk=snapshot.pk).update(
                name="", updated_at=timezone.now())
        moved = transition_sync(event.sandbox_id, [S.SNAPSHOTTING], S.RUNNING, event)
        if not moved:
            event.outcome, event.message = "aborted", "sandbox was killed while snapshotting; the snapshot is kept"
            event.to_state = ""
            event.save()
        return moved, _snapshot_row(snapshot.pk)


# The snapshot's row for the answer, its SQL compiled once (sandboxes.prepared; issue 26).
_snapshot_row = PreparedGet(lambda: Snapshot.objects.all())
