"""Snapshots and forks: the control-plane half.

Same rules as ``sandboxes.services`` (whose helpers this reuses): every sandbox
state change is a conditional update written with its SandboxEvent in one
transaction before anyone is answered, node work runs shielded from client
disconnects, and failures end in a consistent, reported state.

- snapshot: ``running → snapshotting → running``; the node captures the VM into its
  snapshot store and the Snapshot row goes ``creating → ready`` (or ``error``, with
  nothing left on disk).
- fork: ``running → forking → running`` for the parent; ``count`` child rows are
  inserted ``creating`` up front (on the parent's node), and each ends ``running``
  or ``error`` on its own.
- delete: ``ready → deleting``, refused (409) while a live sandbox restored from the
  snapshot still reads its files; the files go first, then the row."""
from __future__ import annotations

import asyncio
import logging
import time
from datetime import timedelta

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from sandboxes import services as sbx
from sandboxes.errors import ApiError
from sandboxes.models import Sandbox, Team, Template, new_envd_access_token
from sandboxes.states import LIVE, SandboxState
from sandboxes.transitions import insert_creating, transition_sync

from .models import NAME_RE, Snapshot, SnapshotState

log = logging.getLogger(__name__)

S = SandboxState
SS = SnapshotState
Page = sbx.Page

MAX_FORK_COUNT = 100
# Node work of a snapshot (a TCG capture copies the guest RAM) and of a fork (capture
# plus `count` restores and /inits) may take as long as any node task.
SNAPSHOT_DEADLINE = float(getattr(settings, "AENV_SNAPSHOT_DEADLINE", sbx.LIFECYCLE_DEADLINE))
FORK_DEADLINE = float(getattr(settings, "AENV_FORK_DEADLINE", settings.AENV_NODE_TASK_DEADLINE))
DELETE_DEADLINE = 60.0
# A full snapshot store is the client's problem to solve (delete snapshots), not a crash.
STORAGE_FULL_STATUS = 507


def fork_max_per_node() -> int:
    """``AENV_FORK_MAX_PER_NODE``: the most children one fork may start (all land on the
    parent's node), read at call time."""
    return int(settings.AENV_FORK_MAX_PER_NODE)


def _node_error(client, exc: BaseException, node, what: str) -> tuple[int, str, str, str | None]:
    """(status, reason, kind, error_code) for a failed node call; a full store is 507."""
    status, reason, kind = sbx._node_failure(client, exc, node, what)
    if kind == "StorageFull":
        return STORAGE_FULL_STATUS, f"{what} failed: the snapshot store on node {node.id} is full ({exc})", \
            kind, "insufficient_storage"
    return status, reason, kind, sbx._snake(kind) if status == 500 else None


# --------------------------------------------------------------------------- names


def normalize_ref(team: Team, ref: str) -> str:
    """A snapshot reference as the SDK may spell it: ``id``, ``name``, ``<team>/name`` or
    ``name:tag`` (tags are not versioned here: the name's newest snapshot answers)."""
    ref = (ref or "").strip()
    prefix = f"{team.slug}/"
    if ref.startswith(prefix):
        ref = ref[len(prefix):]
    if ":" in ref:
        ref = ref.split(":", 1)[0]
    return ref


def _check_name(name) -> str:
    if name is None or name == "":
        return ""
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ApiError(400, "name must be 1-128 characters: letters, digits, '_', '-' or '.', "
                            "starting with a letter or digit")
    if name.startswith("s") and len(name) == 20 and name.isalnum() and name.islower():
        raise ApiError(400, "name must not look like a snapshot id")
    return name


async def _snapshot_of(team: Team, ref: str, states=None) -> Snapshot | None:
    ref = normalize_ref(team, ref)
    if not ref:
        return None
    qs = Snapshot.objects.select_related("template", "node").filter(team=team)
    if states is not None:
        qs = qs.filter(state__in=list(states))
    found = await qs.filter(pk=ref).afirst()
    if found is None:
        found = await qs.filter(name=ref).order_by("-created_at", "-id").afirst()
    return found


