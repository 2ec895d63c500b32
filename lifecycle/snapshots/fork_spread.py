"""A fork whose children span nodes: the parent's node captures it once (a snapshot of its
own, ``fork_capture``: hidden from the team, released once no live child is left,
``captures``) and the parent continues; the children on the parent's node are restored from
that local copy at once while the node stores the capture in the S3 store, and the children
on the other nodes are restored lazily from the store (``agent.stores.lazy``) as soon as it
is there — each with its own id, envd token, env vars and network policy, as a child of the
driver's fork.

Why a stored snapshot and restores, not the driver's fork: a node restores only what the
store holds, and the one upload is what lets a rollout batch outgrow the parent's node. The
upload runs beside the parent's node's own restores, so it delays only the other nodes'.

The early hand-off (``AENV_FORK_HANDOFF``, where every node involved has peer fetch: their
heartbeats' ``protocol.FORK_HANDOFF``): the parent's node first hashes the capture and puts its
manifest in the store as pending (``index_snapshot``, 0.4–2 s for a 512 MiB guest on busy
cores), and the other nodes' children are restored at once, beside the upload, their chunks
read from the parent's node's files by peer fetch (or from the store once there). The fork
answers when its children run, as one on a single node does: until the upload ends they depend
on the parent's node, as its own children always do. The upload goes on after the answer
(``_upload``); if it fails, the other nodes' children are killed with that reason, so none
keeps running on a capture the store does not hold."""
from __future__ import annotations

import asyncio
import logging
import time
from datetime import timedelta

from asgiref.sync import sync_to_async
from django.conf import settings
from django.utils import timezone

from lifecycle import own_thread
from lifecycle.sandboxes import core, network
from lifecycle.sandboxes.kill import kill_sandbox
from lifecycle.volumes import mounts
from nodes import protocol
from nodes.models import Node
from lifecycle.sandboxes.core import S, Result
from sandboxes.errors import LifecycleError, Unavailable
from sandboxes.models import Sandbox, Team
from snapshots import transitions as snapshot_transitions

from lifecycle.snapshots.captures import lease_upload, release_if_unused
from lifecycle.snapshots.common import delete_files_quietly, fail_capture
from lifecycle.snapshots.fork_children import Begun, finish_child

log = logging.getLogger(__name__)


async def fork_across_nodes(parent: Sandbox, begun: Begun, home, timeout: int,
                            actor: str) -> list[Result | LifecycleError]:
    """Captures ``parent`` on ``home`` into ``begun.capture``, then restores each child of
    ``begun`` on its node. A failed capture fails the fork (no child exists); a capture that
    cannot be stored fails the other nodes' children (handed over: kills them after the
    answer); a child whose restore fails ends ``error`` alone, with its event."""
    capture = begun.capture
    children = [c for c, _ in begun.children]
    t0, started = time.monotonic(), timezone.now()
    nodes: dict[str, list[str]] = {}
    for child, node in begun.children:
        nodes.setdefault(node.id, []).append(child.id)
    details = {"node": home.id, "count": len(children), "capture": capture.id, "nodes": nodes}
    result = await _capture(parent, children, capture, home, t0, started, details, actor)
    timings = (result or {}).get("timings") or {}
    t_captured = time.monotonic()
    event = core.event(parent.id, "fork", from_state=S.FORKING, started_at=started, duration_ms=core.ms(t0),
                       actor=actor, details={**details, "size_bytes": result.get("size_bytes"), "timings": timings,
                                             "phases": core.op_phases(t0, timings.get("task_ms"))})
    if not await core.transition(parent.id, [S.FORKING], S.RUNNING, event):
        event.outcome, event.message = "aborted", "parent was killed while forking; its children are kept"
        await core.record(event)
    here = [(c, n) for c, n in begun.children if n.pk == home.pk]
    away = [(c, n) for c, n in begun.children if n.pk != home.pk]
    local = [asyncio.ensure_future(_child(c, n, capture, timeout, t0, started, actor)) for c, n in here]
    if away and await _hand_over(parent, capture, home, [n for _, n in away], started, details, actor):
        t_handed = time.monotonic()
        # the sweeper leaves it alone until the upload ends (at most its deadline, and a margin)
        await lease_upload(capture.id, timezone.now() + timedelta(seconds=settings.AENV_SNAPSHOT_DEADLINE + 75))
        # it outlives the request: its ORM calls on a thread of its own, whose connections it closes
        upload = asyncio.ensure_future(_logged(own_thread.on_a_thread_of_its_own(
            _upload(parent, capture, home, [c.id for c, _ in away], started, details, actor))))
        _uploading.add(upload)
        upload.add_done_callback(_uploading.discard)
        remote = [_child(c, n, capture, timeout, t0, started, actor, pending_wait=settings.AENV_SNAPSHOT_DEADLINE)
                  for c, n in away]
        ended = dict(zip([c.id for c, _ in here + away], await asyncio.gather(*local, *remote)))
        phases = {"capture": round((t_captured - t0) * 1000, 2), "handed_over": round((t_handed - t0) * 1000, 2)}
    else:
        stored = await _store(parent, capture, home, started, details, actor)
        t_stored = time.monotonic()
        if stored is None:
            remote = [_child(c, n, capture, timeout, t0, started, actor) for c, n in away]
        else:  # the other nodes cannot have it: their children fail, the parent's node's run
            remote = [finish_child(c, {"ok": False, "kind": stored.kind, "message": stored.message}, n, timeout, t0,
                                   started, actor) for c, n in away]
        ended = dict(zip([c.id for c, _ in here + away], await asyncio.gather(*local, *remote)))
        phases = {"capture": round((t_captured - t0) * 1000, 2), "stored": round((t_stored - t0) * 1000, 2)}
    out = [ended[c.id] for c, _ in begun.children]
    phases["total"] = round(core.ms(t0), 2)
    await release_if_unused(capture.id, actor)  # every child failed: nothing needs it
    return [Result(child, phases) if isinstance(child, Sandbox) else child for child in out]


