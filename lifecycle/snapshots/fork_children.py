"""What every fork child goes through, wherever it runs: its row (made with the parent's
``running → forking`` in the placement's claim, so it is the reservation) and its end
(``creating → running`` with its routes, or ``error`` alone: siblings are unaffected).

Why its own module: a fork whose children all fit on the parent's node (``fork``) and one
whose children span nodes (``fork_spread``) share both ends."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from django.db import transaction
from django.utils import timezone

from lifecycle.sandboxes import core, network
from lifecycle.sandboxes.core import S
from lifecycle.sandboxes.options import SandboxOptions
from nodes import placement
from sandboxes.errors import Conflict, Failed, LifecycleError
from sandboxes.models import Sandbox, new_envd_access_token
from sandboxes.transitions import insert_creating, transition_sync
from lifecycle.volumes import mounts
from snapshots.models import Snapshot, SnapshotState as SS


@dataclass
class Begun:
    """A fork under way: each child's row with its node, and the stored capture they restore
    from when they span nodes (None: all on the parent's node, the driver's own fork)."""

    children: list[tuple[Sandbox, object]]
    capture: Snapshot | None = None


def begin_fork_sync(parent: Sandbox, allotment: list, timeout: int, actor: str) -> Begun | None:
    """``running → forking`` and the ``creating`` child rows on the nodes of ``allotment``
    (``[(node, n)]``, the parent's node first: ``placement.place_fork``), in one transaction
    (so the children reserve their nodes' capacity, a fork child's charge, before any node
    starts them). Each child copies the parent's settings as the row holds them now (a
    network update may have landed since ``parent`` was read) and gets its own envd and
    traffic access tokens. Children on other nodes make the capture a stored snapshot of its
    own (``fork_capture``), which every child of this fork then names as its source. None if
    the parent is no longer running."""
    now = timezone.now()
    reserved_vcpus, reserved_memory_mb = placement.fork_child_charge(parent.cpu_count, parent.memory_mb)
    home = allotment[0][0]
    count = sum(n for _, n in allotment)
    spread = any(n for node, n in allotment if node.pk != home.pk)
    with transaction.atomic():
        details = {"count": count, "child_timeout": timeout}  # not "timeout": the parent's own
        if spread:
            details["nodes"] = {node.pk: n for node, n in allotment if n}
        started = core.event(parent.pk, "fork", outcome="started", from_state=S.RUNNING, actor=actor,
                             details=details)
        if not transition_sync(parent.pk, [S.RUNNING], S.FORKING, started):
            return None
        parent = Sandbox.objects.get(pk=parent.pk)
        capture = None
        if spread:
            capture = Snapshot(team_id=parent.team_id, source_sandbox=parent, template_id=parent.template_id,
                               node=home, memory=True, fork_capture=True, state=SS.CREATING,
                               cpu_count=parent.cpu_count, memory_mb=parent.memory_mb,
                               disk_size_mb=parent.disk_size_mb, envd_version=parent.envd_version,
                               envd_access_token=parent.envd_access_token)
            capture.save(force_insert=True)
            started.details["capture"] = capture.id
        children = []
        for node, n in allotment:
            for _ in range(n):
                child = insert_creating(
                    core.event("", "create", outcome="started", actor=actor,
                               details={"template": parent.template_id, "forked_from": parent.pk, "node": node.pk,
                                        "timeout": timeout, **({"capture": capture.id} if capture else {})}),
                    team_id=parent.team_id, template_id=parent.template_id, node=node,
                    alias=parent.alias, client_id=parent.client_id, envd_version=parent.envd_version,
                    envd_access_token=new_envd_access_token() if parent.envd_access_token else "",
                    traffic_access_token=network.new_traffic_access_token() if parent.traffic_access_token else "",
                    cpu_count=parent.cpu_count, memory_mb=parent.memory_mb, disk_size_mb=parent.disk_size_mb,
                    reserved_vcpus=reserved_vcpus, reserved_memory_mb=reserved_memory_mb,
                    **SandboxOptions.of(parent).fields(), forked_from=parent, source_snapshot=capture,
                    created_at=now, started_at=now, end_at=now + timedelta(seconds=timeout),
                )
                mounts.copy_sandbox_mounts(parent.pk, child.pk)  # children see the parent's volumes
                children.append((child, node))
        if capture is not None:
            mounts.record_snapshot(capture.id, mounts.of_sandbox(parent.pk))
        started.details["children"] = [c.id for c, _ in children]
        started.save(update_fields=["details"])
    return Begun(children, capture)


async def finish_child(child: Sandbox, result: dict | None, node, timeout: int, t0, started,
                       actor: str) -> Sandbox | LifecycleError:
    """A child's end from its node's ``result`` (``{"ok", "envd_host", …}`` or ``{"ok": False,
    "kind", "message"}``): running with its routes and a fresh expiry, or error with the reason;
    a child killed meanwhile has its VM removed (the kill found none yet)."""
    base = {"forked_from": child.forked_from_id, "node": node.id}
    if child.source_snapshot_id:
        base["capture"] = child.source_snapshot_id
    if not result or not result.get("ok"):
        kind = (result or {}).get("kind") or "MissingResult"
        reason = (f"fork child {child.id} failed on node {node.id}: {kind}: {(result or {}).get('message', '')}"
                  if result else f"node {node.id} returned no result for fork child {child.id}")
        extra = {"cleanup": result["cleanup"]} if result and result.get("cleanup") else {}
        event = core.event(child.id, "create", outcome="error", from_state=S.CREATING, started_at=started,
                           duration_ms=core.ms(t0), message=reason, actor=actor,
                           details={**base, "kind": kind, **extra})
        if not await core.transition(child.id, [S.CREATING], S.ERROR, event, error_reason=reason):
            await core.record(event)
        return Failed(reason, code=core.snake(kind))
    now = timezone.now()
    event = core.event(child.id, "create", from_state=S.CREATING, started_at=started, duration_ms=core.ms(t0),
                       actor=actor, details={**base, "pid": result.get("pid"), "timings": result.get("timings")})
    won = await core.transition(child.id, [S.CREATING], S.RUNNING, event, envd_host=result["envd_host"],
                                envd_port=result["envd_port"], guest_host=result.get("guest_host") or "",
                                started_at=now,
                                end_at=now + timedelta(seconds=timeout))
    if not won:  # killed while it was being forked: the kill found no VM yet
        cleanup = await core.kill_on_node(node, child.id, core.CLEANUP_DEADLINE)
        await core.record(core.event(child.id, "create", outcome="aborted", from_state=S.CREATING,
                                     started_at=started, duration_ms=core.ms(t0), actor=actor,
                                     message="sandbox was killed while it was being forked",
                                     details={**base, "cleanup": cleanup}))
        return Conflict(f'sandbox "{child.id}" was killed while it was being forked')
    return await Sandbox.objects.select_related("template").aget(pk=child.pk)