async def resolve_snapshot(team: Team, ref: str) -> Snapshot | None:
    """The team's snapshot a create's ``templateID`` names, or None if it names none
    (then it is a template). One that exists but is not ready yet is a 409."""
    snapshot = await _snapshot_of(team, ref, states=[SS.READY])
    if snapshot is None and await _snapshot_of(team, ref, states=[SS.CREATING]) is not None:
        raise ApiError(409, f'snapshot "{normalize_ref(team, ref)}" is still being created')
    return snapshot


# --------------------------------------------------------------------------- create


async def create_snapshot(team: Team, sandbox_id: str, *, name: str | None = None, memory: bool | None = True,
                          actor: str = "") -> Snapshot:
    """Snapshots a running sandbox, which keeps running with the same id and expiry.

    ``memory=False`` is E2B's filesystem-only snapshot: the guest syncs, only the disk
    is kept, and sandboxes started from it cold-boot (files, no processes).
    Not running: 409; unknown or another team's: 404; full store: 507."""
    name = _check_name(name)
    if memory is not None and not isinstance(memory, bool):
        raise ApiError(400, "memory must be a boolean")
    sandbox = await sbx._visible(team, sandbox_id)
    if sandbox.state != S.RUNNING:
        raise sbx._not_running(sandbox_id, sandbox.state)
    node = await sbx._node_of(sandbox)
    snapshot = await _begin_snapshot(sandbox, node, name, memory, actor)
    if snapshot is None:  # another request changed the sandbox meanwhile
        sandbox = await sbx._visible(team, sandbox_id)
        raise sbx._not_running(sandbox_id, sandbox.state)
    return await sbx._shielded(_snapshot_on_node(sandbox, snapshot, node, memory, actor))


def _mode(memory) -> str:
    return "filesystem" if memory is False else "memory"


@sync_to_async
def _begin_snapshot(sandbox: Sandbox, node, name: str, memory, actor: str) -> Snapshot | None:
    with transaction.atomic():
        snapshot = Snapshot(
            team_id=sandbox.team_id, name=name, source_sandbox=sandbox, template_id=sandbox.template_id,
            node=node, memory=memory is not False, state=SS.CREATING, cpu_count=sandbox.cpu_count,
            memory_mb=sandbox.memory_mb, disk_size_mb=sandbox.disk_size_mb, envd_version=sandbox.envd_version,
            envd_access_token=sandbox.envd_access_token,
        )
        event = sbx._event(sandbox.pk, "snapshot", outcome="started", from_state=S.RUNNING, actor=actor,
                           details={"snapshot": snapshot.id, "name": name, "memory": memory, "mode": _mode(memory)})
        if not transition_sync(sandbox.pk, [S.RUNNING], S.SNAPSHOTTING, event):
            return None
        snapshot.save(force_insert=True)
    return snapshot


async def _snapshot_on_node(sandbox: Sandbox, snapshot: Snapshot, node, memory, actor: str) -> Snapshot:
    client, _ = sbx._node_api()
    t0, started = time.monotonic(), timezone.now()
    details = {"node": node.id, "snapshot": snapshot.id, "memory": memory, "mode": _mode(memory)}
    try:
        result = await asyncio.wait_for(
            client.snapshot_sandbox(node, sandbox_id=sandbox.id, snapshot_id=snapshot.id, memory=memory is not False,
                                    deadline=SNAPSHOT_DEADLINE),
            timeout=SNAPSHOT_DEADLINE + 15,
        )
    except Exception as exc:  # mapped below, never a bare 500
        status, reason, kind, code = _node_error(client, exc, node, "snapshot")
        log.warning("snapshot of sandbox %s failed: %s", sandbox.id, reason)
        # The node answered: the driver continued the VM and removed the partial capture.
        # No answer: the VM's state is unknown, so it is removed like after a failed pause.
        vm_runs = isinstance(exc, client.NodeTaskFailed)
        event = sbx._event(sandbox.id, "snapshot", outcome="error", from_state=S.SNAPSHOTTING, started_at=started,
                           duration_ms=sbx._ms(t0), message=reason, actor=actor, details={**details, "kind": kind})
        moved = await _end_failed_operation(sandbox.id, S.SNAPSHOTTING, event, vm_runs, reason)
        if moved and not vm_runs:
            # Only the winner of the transition removes the VM: a restarted node worker may
            # have continued it and set the sandbox running again meanwhile.
            cleanup = await sbx._kill_on_node(node, sandbox.id, sbx.CLEANUP_DEADLINE)
            await sbx._record(sbx._event(sandbox.id, "snapshot", outcome="cleanup", from_state=S.ERROR,
                                         to_state=S.ERROR, actor=actor, details={**details, "cleanup": cleanup}))
        if not vm_runs:
            await _delete_files_quietly(node, snapshot.id)
        await Snapshot.objects.filter(pk=snapshot.pk).aupdate(state=SS.ERROR, error_reason=reason,
                                                              updated_at=timezone.now())
        raise ApiError(status, reason, error_code=code) from exc

    timings = (result or {}).get("timings") or {}
    phases = sbx._op_phases(t0, timings.get("task_ms"))
    event = sbx._event(sandbox.id, "snapshot", from_state=S.SNAPSHOTTING, started_at=started,
                       duration_ms=sbx._ms(t0), actor=actor,
                       details={**details, "size_bytes": result.get("size_bytes"), "timings": timings,
                                "phases": phases})
    running = await _finish_snapshot(snapshot, result, event)
    if not running:
        log.info("sandbox %s was killed while snapshotting; snapshot %s is kept", sandbox.id, snapshot.id)
    done = await Snapshot.objects.aget(pk=snapshot.pk)
    done.op_phases = phases
    return done


