"""Fork: one capture of a running sandbox, then ``count`` children restored from it on the
parent's node, each with the parent's memory, processes, files and settings."""
from __future__ import annotations

import asyncio
import logging
import time
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from nodes import placement
from lifecycle.sandboxes import core, network
from lifecycle.sandboxes.core import S, Result
from sandboxes.errors import Conflict, Failed, LifecycleError, Unavailable
from lifecycle.sandboxes.options import SandboxOptions
from sandboxes.models import Sandbox, Team, new_envd_access_token
from sandboxes.transitions import insert_creating, transition_sync

from lifecycle.snapshots.common import fail_capture

log = logging.getLogger(__name__)

# The most children the API accepts in one request, whatever the per-node limit.
MAX_FORK_COUNT = 100


def fork_max_per_node() -> int:
    """``AENV_FORK_MAX_PER_NODE``: the most children one fork may start (all land on the
    parent's node), read at call time."""
    return int(settings.AENV_FORK_MAX_PER_NODE)


async def fork_sandbox(team: Team, sandbox_id: str, *, count: int | None = 1, timeout: int | None = None,
                       actor: str = "") -> list[Result | LifecycleError]:
    """Forks a running sandbox into ``count`` children on its node (one capture; the
    parent keeps its id and expiry). Each child expires ``timeout`` seconds after it
    starts; without one it inherits the parent's timeout. Returns one entry per child:
    its Result (running), or the LifecycleError that stopped it (siblings are unaffected).

    Not running: Conflict; unknown: NotFound; no room on the parent's node: Unavailable;
    the capture itself failed: its error, and no child exists. (``count`` was checked
    against ``fork_max_per_node()`` at the edge.)"""
    count = 1 if count is None else count
    parent = await core.visible(team, sandbox_id)
    if parent.state != S.RUNNING:
        raise core.not_running(sandbox_id, parent.state)
    node = await core.node_of(parent)
    if timeout is None:
        timeout = await _inherited_timeout(parent)
    made: list = []

    def claim(placed) -> None:  # the children's rows are the reservation, made under the node's lock
        made.append(_begin_fork_sync(parent, placed, count, timeout, actor))

    vcpus, memory_mb = placement.fork_child_charge(parent.cpu_count, parent.memory_mb)
    try:
        await placement.place(vcpus * count, memory_mb * count, on=node, claim=claim)
    except placement.NoNodeAvailable as exc:
        raise Unavailable(f"{exc} ({count} fork child(ren) of a {parent.cpu_count} vCPU / {parent.memory_mb} MiB "
                          f"sandbox, each reserving {vcpus} vCPU / {memory_mb} MiB while it shares its parent's "
                          "memory; forks start on their parent's node)", retry=False) from None
    children = made[0] if made else None
    if children is None:
        parent = await core.visible(team, sandbox_id)
        raise core.not_running(sandbox_id, parent.state)
    return await core.shielded(_fork_on_node(parent, children, node, timeout, actor))