# The uploads of handed-over captures still running after their fork answered (their follow-ups).
_uploading: set[asyncio.Future] = set()


async def uploads_settled() -> None:
    """Until every handed-over capture's upload and its follow-up have ended (tests; a
    shutdown that waits for them)."""
    while _uploading:
        await asyncio.gather(*list(_uploading), return_exceptions=True)


async def _logged(work) -> None:
    """Work nobody awaits: what goes wrong in it is logged, not lost."""
    try:
        await work
    except Exception:  # noqa: BLE001 - logged with its trace
        log.exception("the upload of a handed-over fork capture, or what follows it, failed")


async def _upload(parent: Sandbox, capture, home, remote_ids: list[str], started, details, actor: str) -> None:
    """A handed-over capture's upload, beside its children's restores and after the fork's
    answer: the other nodes' children run from the parent's node's files until it ends.
    Stored: nothing more. Not stored: those children are killed, their kill events saying why
    (as a fork without the hand-off fails them: no sandbox runs on a capture the store does
    not hold; one still being restored is removed by its restore's end), and the capture is
    released once none is left."""
    try:
        stored = await _store(parent, capture, home, started, details, actor)
    finally:
        await lease_upload(capture.id, None)
    if stored is None:
        return
    reason = f"its fork's capture could not be stored for the other nodes: {stored.message}"
    team = await Team.objects.aget(pk=parent.team_id)
    for child_id in remote_ids:
        try:
            await kill_sandbox(team, child_id, actor=actor, reason=reason)
        except LifecycleError as exc:  # failed, killed meanwhile, or gone: nothing left to do
            log.info("fork child %s after a failed upload of %s: %s", child_id, capture.id, exc)
    await release_if_unused(capture.id, actor)


def _hands_over(node) -> bool:
    return isinstance(node.host, dict) and node.host.get(protocol.FORK_HANDOFF) is True


async def _hand_over(parent: Sandbox, capture, home, others: list, started, details, actor: str) -> bool:
    """Whether the other nodes may restore the capture before its upload ends: the setting
    is on, every node involved says it can (``protocol.FORK_HANDOFF``: peer fetch, a chunkfs
    daemon that waits for what is not there yet) and the parent's node handed it over
    (``index_snapshot``). Anything else: False, and the fork waits for the upload as before
    (a failed hand-off: the parent's ``fork`` event with outcome ``handoff_skipped`` says why)."""
    if not settings.AENV_FORK_HANDOFF:
        return False
    if not all(_hands_over(n) for n in [home, *others]):
        return False
    client, _ = core.node_api()
    deadline = settings.AENV_SNAPSHOT_DEADLINE
    t0 = time.monotonic()
    try:
        answer = await asyncio.wait_for(client.index_snapshot(home, snapshot_id=capture.id, deadline=deadline),
                                        timeout=deadline + 15)
        why = ""
    except Exception as exc:  # noqa: BLE001 - the upload is still the way; said in the event
        answer, why = {}, f"{type(exc).__name__}: {exc}"
    await core.record(core.event(parent.id, "fork", outcome="handed_over" if not why else "handoff_skipped",
                                 started_at=started, duration_ms=core.ms(t0), actor=actor, message=why,
                                 details={**details, "timings": answer.get("timings") or {},
                                          "chunks": answer.get("chunks")}))
    return not why