@sync_to_async
def _finish_snapshot(snapshot: Snapshot, result: dict, event) -> bool:
    """Snapshot ``ready`` (a name moves here from an older snapshot of the team) and the
    sandbox back to ``running``, in one transaction. False if the sandbox was killed
    meanwhile (the snapshot is complete and kept all the same)."""
    with transaction.atomic():
        if snapshot.name:
            Snapshot.objects.filter(team_id=snapshot.team_id, name=snapshot.name).exclude(pk=snapshot.pk).update(
                name="", updated_at=timezone.now())
        Snapshot.objects.filter(pk=snapshot.pk).update(
            state=SS.READY, manifest=result.get("manifest") or {}, size_bytes=int(result.get("size_bytes") or 0),
            updated_at=timezone.now())
        moved = transition_sync(event.sandbox_id, [S.SNAPSHOTTING], S.RUNNING, event)
        if not moved:
            event.outcome, event.message = "aborted", "sandbox was killed while snapshotting; the snapshot is kept"
            event.to_state = ""
            event.save()
    return moved


async def _delete_files_quietly(node, snapshot_id: str) -> dict:
    client, _ = sbx._node_api()
    try:
        result = await asyncio.wait_for(client.delete_snapshot_files(node, snapshot_id=snapshot_id),
                                        timeout=sbx.CLEANUP_DEADLINE)
        return {"ok": True, "deleted": bool((result or {}).get("deleted"))}
    except Exception as exc:  # noqa: BLE001 - reported, never raised
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


async def _end_failed_operation(sandbox_id: str, from_state: str, event, vm_runs: bool, reason: str) -> bool:
    """After a failed snapshot or fork: back to running if the node answered (its driver
    continued the VM), else error. False if the row had moved meanwhile (killed, or
    settled by a restarted node's reconcile): then the event is only recorded."""
    if vm_runs:
        moved = await sbx._transition(sandbox_id, [from_state], S.RUNNING, event)
    else:
        moved = await sbx._transition(sandbox_id, [from_state], S.ERROR, event, error_reason=reason)
    if not moved:
        await sbx._record(event)
    return moved


# --------------------------------------------------------------------------- list