async def _inherited_timeout(parent: Sandbox) -> int:
    """The parent's timeout value: the last one asked for (set_timeout, resume, connect),
    else the create's (end_at - started_at holds it exactly until the TTL is changed)."""
    async for event in parent.events.order_by("-id")[:50]:
        value = (event.details or {}).get("timeout") if isinstance(event.details, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= settings.AENV_MAX_TIMEOUT:
            return value
    seconds = int(round((parent.end_at - parent.started_at).total_seconds()))
    return min(max(seconds, 1), settings.AENV_MAX_TIMEOUT)


def _begin_fork_sync(parent: Sandbox, node, count: int, timeout: int, actor: str) -> list[Sandbox] | None:
    """``running → forking`` and the ``creating`` child rows, in one transaction (so the
    children reserve their node's capacity, a fork child's charge, before the node starts them). Each child copies
    the parent's settings as the row holds them now (a network update may have landed since
    ``parent`` was read) and gets its own envd and traffic access tokens."""
    now = timezone.now()
    reserved_vcpus, reserved_memory_mb = placement.fork_child_charge(parent.cpu_count, parent.memory_mb)
    with transaction.atomic():
        started = core.event(parent.pk, "fork", outcome="started", from_state=S.RUNNING, actor=actor,
                             details={"count": count, "child_timeout": timeout})  # not "timeout": the parent's own
        if not transition_sync(parent.pk, [S.RUNNING], S.FORKING, started):
            return None
        parent = Sandbox.objects.get(pk=parent.pk)
        children = []
        for _ in range(count):
            child = insert_creating(
                core.event("", "create", outcome="started", actor=actor,
                           details={"template": parent.template_id, "forked_from": parent.pk, "node": node.id,
                                    "timeout": timeout}),
                team_id=parent.team_id, template_id=parent.template_id, node=node,
                alias=parent.alias, client_id=parent.client_id, envd_version=parent.envd_version,
                envd_access_token=new_envd_access_token() if parent.envd_access_token else "",
                traffic_access_token=network.new_traffic_access_token() if parent.traffic_access_token else "",
                cpu_count=parent.cpu_count, memory_mb=parent.memory_mb, disk_size_mb=parent.disk_size_mb,
                reserved_vcpus=reserved_vcpus, reserved_memory_mb=reserved_memory_mb,
                **SandboxOptions.of(parent).fields(), forked_from=parent, created_at=now, started_at=now,
                end_at=now + timedelta(seconds=timeout),
            )
            children.append(child)
        started.details["children"] = [c.id for c in children]
        started.save(update_fields=["details"])
    return children


async def _fork_on_node(parent: Sandbox, children: list[Sandbox], node, timeout: int,
                        actor: str) -> list[Result | LifecycleError]:
    client, _ = core.node_api()
    deadline = settings.AENV_FORK_DEADLINE
    t0, started = time.monotonic(), timezone.now()
    details = {"node": node.id, "count": len(children), "children": [c.id for c in children]}
    try:
        # A kill of the parent meanwhile still needs the node's answer (its children are
        # kept); any other move is a restarted node's reconcile, answered at once.
        result = await core.await_node(asyncio.wait_for(
            client.fork_sandbox(
                node, sandbox_id=parent.id, env_vars=parent.env_vars,
                access_token=parent.envd_access_token or None,
                children=[{"sandbox_id": c.id, "env_vars": c.env_vars, "access_token": c.envd_access_token or None,
                           "network": network.spec_of(c)} for c in children],
                deadline=deadline),
            timeout=deadline + 15,
        ), parent.id, S.FORKING, tolerate=(S.KILLING, S.KILLED))
    except core.Moved as moved:
        await _fork_interrupted(parent, children, moved.state, t0, started, details, actor)
    except Exception as exc:  # the whole fork failed: no child is served
        await _fork_failed(client, exc, parent, children, node, t0, started, details, actor, deadline)

    timings = (result or {}).get("timings") or {}
    phases = core.op_phases(t0, timings.get("total_ms"))
    by_id = {r.get("sandbox_id"): r for r in (result or {}).get("children") or []}
    parent_init = (result or {}).get("parent") or {}
    event = core.event(parent.id, "fork", from_state=S.FORKING, started_at=started, duration_ms=core.ms(t0),
                       actor=actor, details={**details, "timings": timings, "phases": phases,
                                             "parent_init": parent_init,
                                             "failed": [cid for cid, r in by_id.items() if not r.get("ok")]})
    if not await core.transition(parent.id, [S.FORKING], S.RUNNING, event):
        event.outcome, event.message = "aborted", "parent was killed while forking; its children are kept"
        await core.record(event)
    out = await asyncio.gather(*(_finish_child(c, by_id.get(c.id), node, timeout, t0, started, actor)
                                 for c in children))
    return [Result(child, phases) if isinstance(child, Sandbox) else child for child in out]


async def _fork_interrupted(parent, children, state, t0, started, details, actor):
    """The node restarted mid-fork and its reconcile settled the parent (``state``): no
    child was acknowledged, so each still ``creating`` ends ``error`` (the node removes
    whatever VM a child had)."""
    reason = f"fork of sandbox {parent.id} was interrupted (node restarted); the parent is {state}"
    await core.record(core.event(parent.id, "fork", outcome="aborted", from_state=S.FORKING, started_at=started,
                                 duration_ms=core.ms(t0), actor=actor, message=reason, details=details))
    for child in children:
        failed = core.event(child.id, "create", outcome="error", from_state=S.CREATING, started_at=started,
                            duration_ms=core.ms(t0), message=reason, actor=actor,
                            details={"forked_from": parent.id, "kind": "NodeRestarted"})
        if not await core.transition(child.id, [S.CREATING], S.ERROR, failed, error_reason=reason):
            await core.record(failed)
    raise Unavailable(reason)


async def _fork_failed(client, exc, parent, children, node, t0, started, details, actor, deadline):
    # The node answered: the capture failed and the driver continued the parent (no child
    # was started). No answer: parent and children are in an unknown state; remove them.
    error, vm_runs, moved = await fail_capture(client, exc, node, parent.id, "fork", S.FORKING, details=details,
                                               started=started, t0=t0, actor=actor, deadline=deadline)
    reason, kind = error.message, error.kind
    # Without an answer, each VM whose row this request moved to error is removed; a row
    # settled meanwhile (killed, or reconciled by a restarted node worker) is left alone.
    doomed = [parent.id] if moved and not vm_runs else []
    for child in children:
        child_event = core.event(child.id, "create", outcome="error", from_state=S.CREATING, started_at=started,
                                 duration_ms=core.ms(t0), message=reason, actor=actor,
                                 details={"forked_from": parent.id, "kind": kind})
        if await core.transition(child.id, [S.CREATING], S.ERROR, child_event, error_reason=reason):
            if not vm_runs:
                doomed.append(child.id)
        else:
            await core.record(child_event)
    for sid in doomed:
        cleanup = await core.kill_on_node(node, sid, core.CLEANUP_DEADLINE)
        await core.record(core.event(sid, "fork" if sid == parent.id else "create", outcome="cleanup",
                                     from_state=S.ERROR, to_state=S.ERROR, actor=actor,
                                     details={**details, "cleanup": cleanup}))
    raise error from exc


async def _finish_child(child: Sandbox, result: dict | None, node, timeout: int, t0, started,
                        actor: str) -> Sandbox | LifecycleError:
    base = {"forked_from": child.forked_from_id, "node": node.id}
    if not result or not result.get("ok"):
        kind = (result or {}).get("kind") or "MissingResult"
        reason = (f"fork child {child.id} failed on node {node.id}: {kind}: {(result or {}).get('message', '')}"
                  if result else f"node {node.id} returned no result for fork child {child.id}")
        event = core.event(child.id, "create", outcome="error", from_state=S.CREATING, started_at=started,
                           duration_ms=core.ms(t0), message=reason, actor=actor, details={**base, "kind": kind})
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