async def _store(parent: Sandbox, capture, home, started, details, actor: str) -> LifecycleError | None:
    """The parent's node stores the capture (``commit_snapshot``: the upload); None once it
    is in the store, else the error (recorded on the parent: the other nodes' children fail)."""
    client, _ = core.node_api()
    deadline = settings.AENV_SNAPSHOT_DEADLINE
    t0 = time.monotonic()
    call = asyncio.ensure_future(asyncio.wait_for(client.commit_snapshot(home, snapshot_id=capture.id,
                                                                         deadline=deadline), timeout=deadline + 15))
    watch = asyncio.ensure_future(_node_gone(home))
    try:
        await asyncio.wait({call, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not call.done():  # a restarted or dead node never answers the task: no need to wait for the deadline
            raise client.NodeUnavailable(f"node {home.id} {watch.result()} while it stored the capture")
        answer = call.result()
    except Exception as exc:  # noqa: BLE001 - mapped; the parent's node's children are unaffected
        error = core.node_failure(client, exc, home, "storing of the fork's capture", deadline)
        error.message = f"the fork's capture could not be stored for the other nodes: {error.message}"
        await core.record(core.event(parent.id, "fork", outcome="error", started_at=started,
                                     duration_ms=core.ms(t0), actor=actor, message=error.message,
                                     details={**details, "kind": error.kind, "phase": "store"}))
        return error
    finally:
        for task in (call, watch):
            task.cancel()
    await core.record(core.event(parent.id, "fork", outcome="stored", started_at=started, duration_ms=core.ms(t0),
                                 actor=actor, details={**details, "timings": (answer or {}).get("timings") or {}}))
    return None


async def _node_gone(node) -> str:
    """Returns (saying how) once ``node``'s worker restarted (it registered again) or its
    heartbeat stopped; until then it watches."""
    while True:
        await asyncio.sleep(core.WATCH_POLL)
        await core.release_connection()
        row = await Node.objects.filter(pk=node.pk).afirst()
        if row is None or row.started_at != node.started_at:
            return "restarted"
        if not row.is_alive():
            return "stopped beating"


async def _capture(parent: Sandbox, children: list[Sandbox], capture, home, t0, started, details,
                   actor: str) -> dict:
    """The parent's node takes the capture (``snapshot_sandbox`` without its upload: the parent
    pauses only for the capture). Returns the node's answer, or raises after failing the
    parent (as a fork), every child and the capture."""
    client, _ = core.node_api()
    deadline = settings.AENV_SNAPSHOT_DEADLINE
    try:
        # A kill of the parent meanwhile still needs the node's answer (its children are
        # kept); any other move is a restarted node's reconcile, answered at once.
        result = await core.await_node(asyncio.wait_for(
            client.snapshot_sandbox(home, sandbox_id=parent.id, snapshot_id=capture.id, memory=True,
                                    commit=False, deadline=deadline),
            timeout=deadline + 15,
        ), parent.id, S.FORKING, tolerate=(S.KILLING, S.KILLED))
    except core.Moved as moved:
        reason = f"fork of sandbox {parent.id} was interrupted (node restarted); the parent is {moved.state}"
        await core.record(core.event(parent.id, "fork", outcome="aborted", from_state=S.FORKING,
                                     started_at=started, duration_ms=core.ms(t0), actor=actor, message=reason,
                                     details=details))
        await _fail_all(parent, children, capture, reason, "NodeRestarted", t0, started, details, actor)
        raise Unavailable(reason) from None
    except Exception as exc:  # no child is served
        # The node answered: the driver continued the parent and removed the partial capture.
        # No answer: the parent's VM is in an unknown state and is removed, as after a failed fork.
        error, vm_runs, moved = await fail_capture(client, exc, home, parent.id, "fork", S.FORKING,
                                                   details=details, started=started, t0=t0, actor=actor,
                                                   deadline=deadline)
        if moved and not vm_runs:
            cleanup = await core.kill_on_node(home, parent.id, core.CLEANUP_DEADLINE)
            await core.record(core.event(parent.id, "fork", outcome="cleanup", from_state=S.ERROR,
                                         to_state=S.ERROR, actor=actor, details={**details, "cleanup": cleanup}))
        if not vm_runs:
            await delete_files_quietly(home, capture.id)
        await _fail_all(parent, children, capture, error.message, error.kind, t0, started, details, actor)
        raise error from exc
    await snapshot_transitions.transition(capture.pk, "complete", actor=actor,
                                          details={"sandbox": parent.id, "fork": True,
                                                   "size_bytes": int(result.get("size_bytes") or 0)},
                                          manifest=result.get("manifest") or {},
                                          size_bytes=int(result.get("size_bytes") or 0))
    return result


async def _fail_all(parent, children, capture, reason: str, kind: str, t0, started, details, actor) -> None:
    """The capture failed: each child (no VM was started for any) ends ``error``, and the
    capture's row too (the sweeper removes it with whatever files are left)."""
    for child in children:
        failed = core.event(child.id, "create", outcome="error", from_state=S.CREATING, started_at=started,
                            duration_ms=core.ms(t0), message=reason, actor=actor,
                            details={"forked_from": parent.id, "capture": capture.id, "kind": kind})
        if not await core.transition(child.id, [S.CREATING], S.ERROR, failed, error_reason=reason):
            await core.record(failed)
    await snapshot_transitions.transition(capture.pk, "fail", actor=actor, message=reason, details=details,
                                          error_reason=reason)


async def _child(child: Sandbox, node, capture, timeout: int, t0, started, actor: str, pending_wait: float = 0.0):
    """One child restored from the capture on its node, then ended by ``finish_child``."""
    result = await _restore(child, node, capture, pending_wait)
    return await finish_child(child, result, node, timeout, t0, started, actor)


async def _restore(child: Sandbox, node, capture, pending_wait: float = 0.0) -> dict:
    """One child restored from the capture on its node: the node's answer ``{"ok": True, …}``,
    or ``{"ok": False, "kind", "message"}`` (whatever the node started is removed). Its row's
    clock for the nodes' stale-row reconcile starts now (it waited for the capture, and on
    another node for the upload or the hand-off)."""
    client, _ = core.node_api()
    await Sandbox.objects.filter(pk=child.id, state=S.CREATING).aupdate(updated_at=timezone.now())
    volumes = await sync_to_async(mounts.node_volumes)(child.id)  # the parent's, mounted in the capture
    try:
        answer = await core.await_node(asyncio.wait_for(
            client.restore_sandbox(
                node, sandbox_id=child.id, snapshot_id=capture.id, env_vars=child.env_vars,
                access_token=child.envd_access_token or None, source_token=capture.envd_access_token or None,
                network=network.spec_of(child), template=False, **({"volumes": volumes} if volumes else {}),
                **({"pending_wait": pending_wait} if pending_wait else {})),
            timeout=settings.AENV_NODE_TASK_DEADLINE + 15,
        ), child.id, S.CREATING, tolerate=(S.KILLING, S.KILLED))
        result = {"ok": True, **answer}
    except core.Moved as moved:  # a restarted node reconciled it (and removes what was started)
        result = {"ok": False, "kind": "NodeRestarted",
                  "message": f"node {node.id} restarted while the child was restored (now {moved.state})"}
    except Exception as exc:  # mapped for the child alone; its siblings go on
        error = core.node_failure(client, exc, node, "fork child's restore", settings.AENV_NODE_TASK_DEADLINE)
        if not isinstance(exc, (client.NodeError, asyncio.TimeoutError)):
            log.exception("unexpected error restoring fork child %s", child.id)
        # whatever the node may have started is removed, answered or not (as a failed create)
        cleanup = await core.kill_on_node(node, child.id, core.CLEANUP_DEADLINE)
        result = {"ok": False, "kind": error.kind, "message": str(exc) or error.message, "cleanup": cleanup}
    return result