async def list_snapshots(team: Team, *, sandbox_id: str | None = None, name: str | None = None,
                         limit: int = 100, next_token: str | None = None) -> Page:
    """The team's ready snapshots, newest first, keyset-paginated on (created_at, id)
    so pages never repeat or skip one while others are taken or deleted."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 100:
        raise ApiError(400, "limit must be an integer between 1 and 100")
    qs = Snapshot.objects.filter(team=team, state=SS.READY)
    if sandbox_id:
        qs = qs.filter(source_sandbox_id=sandbox_id)
    if name:
        ref = normalize_ref(team, name)
        qs = qs.filter(Q(pk=ref) | Q(name=ref))
    if next_token:
        when, last_id = sbx.decode_page_token(next_token)
        qs = qs.filter(Q(created_at__lt=when) | Q(created_at=when, id__lt=last_id))
    rows = [s async for s in qs.order_by("-created_at", "-id")[: limit + 1]]
    more = len(rows) > limit
    rows = rows[:limit]
    return Page(rows, sbx.encode_page_token(rows[-1].created_at, rows[-1].id) if more else None)


# --------------------------------------------------------------------------- delete


async def delete_snapshot(team: Team, snapshot_id: str, actor: str = "") -> None:
    """Deletes a snapshot (by id or name) with its files: 204. Unknown, another team's or
    already being deleted: 404. Still creating, or a live sandbox restored from it still
    reads its layers and memory: 409 (kill those first)."""
    snapshot = await _snapshot_of(team, snapshot_id)
    if snapshot is None or snapshot.state == SS.DELETING:
        note = ""
        if await Template.objects.filter(Q(pk=snapshot_id) | Q(alias=snapshot_id)).aexists():
            note = " (it names a template, not a snapshot: templates are not deleted through this API)"
        raise ApiError(404, f'snapshot "{snapshot_id}" not found{note}')
    if snapshot.state == SS.CREATING:
        raise ApiError(409, f'snapshot "{snapshot.id}" is still being created')
    previous = await _begin_delete(snapshot)
    # Shielded: a client that goes away must not leave the snapshot stuck in "deleting".
    await sbx._shielded(_delete_on_node(snapshot, previous, actor))


async def _delete_on_node(snapshot: Snapshot, previous: str, actor: str) -> None:
    t0 = time.monotonic()
    if snapshot.node is not None and previous == SS.ERROR:
        await _delete_files_quietly(snapshot.node, snapshot.id)  # a failed capture left nothing, normally
    elif snapshot.node is not None:
        client, _ = sbx._node_api()
        deleter = await _deleting_node(snapshot)
        try:
            result = await asyncio.wait_for(
                client.delete_snapshot_files(deleter, snapshot_id=snapshot.id, deadline=DELETE_DEADLINE),
                timeout=DELETE_DEADLINE + 15)
        except Exception as exc:  # the files are still there: the snapshot stays usable
            status, reason, _kind, code = _node_error(client, exc, deleter, "snapshot deletion")
            await Snapshot.objects.filter(pk=snapshot.pk, state=SS.DELETING).aupdate(
                state=previous, updated_at=timezone.now())
            raise ApiError(status, reason, error_code=code) from exc
        log.info("snapshot %s deleted by %s (files: %s, %.0f ms)", snapshot.id, actor, result, sbx._ms(t0))
    await Snapshot.objects.filter(pk=snapshot.pk).adelete()


async def _deleting_node(snapshot: Snapshot):
    """The node that deletes the files: the snapshot's own — or, with the s3 backend
    (the bucket is the truth, any node can reach it), any alive node when that one is
    gone. Copies cached on other nodes leave by eviction."""
    from nodes.models import Node  # noqa: PLC0415

    from .storage import backend_name  # noqa: PLC0415

    own = snapshot.node
    if backend_name() != "s3" or own.is_alive():
        return own
    async for node in Node.objects.filter(draining=False).order_by("id"):
        if node.is_alive():
            return node
    return own  # nobody else either: the node client reports it unavailable


@sync_to_async
def _begin_delete(snapshot: Snapshot) -> str:
    """``→ deleting``, then looks for live dependents; with any, back to the previous
    state and 409. Marking first closes the race with a concurrent restore, which
    re-checks the snapshot after inserting its sandbox."""
    with transaction.atomic():
        if not Snapshot.objects.filter(pk=snapshot.pk, state=snapshot.state).update(
                state=SS.DELETING, updated_at=timezone.now()):
            raise ApiError(404, f'template or snapshot "{snapshot.id}" not found (being deleted)')
    users = list(Sandbox.objects.filter(source_snapshot_id=snapshot.pk, state__in=LIVE)
                 .order_by("created_at").values_list("id", flat=True)[:6])
    if users:
        Snapshot.objects.filter(pk=snapshot.pk, state=SS.DELETING).update(state=snapshot.state,
                                                                          updated_at=timezone.now())
        shown = ", ".join(users[:5]) + (", …" if len(users) > 5 else "")
        raise ApiError(409, f'snapshot "{snapshot.id}" is still used by live sandboxes restored from it '
                            f"({shown}); kill them before deleting it")
    return snapshot.state


async def snapshot_still_ready(snapshot_id: str) -> bool:
    return await Snapshot.objects.filter(pk=snapshot_id, state=SS.READY).aexists()


# --------------------------------------------------------------------------- fork


async def fork_sandbox(team: Team, sandbox_id: str, *, count: int | None = 1, timeout: int | None = None,
                       actor: str = "") -> list[Sandbox | ApiError]:
    """Forks a running sandbox into ``count`` children on its node (one capture; the
    parent keeps its id and expiry). Each child expires ``timeout`` seconds after it
    starts; without one it inherits the parent's timeout. Returns one entry per child:
    the running Sandbox, or the ApiError that stopped it (siblings are unaffected).

    Bad count/timeout or over ``AENV_FORK_MAX_PER_NODE``: 400; not running: 409;
    unknown: 404; the capture itself failed: 5xx and no child exists."""
    count = 1 if count is None else count
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_FORK_COUNT:
        raise ApiError(400, f"count must be an integer between 1 and {MAX_FORK_COUNT}")
    limit = fork_max_per_node()
    if count > limit:
        raise ApiError(400, f"count {count} is over the per-node fork limit AENV_FORK_MAX_PER_NODE={limit} "
                            "(all children start on the parent's node)")
    if timeout is not None:
        timeout = sbx._check_timeout(timeout)
    parent = await sbx._visible(team, sandbox_id)
    if parent.state != S.RUNNING:
        raise sbx._not_running(sandbox_id, parent.state)
    node = await sbx._node_of(parent)
    if not await _has_room(node.pk, parent.cpu_count * count, parent.memory_mb * count):
        raise ApiError(503, f"node {node.pk} has no room for {count} more sandbox(es) of {parent.cpu_count} vCPU / "
                            f"{parent.memory_mb} MiB (forks start on their parent's node)", headers=sbx.NO_RETRY)
    if timeout is None:
        timeout = await _inherited_timeout(parent)
    children = await _begin_fork(parent, node, count, timeout, actor)
    if children is None:
        parent = await sbx._visible(team, sandbox_id)
        raise sbx._not_running(sandbox_id, parent.state)
    return await sbx._shielded(_fork_on_node(parent, children, node, timeout, actor))


async def _inherited_timeout(parent: Sandbox) -> int:
    """The parent's timeout value: the last one asked for (set_timeout, resume, connect),
    else the create's (end_at - started_at holds it exactly until the TTL is changed)."""
    async for event in parent.events.order_by("-id")[:50]:
        value = (event.details or {}).get("timeout") if isinstance(event.details, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= settings.AENV_MAX_TIMEOUT:
            return value
    seconds = int(round((parent.end_at - parent.started_at).total_seconds()))
    return min(max(seconds, 1), settings.AENV_MAX_TIMEOUT)


@sync_to_async
def _begin_fork(parent: Sandbox, node, count: int, timeout: int, actor: str) -> list[Sandbox] | None:
    """``running → forking`` and the ``creating`` child rows, in one transaction (so the
    children reserve their node's capacity before the node starts them)."""
    now = timezone.now()
    with transaction.atomic():
        started = sbx._event(parent.pk, "fork", outcome="started", from_state=S.RUNNING, actor=actor,
                             details={"count": count, "child_timeout": timeout})  # not "timeout": the parent's own
        if not transition_sync(parent.pk, [S.RUNNING], S.FORKING, started):
            return None
        children = []
        for _ in range(count):
            child = insert_creating(
                sbx._event("", "create", outcome="started", actor=actor,
                           details={"template": parent.template_id, "forked_from": parent.pk, "node": node.id,
                                    "timeout": timeout}),
                team_id=parent.team_id, template_id=parent.template_id, node=node,
                alias=parent.alias, client_id=parent.client_id, envd_version=parent.envd_version,
                secure=parent.secure, envd_access_token=new_envd_access_token() if parent.envd_access_token else "",
                metadata=dict(parent.metadata or {}), env_vars=dict(parent.env_vars or {}),
                cpu_count=parent.cpu_count, memory_mb=parent.memory_mb, disk_size_mb=parent.disk_size_mb,
                auto_pause=parent.auto_pause, auto_resume=parent.auto_resume,
                allow_internet_access=parent.allow_internet_access, network=parent.network,
                forked_from=parent, created_at=now, started_at=now, end_at=now + timedelta(seconds=timeout),
            )
            children.append(child)
        started.details["children"] = [c.id for c in children]
        started.save(update_fields=["details"])
    return children


async def _fork_on_node(parent: Sandbox, children: list[Sandbox], node, timeout: int,
                        actor: str) -> list[Sandbox | ApiError]:
    client, _ = sbx._node_api()
    t0, started = time.monotonic(), timezone.now()
    details = {"node": node.id, "count": len(children), "children": [c.id for c in children]}
    try:
        result = await asyncio.wait_for(
            client.fork_sandbox(
                node, sandbox_id=parent.id, env_vars=parent.env_vars,
                access_token=parent.envd_access_token or None,
                children=[{"sandbox_id": c.id, "env_vars": c.env_vars, "access_token": c.envd_access_token or None}
                          for c in children],
                deadline=FORK_DEADLINE),
            timeout=FORK_DEADLINE + 15,
        )
    except Exception as exc:  # the whole fork failed: no child is served
        await _fork_failed(client, exc, parent, children, node, t0, started, details, actor)

    timings = (result or {}).get("timings") or {}
    phases = sbx._op_phases(t0, timings.get("total_ms"))
    by_id = {r.get("sandbox_id"): r for r in (result or {}).get("children") or []}
    parent_init = (result or {}).get("parent") or {}
    event = sbx._event(parent.id, "fork", from_state=S.FORKING, started_at=started, duration_ms=sbx._ms(t0),
                       actor=actor, details={**details, "timings": timings, "phases": phases,
                                             "parent_init": parent_init,
                                             "failed": [cid for cid, r in by_id.items() if not r.get("ok")]})
    if not await sbx._transition(parent.id, [S.FORKING], S.RUNNING, event):
        event.outcome, event.message = "aborted", "parent was killed while forking; its children are kept"
        await sbx._record(event)
    out = await asyncio.gather(*(_finish_child(c, by_id.get(c.id), node, timeout, t0, started, actor)
                                 for c in children))
    for child in out:
        if isinstance(child, Sandbox):
            child.op_phases = phases
    return list(out)


async def _fork_failed(client, exc, parent, children, node, t0, started, details, actor):
    status, reason, kind, code = _node_error(client, exc, node, "fork")
    log.warning("fork of sandbox %s failed: %s", parent.id, reason)
    # The node answered: the capture failed and the driver continued the parent (no child
    # was started). No answer: parent and children are in an unknown state; remove them.
    vm_runs = isinstance(exc, client.NodeTaskFailed)
    event = sbx._event(parent.id, "fork", outcome="error", from_state=S.FORKING, started_at=started,
                       duration_ms=sbx._ms(t0), message=reason, actor=actor, details={**details, "kind": kind})
    moved = await _end_failed_operation(parent.id, S.FORKING, event, vm_runs, reason)
    # Without an answer, each VM whose row this request moved to error is removed; a row
    # settled meanwhile (killed, or reconciled by a restarted node worker) is left alone.
    doomed = [parent.id] if moved and not vm_runs else []
    for child in children:
        child_event = sbx._event(child.id, "create", outcome="error", from_state=S.CREATING, started_at=started,
                                 duration_ms=sbx._ms(t0), message=reason, actor=actor,
                                 details={"forked_from": parent.id, "kind": kind})
        if await sbx._transition(child.id, [S.CREATING], S.ERROR, child_event, error_reason=reason):
            if not vm_runs:
                doomed.append(child.id)
        else:
            await sbx._record(child_event)
    for sid in doomed:
        cleanup = await sbx._kill_on_node(node, sid, sbx.CLEANUP_DEADLINE)
        await sbx._record(sbx._event(sid, "fork" if sid == parent.id else "create", outcome="cleanup",
                                     from_state=S.ERROR, to_state=S.ERROR, actor=actor,
                                     details={**details, "cleanup": cleanup}))
    raise ApiError(status, reason, error_code=code) from exc


async def _finish_child(child: Sandbox, result: dict | None, node, timeout: int, t0, started,
                        actor: str) -> Sandbox | ApiError:
    base = {"forked_from": child.forked_from_id, "node": node.id}
    if not result or not result.get("ok"):
        kind = (result or {}).get("kind") or "MissingResult"
        reason = (f"fork child {child.id} failed on node {node.id}: {kind}: {(result or {}).get('message', '')}"
                  if result else f"node {node.id} returned no result for fork child {child.id}")
        event = sbx._event(child.id, "create", outcome="error", from_state=S.CREATING, started_at=started,
                           duration_ms=sbx._ms(t0), message=reason, actor=actor, details={**base, "kind": kind})
        if not await sbx._transition(child.id, [S.CREATING], S.ERROR, event, error_reason=reason):
            await sbx._record(event)
        return ApiError(500, reason, error_code=sbx._snake(kind))
    now = timezone.now()
    event = sbx._event(child.id, "create", from_state=S.CREATING, started_at=started, duration_ms=sbx._ms(t0),
                       actor=actor, details={**base, "pid": result.get("pid"), "timings": result.get("timings")})
    won = await sbx._transition(child.id, [S.CREATING], S.RUNNING, event, envd_host=result["envd_host"],
                                envd_port=result["envd_port"], started_at=now,
                                end_at=now + timedelta(seconds=timeout))
    if not won:  # killed while it was being forked: the kill found no VM yet
        cleanup = await sbx._kill_on_node(node, child.id, sbx.CLEANUP_DEADLINE)
        await sbx._record(sbx._event(child.id, "create", outcome="aborted", from_state=S.CREATING,
                                     started_at=started, duration_ms=sbx._ms(t0), actor=actor,
                                     message="sandbox was killed while it was being forked",
                                     details={**base, "cleanup": cleanup}))
        return ApiError(409, f'sandbox "{child.id}" was killed while it was being forked')
    return await Sandbox.objects.select_related("template").aget(pk=child.pk)


# --------------------------------------------------------------------------- restore


async def restore_node(snapshot: Snapshot, no_node_error: type[Exception]):
    """The node a sandbox restored from ``snapshot`` runs on.

    posix_fs: the snapshot's own node (only it has the files). s3: that node when it
    is alive with room (no download), else any alive node with room (placement's
    choice), which fetches the files from the bucket.

    Called after the sandbox row (with ``source_snapshot``) exists: a snapshot that went
    ``deleting`` meanwhile is a 409, so a delete and a restore never both succeed."""
    from nodes.models import Node  # noqa: PLC0415
    from nodes import placement  # noqa: PLC0415

    from .storage import backend_name  # noqa: PLC0415

    if not await snapshot_still_ready(snapshot.id):
        raise ApiError(409, f'snapshot "{snapshot.id}" is being deleted', headers=sbx.NO_RETRY)
    node = await Node.objects.filter(pk=snapshot.node_id).afirst() if snapshot.node_id else None
    own_ok = node is not None and not node.draining and node.is_alive()
    if own_ok and await _has_room(node.pk, snapshot.cpu_count, snapshot.memory_mb):
        return node
    if backend_name() == "s3":
        try:
            return await placement.pick_node(snapshot.cpu_count, snapshot.memory_mb)
        except placement.NoNodeAvailable as exc:
            raise no_node_error(f"no node can restore snapshot {snapshot.id}: {exc}") from exc
    if not own_ok:
        raise no_node_error(f"node {snapshot.node_id} holding snapshot {snapshot.id} is not available")
    raise no_node_error(f"node {node.pk} holding snapshot {snapshot.id} has no room for "
                        f"{snapshot.cpu_count} vCPU / {snapshot.memory_mb} MiB")


async def _has_room(node_id: str, cpu_count: int, memory_mb: int) -> bool:
    """Placement's own arithmetic (capacity minus what live sandboxes reserve) for the one
    node a restore or fork must use."""
    from nodes import placement  # noqa: PLC0415

    node = await placement._candidates().filter(pk=node_id).afirst()
    return (node is not None and node.cpu_reserved + cpu_count <= node.vcpu_capacity
            and node.memory_reserved + memory_mb <= node.memory_mb_capacity)
