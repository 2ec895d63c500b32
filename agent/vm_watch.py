"""The node's watch over its running sandboxes' VMs: a sandbox whose VM failed under it is
made ``error`` (its reason, a ``reconcile`` event) at the next look, and what is left of the
VM removed. A VM has failed when

- its process is gone (QEMU died: e.g. SIGBUS on a page of a memory snapshot read lazily
  from a store that could not deliver it, or the OOM killer), or nothing of it is left on
  the node at all (removed by something that took the row for another state's), or
- its guest's disk requests failed on the host (the guest got I/O errors: a lazily read disk
  whose store went away or keeps giving wrong bytes, a failing host disk). Its file systems
  and programs are then in a state nobody knows, so it is stopped, not left half-working.

Why: such a sandbox used to stay ``running`` until the worker's next start (agent.reconcile),
and its clients saw timeouts instead of a clear answer. The reason names the snapshot store
when the VM reads lazily filled files whose reads failed (the chunkfs daemon's per-mount
error counts), since that is what an operator must look at.

A look is cheap and bounded: records and processes, one short QMP query per VM (a VM whose
QMP is busy with a verb is looked at next time); the watch is its own thread, so a failing
VM never holds up the node's tasks. Every write is conditional on the row as read, so an
operation that started meanwhile (a pause, a kill) is never overwritten."""
from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta

from django.utils import timezone

from sandboxes.models import Sandbox
from sandboxes.states import SandboxState
from vmm.driver import VMStatus

from agent.periodic import Periodic
from agent.settle import move

log = logging.getLogger(__name__)

SETTLE = timedelta(seconds=2)  # a row that changed this recently is an operation's, not ours yet
STORE_REASON = ("its files are read lazily from the snapshot store, which could not deliver them "
                "(the store unavailable, or its data corrupt)")


def failure(driver, sandbox_id: str) -> tuple[str, dict] | None:
    """What failed of the VM, as (reason, details), or None while it is sound."""
    status = driver.inspect(sandbox_id).status
    if status is VMStatus.STOPPED:
        return "VM died: its process exited while the sandbox was running", {"vm": status.value}
    if status is VMStatus.UNKNOWN:  # nothing of it left on the node: its commands would hang
        return "VM lost: the node has no VM for this sandbox (it was running)", {"vm": None}
    if status in (VMStatus.RUNNING, VMStatus.PAUSED):
        errors = driver.disk_errors(sandbox_id)
        if errors:
            return (f"the guest's disk failed: {errors} disk request(s) got an I/O error on the node",
                    {"vm": status.value, "disk_errors": errors})
    return None


def lazy_read_errors(lazy, files: set[str]) -> dict[str, int]:
    """{snapshot id: failed reads} of the lazily mounted snapshots among ``files`` (paths
    under ``lazy.path(id)``) whose reads failed; {} without lazy restores or their daemon."""
    if lazy is None or not files:
        return {}
    client = lazy.running_client()
    if client is None:
        return {}
    try:
        mounts = client.stats().get("mounts") or {}
    except Exception:  # noqa: BLE001 - a daemon going away: the reason stays the VM's own
        return {}
    found = {}
    for mount_id, stats in mounts.items():
        inside = f"{lazy.path(mount_id)}/"
        errors = int((stats or {}).get("errors") or 0)
        if errors and any(f.startswith(inside) for f in files):
            found[mount_id] = errors
    return found


def watch_node(node_id: str, driver, lazy: Callable[[], object] | None = None,
               suspects: set[str] | None = None) -> list[tuple[str, str]]:
    """One look at this node's running sandboxes; returns ``[(sandbox_id, reason)]`` of those
    made ``error``. ``lazy``: the store's lazy restores (agent.stores.lazy), or None.

    ``suspects`` (kept by the caller between looks): a guest whose disk failed is acted on
    only when the previous look saw it failed too, so the program whose read failed has an
    interval to get its I/O error back to its client before the VM goes (a dead VM is acted
    on at once). Without it every failure is acted on at the first look."""
    actor = f"node:{node_id}"
    done = []
    rows = Sandbox.objects.filter(node_id=node_id, state=SandboxState.RUNNING,
                                  updated_at__lt=timezone.now() - SETTLE)
    failing = set()
    for row in rows:
        try:
            found = failure(driver, row.pk)
            if found is None:
                continue
            reason, details = found
            if suspects is not None and "disk_errors" in details and row.pk not in suspects:
                failing.add(row.pk)
                log.info("sandbox %s: %s (acted on at the next look)", row.pk, reason)
                continue
            stores = lazy_read_errors(lazy() if lazy else None, driver.files_in_use(row.pk))
            if stores:
                reason = f"{reason}; {STORE_REASON}"
                details["lazy_read_errors"] = stores
            if move(row, SandboxState.ERROR, actor, reason, details, error_reason=reason):
                driver.kill(row.pk)
                log.warning("sandbox %s failed on node %s: %s", row.pk, node_id, reason)
                done.append((row.pk, reason))
        except Exception:  # noqa: BLE001 - reported; the other sandboxes are still looked at
            log.exception("watching sandbox %s failed", row.pk)
    if suspects is not None:
        suspects.clear()
        suspects.update(failing)
    return done


class VmWatch(Periodic):
    """``watch_node`` every ``interval`` seconds (``AENV_VM_WATCH_INTERVAL``)."""

    def __init__(self, node_id: str, driver, interval: float, lazy: Callable[[], object] | None = None):
        super().__init__(f"vm-watch-{node_id}", interval)
        self.node_id, self.driver, self.lazy = node_id, driver, lazy
        self.suspects: set[str] = set()

    def round(self) -> None:
        watch_node(self.node_id, self.driver, self.lazy, self.suspects)
