"""What snapshot, fork and delete share: their node failures (a full store has a name of
its own), quiet file cleanup, and how a failed capture ends."""
from __future__ import annotations

import asyncio
import logging

from lifecycle.sandboxes import core
from lifecycle.sandboxes.core import S
from sandboxes.errors import VM_GONE, LifecycleError, StorageFull

log = logging.getLogger(__name__)


def node_error(client, exc: BaseException, node, what: str, deadline: float) -> LifecycleError:
    """The domain error of a failed snapshot-store operation on a node."""
    error = core.node_failure(client, exc, node, what, deadline)
    if error.kind == "StorageFull":
        full = StorageFull(f"{what} failed: the snapshot store on node {node.id} is full ({exc})",
                           code="insufficient_storage")
        full.kind = error.kind
        return full
    return error


async def delete_files_quietly(node, snapshot_id: str) -> dict:
    client, _ = core.node_api()
    try:
        result = await asyncio.wait_for(client.delete_snapshot_files(node, snapshot_id=snapshot_id),
                                        timeout=core.CLEANUP_DEADLINE)
        return {"ok": True, "deleted": bool((result or {}).get("deleted"))}
    except Exception as exc:  # noqa: BLE001 - reported, never raised
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


async def fail_capture(client, exc: BaseException, node, sandbox_id: str, operation: str, from_state: str, *,
                       details: dict, started, t0: float, actor: str, deadline: float):
    """A snapshot's or fork's node call failed: the domain error, whether the VM still runs
    (the node answered: its driver continued the VM; not when it had no VM at all) and whether this request moved the
    sandbox (to running, or to error when nobody knows what the VM is) →
    ``(error, vm_runs, moved)``."""
    error = node_error(client, exc, node, operation, deadline)
    log.warning("%s of sandbox %s failed: %s", operation, sandbox_id, error.message)
    vm_runs = isinstance(exc, client.NodeTaskFailed) and error.kind not in VM_GONE  # no VM: lost
    failed = core.event(sandbox_id, operation, outcome="error", from_state=from_state, started_at=started,
                        duration_ms=core.ms(t0), message=error.message, actor=actor,
                        details={**details, "kind": error.kind})
    moved = await end_failed_operation(sandbox_id, from_state, failed, vm_runs, error.message)
    return error, vm_runs, moved


async def end_failed_operation(sandbox_id: str, from_state: str, event, vm_runs: bool, reason: str) -> bool:
    """After a failed snapshot or fork: back to running if the node answered (its driver
    continued the VM), else error. False if the row had moved meanwhile (killed, or
    settled by a restarted node's reconcile): then the event is only recorded."""
    if vm_runs:
        moved = await core.transition(sandbox_id, [from_state], S.RUNNING, event)
    else:
        moved = await core.transition(sandbox_id, [from_state], S.ERROR, event, error_reason=reason)
    if not moved:
        await core.record(event)
    return moved
