"""Fork: one capture of a running sandbox, then ``count`` children with the parent's memory,
processes, files and settings. Placement decides where the children go (``place_fork``): on
the parent's node while it has room (the driver's fork: children share the capture's memory
there); with the S3 store the rest go to other nodes, which restore them lazily from the
stored capture (``fork_spread``). The API and the SDK see no difference."""
from __future__ import annotations

import asyncio
import logging
import time

from asgiref.sync import sync_to_async
from django.conf import settings
from django.utils import timezone

from nodes import placement
from lifecycle.sandboxes import core, network
from lifecycle.volumes import mounts
from lifecycle.sandboxes.core import S, Result
from sandboxes.errors import LifecycleError, NoRoom, Unavailable
from sandboxes.models import Sandbox, Team

from lifecycle.snapshots.common import fail_capture
from lifecycle.snapshots.fork_children import begin_fork_sync, finish_child
from lifecycle.snapshots.fork_spread import fork_across_nodes

log = logging.getLogger(__name__)

# The most children the API accepts in one request, whatever the cluster.
MAX_FORK_COUNT = 100


def fork_max_per_node() -> int:
    """``AENV_FORK_MAX_PER_NODE``: the most children of one fork that any one node starts,
    read at call time."""
    return int(settings.AENV_FORK_MAX_PER_NODE)


def fork_spills() -> bool:
    """Whether a fork's children may go to other nodes than the parent's: only with the S3
    store, from which any node restores the capture."""
    return settings.AENV_SNAPSHOT_BACKEND == "s3"


def fork_max_count() -> int:
    """The most children one fork may ask for: ``MAX_FORK_COUNT`` where they may spread over
    the cluster, else the per-node limit (all on the parent's node). The API and the
    dashboard check it; placement then finds room for them or answers 503."""
    return MAX_FORK_COUNT if fork_spills() else min(MAX_FORK_COUNT, fork_max_per_node())


async def fork_sandbox(team: Team, sandbox_id: str, *, count: int | None = 1, timeout: int | None = None,
                       actor: str = "") -> list[Result | LifecycleError]:
    """Forks a running sandbox into ``count`` children (one capture; the parent keeps its id
    and expiry). Each child expires ``timeout`` seconds after it starts; without one it
    inherits the parent's timeout. Returns one entry per child: its Result (running), or the
    LifecycleError that stopped it (siblings are unaffected).

    Not running: Conflict; unknown: NotFound; no room for them all (on the parent's node, or
    with the S3 store in the cluster, at most ``AENV_FORK_MAX_PER_NODE`` a node): Unavailable;
    the capture itself failed: its error, and no child exists. (``count`` was checked
    against ``fork_max_count()`` at the edge.)"""
    count = 1 if count is None else count
    parent = await core.visible(team, sandbox_id)
    if parent.state != S.RUNNING:
        raise core.not_running(sandbox_id, parent.state)
    node = await core.node_of(parent)
    if timeout is None:
        timeout = await _inherited_timeout(parent)
    # Shielded from the placement's claim on (the parent's move to forking, the children's rows):
    # a client gone mid-way never leaves them so with nothing to finish them.
    return await core.shielded(_claim_and_fork(team, sandbox_id, parent, node, count, timeout, actor))


async def _claim_and_fork(team: Team, sandbox_id: str, parent: Sandbox, node, count: int, timeout: int,
                          actor: str) -> list:
    made: list = []

    def claim(allotment) -> None:  # the children's rows are the reservation, made under the nodes' locks
        made.append(begin_fork_sync(parent, allotment, timeout, actor))

    vcpus, memory_mb = placement.fork_child_charge(parent.cpu_count, parent.memory_mb)
    spill = fork_spills()
    try:
        await placement.place_fork(vcpus, memory_mb, count, home=node, per_node=fork_max_per_node(), spill=spill,
                                   claim=claim)
    except placement.NoNodeAvailable as exc:
        where = ("on the parent's node first, the rest on other nodes" if spill
                 else "forks start on their parent's node")
        raise NoRoom(f"{exc} ({count} fork child(ren) of a {parent.cpu_count} vCPU / {parent.memory_mb} MiB "
                          f"sandbox, each reserving {vcpus} vCPU / {memory_mb} MiB while it shares its parent's "
                          f"memory; {where})", retry=False) from None
    begun = made[0] if made else None
    if begun is None:
        parent = await core.visible(team, sandbox_id)
        raise core.not_running(sandbox_id, parent.state)
    if begun.capture is not None:
        return await fork_across_nodes(parent, begun, node, timeout, actor)
    children = [child for child, _ in begun.children]
    return await _fork_on_node(parent, children, node, timeout, actor)


async def _inherited_timeout(parent: Sandbox) -> int:
    """The parent's timeout value: the last one asked for (set_timeout, resume, connect),
    else the create's (end_at - started_at holds it exactly until the TTL is changed)."""
    async for event in parent.events.order_by("-id")[:50]:
        value = (event.details or {}).get("timeout") if isinstance(event.details, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= settings.AENV_MAX_TIMEOUT:
            return value
    seconds = int(round((parent.end_at - parent.started_at).total_seconds()))
    return min(max(seconds, 1), settings.AENV_MAX_TIMEOUT)


async def _fork_on_node(parent: Sandbox, children: list[Sandbox], node, timeout: int,
                        actor: str) -> list[Result | LifecycleError]:
    client, _ = core.node_api()
    deadline = settings.AENV_FORK_DEADLINE
    t0, started = time.monotonic(), timezone.now()
    details = {"node": node.id, "count": len(children), "children": [c.id for c in children]}
    volumes = await sync_to_async(mounts.node_volumes)(parent.id)  # each child's own slot serves them
    try:
        # A kill of the parent meanwhile still needs the node's answer (its children are
        # kept); any other move is a restarted node's reconcile, answered at once.
        result = await core.await_node(asyncio.wait_for(
            client.fork_sandbox(
                node, sandbox_id=parent.id, env_vars=parent.env_vars,
                access_token=parent.envd_access_token or None,
                children=[{"sandbox_id": c.id, "env_vars": c.env_vars, "access_token": c.envd_access_token or None,
                           "network": network.spec_of(c)} for c in children],
                deadline=deadline, **({"volumes": volumes} if volumes else {})),
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
    out = await asyncio.gather(*(finish_child(c, by_id.get(c.id), node, timeout, t0, started, actor)
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
