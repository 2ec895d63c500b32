"""Pause, resume, connect and the data plane's auto-resume.

- pause: ``running → pausing`` (durable), the node saves the VM to disk (its QEMU process
  exits), ``→ paused``; a concurrent pause is joined. ``memory=False`` is E2B's
  filesystem-only pause (only the disk is kept; a resume cold-boots on it).
- resume / connect / auto-resume: ``paused → resuming → running``; a connect to a running
  sandbox only extends its TTL. A failed resume leaves the memory snapshot ``paused``.
"""
from __future__ import annotations

import asyncio
import logging
import time
from datetime import datetime, timedelta

from asgiref.sync import sync_to_async
from django.conf import settings
from django.utils import timezone

from nodes import protocol

from sandboxes.models import Sandbox, Team
from sandboxes.transitions import transition_sync
from lifecycle.sandboxes import core, network
from lifecycle.volumes import mounts
from lifecycle.sandboxes.core import S, Result
from sandboxes.errors import GUEST_UNRESPONSIVE_CODE, MEMORY_LOST, MEMORY_LOST_CODE, Conflict, NoRoom, NotFound, Unavailable
from lifecycle.sandboxes.ttl import set_end_at

log = logging.getLogger(__name__)


async def pause_sandbox(team: Team, sandbox_id: str, memory: bool | None = None, actor: str = "", *,
                        expired_by: datetime | None = None, require_healthy_guest: bool = False) -> Result:
    """Pauses a running sandbox: ``running → pausing`` (durable), the node saves the VM
    to disk (its QEMU process exits), ``→ paused``. ``memory=False`` is E2B's
    filesystem-only pause (only the disk is kept; a resume cold-boots on it).

    The node first asks the guest agent (envd) whether it answers. If not: with
    ``require_healthy_guest`` (SDK ``pause(strict=True)``) or a filesystem-only pause,
    nothing is paused (503, the sandbox keeps running); otherwise the memory is kept
    anyway and the pause marked (``envd_unresponsive_at_pause``), so that only a reboot
    resume (``memory: false``) brings it back.

    A pause already in progress is joined (the answer comes when it is paused). Not
    running: 409; unknown: 404; node not alive: 503 and nothing changes.

    ``expired_by`` is the lifecycle sweeper's TTL pause: it happens only while the
    sandbox is running with ``end_at <= expired_by`` (a concurrent timeout extension
    wins), and never joins; otherwise 409."""
    while True:
        sandbox = await core.visible(team, sandbox_id)
        if sandbox.state == S.PAUSING and expired_by is None:
            sandbox = await core.settle(team, sandbox_id)
            if sandbox.state == S.PAUSED:
                return Result(sandbox)  # joined the concurrent pause
            raise core.not_running(sandbox_id, sandbox.state)
        if sandbox.state != S.RUNNING:
            raise core.not_running(sandbox_id, sandbox.state)
        node = await core.node_of(sandbox)
        if not node.is_alive():
            raise Unavailable(f"node {node.id} is not alive (no recent heartbeat); sandbox not paused")
        details = {"memory": memory}
        if expired_by is not None:
            details["reason"] = "expired"
        event = core.event(sandbox_id, "pause", outcome="started", from_state=S.RUNNING, actor=actor, details=details)
        where = {"end_at__lte": expired_by} if expired_by is not None else None
        # Shielded from the move to ``pausing`` on: a client gone mid-way never leaves it
        # ``pausing`` with nothing pausing it.
        paused = await core.shielded(_begin_and_pause(sandbox, node, event, where, memory, actor,
                                                      require_healthy_guest))
        if paused is not None:
            return paused
        if expired_by is not None:  # else another request changed it meanwhile: look again
            raise Conflict(f'sandbox "{sandbox_id}" is no longer running and expired')


async def _begin_and_pause(sandbox: Sandbox, node, event, where, memory, actor: str,
                           require_healthy_guest: bool) -> Result | None:
    """``running → pausing``, then the pause on its node; None when another request changed
    the sandbox first."""
    if not await core.transition(sandbox.id, [S.RUNNING], S.PAUSING, event, where=where):
        return None
    return await _pause_on_node(sandbox, node, memory, actor, require_healthy_guest)


async def _pause_on_node(sandbox: Sandbox, node, memory: bool | None, actor: str,
                         require_healthy_guest: bool = False) -> Result:
    client, _ = core.node_api()
    deadline = settings.AENV_LIFECYCLE_DEADLINE
    t0, started = time.monotonic(), timezone.now()
    fs_only = memory is False
    mode = "filesystem" if fs_only else "memory"
    details = {"node": node.id, "to_disk": True, "memory": memory, "mode": mode}
    strict = {"require_healthy_guest": True} if require_healthy_guest else {}
    if strict:
        details["require_healthy_guest"] = True
    try:
        result = await core.await_node(asyncio.wait_for(
            client.pause_sandbox(node, sandbox_id=sandbox.id, to_disk=True, memory=not fs_only,
                                 deadline=deadline, **strict),
            timeout=deadline + 15,
        ), sandbox.id, S.PAUSING)
    except core.Moved as moved:
        if moved.state == S.PAUSED:  # the node reconciled it: the pause had finished
            return Result(await core.reload(sandbox))
        await core.record(core.event(sandbox.id, "pause", outcome="aborted", from_state=S.PAUSING, started_at=started,
                                     duration_ms=core.ms(t0), actor=actor, details=details,
                                     message=f"sandbox became {moved.state} while pausing"))
        if moved.state == S.RUNNING:
            raise Conflict(f'pause of sandbox "{sandbox.id}" was interrupted (node restarted); '
                           "it is running") from None
        raise NotFound(f'sandbox "{sandbox.id}" not found (killed while pausing)') from None
    except Exception as exc:  # mapped below, never a bare 500
        error = core.node_failure(client, exc, node, "pause", deadline)
        reason, kind = error.message, error.kind
        log.warning("pause of sandbox %s failed: %s", sandbox.id, reason)
        details = {**details, "kind": kind}
        if isinstance(exc, client.NodeTaskFailed):
            # The node answered: the QEMU driver continues the VM when saving fails (and a
            # revoked task never touched it), so the sandbox is running again.
            event = core.event(sandbox.id, "pause", outcome="error", from_state=S.PAUSING, started_at=started,
                               duration_ms=core.ms(t0), message=reason, actor=actor, details=details)
            if not await core.transition(sandbox.id, [S.PAUSING], S.RUNNING, event):
                await core.record(event)  # killed meanwhile
        else:
            # No answer (timeout, broker gone): the VM may be running, paused or mid-save.
            # Guessing would be wrong half the time, so the sandbox stays "pausing" (shown
            # paused; connect waits) and the node reconciles it to the VM's real state when
            # it answers again (agent.reconcile) — the VM is not killed.
            await core.record(core.event(sandbox.id, "pause", outcome="unconfirmed", from_state=S.PAUSING,
                                         started_at=started, duration_ms=core.ms(t0), message=reason, actor=actor,
                                         details=details))
        raise error from exc

    timings = (result or {}).get("timings") or {}
    phases = core.op_phases(t0, timings.get("total_ms"))
    unresponsive = bool((result or {}).get("envd_unresponsive")) and not fs_only
    if unresponsive:
        details["envd_unresponsive"] = True
    event = core.event(sandbox.id, "pause", from_state=S.PAUSING, started_at=started, duration_ms=core.ms(t0),
                       actor=actor, details={**details, "timings": timings, "phases": phases})
    paused = await core.transition_row(sandbox.id, [S.PAUSING], S.PAUSED, event,
                                       envd_unresponsive_at_pause=unresponsive)
    if paused is None:
        await core.record(core.event(sandbox.id, "pause", outcome="aborted", from_state=S.PAUSING, started_at=started,
                                     duration_ms=core.ms(t0), actor=actor, message="sandbox was killed while pausing",
                                     details=details))
        raise NotFound(f'sandbox "{sandbox.id}" not found (killed while pausing)')
    return Result(paused, phases)


async def resume_sandbox(team: Team, sandbox_id: str, timeout: int | None = None, actor: str = "") -> Result:
    """v1 resume: ``paused → resuming → running`` with ``end_at = now + timeout``.
    Already running: 409; unknown or killed: 404. A pause in progress is waited for."""
    timeout = settings.AENV_DEFAULT_TIMEOUT if timeout is None else timeout
    resumed, result = await _resume_or_running(team, sandbox_id, timeout, actor, operation="resume")
    if not resumed:
        raise Conflict(f'sandbox "{sandbox_id}" is already running')
    return result


async def connect_sandbox(team: Team, sandbox_id: str, timeout: int | None = None,
                          actor: str = "", memory: bool | None = None) -> tuple[bool, Result]:
    """Connect: a running sandbox only has its TTL extended (``end_at = max(end_at,
    now + timeout)``) → ``(False, result)``; a paused one is resumed → ``(True, result)``.
    ``memory=False`` (SDK ``on_resume="reboot"``) resumes a paused sandbox by a cold
    boot on its disk, ignoring its memory snapshot."""
    timeout = settings.AENV_DEFAULT_TIMEOUT if timeout is None else timeout
    resumed, result = await _resume_or_running(team, sandbox_id, timeout, actor, operation="connect",
                                               memory=memory)
    if not resumed:
        sandbox = result.sandbox
        end_at = max(sandbox.end_at, timezone.now() + timedelta(seconds=timeout))
        if end_at != sandbox.end_at:
            await set_end_at(sandbox, end_at, "connect", actor, {"timeout": timeout})
    return resumed, result


async def auto_resume(sandbox_id: str) -> Sandbox | None:
    """The data plane's autoResume: traffic reached a paused (or pausing / resuming)
    sandbox. If it was created with ``autoResume`` it is resumed exactly like a connect
    (same transitions, events and node calls; concurrent callers join one resume) with
    a TTL of at least AENV_AUTO_RESUME_TIMEOUT; returns it running. None when the
    sandbox is unknown, not paused, has no autoResume or was paused while its guest
    agent did not answer. Raises a LifecycleError on failure."""
    sandbox = await (Sandbox.objects.select_related("team")
                     .filter(pk=sandbox_id, state__in=[S.PAUSING, S.PAUSED, S.RESUMING]).afirst())
    if sandbox is None or not sandbox.auto_resume or sandbox.envd_unresponsive_at_pause or sandbox.memory_lost:
        return None  # (paused while its agent did not answer, or its memory lost: only an explicit reboot resume)
    _, running = await connect_sandbox(sandbox.team, sandbox_id, settings.AENV_AUTO_RESUME_TIMEOUT,
                                       actor="autoresume")
    return running.sandbox


class _Moved(Exception):
    """The row left ``paused`` between reading it and claiming a node for its resume."""


async def _resume_or_running(team, sandbox_id, timeout, actor, operation, memory=None) -> tuple[bool, Result]:
    """Settles the sandbox; a paused one is claimed for its resume (``paused → resuming``, on
    the node that will run it, through placement so a resume never over-commits a node): its
    own node, or — when that one is dead, drained or full and its pause was exported to the
    shared store (``Sandbox.pause_image_at``, agent.moves) — any node with room."""
    _, placement = core.node_api()
    while True:
        sandbox = await core.settle(team, sandbox_id)
        if sandbox.state == S.RUNNING:
            return False, Result(sandbox)
        if sandbox.state != S.PAUSED:
            raise Conflict(f'sandbox "{sandbox_id}" cannot be resumed (it is {sandbox.state})')
        if sandbox.envd_unresponsive_at_pause and memory is not False:
            raise Conflict(f'sandbox "{sandbox_id}" was paused while its guest agent (envd) was not responding: '
                           "restoring that memory would bring the unresponsive agent back; resume it without "
                           "memory (memory: false), which cold-boots it from its disk",
                           code=GUEST_UNRESPONSIVE_CODE, retry=False)
        if sandbox.memory_lost and memory is not False:
            raise Conflict(f'sandbox "{sandbox_id}" lost its memory when a resume failed after its guest had run; '
                           "its disk is kept: resume it without memory (memory: false), which cold-boots it "
                           "from its disk", code=MEMORY_LOST_CODE, retry=False)
        home = await core.node_of(sandbox)
        event = core.event(sandbox_id, "resume", outcome="started", from_state=S.PAUSED, actor=actor,
                           details={"via": operation, "timeout": timeout, "memory": memory})

        read = {}

        def claim(target, event=event, read=read) -> None:
            # resumed, its memory is its own: it reserves its whole shape (no fork child's charge)
            if not transition_sync(sandbox_id, [S.PAUSED], S.RESUMING, event, node=target,
                                   reserved_vcpus=None, reserved_memory_mb=None):
                raise _Moved
            # what the node is given, read in the placement's thread hop, not one of its own (issue 26)
            read["volumes"] = mounts.node_volumes(sandbox_id)

        try:
            # Shielded from the claim on: a client gone mid-way never leaves it ``resuming``
            # (its node's room reserved) with nothing resuming it.
            return True, await core.shielded(_claim_and_resume(placement, sandbox, home, claim, read, timeout, actor,
                                                               operation, memory))
        except _Moved:
            continue  # another request changed it meanwhile: look again


async def _claim_and_resume(placement, sandbox: Sandbox, home, claim, read: dict, timeout: int, actor: str,
                            operation: str, memory) -> Result:
    """The placement's claim (``paused → resuming`` on the node that will run it), then the
    resume there. _Moved when another request changed the sandbox first; NoRoom without room."""
    need = (sandbox.cpu_count, sandbox.memory_mb)
    try:
        node = await placement.place(*need, on=home, claim=claim)
    except placement.NoNodeAvailable as exc:
        if memory is False or sandbox.pause_image_at is None or not _shared_store():
            raise NoRoom(f'sandbox "{sandbox.id}" cannot be resumed now: {exc}; it stays paused '
                         "(its memory is on that node)") from None
        try:
            node = await placement.place(*need, claim=claim)  # moves: restored from the store
        except placement.NoNodeAvailable as elsewhere:
            raise NoRoom(f'sandbox "{sandbox.id}" cannot be resumed now: {exc}, and {elsewhere}; '
                         "it stays paused") from None
    core.fresh(node)  # the claim's row, read in its transaction: sent to without a second read
    return await _resume_on_node(sandbox, node, timeout, actor, operation, memory, home=home,
                                 volumes=read.get("volumes"))


def _shared_store() -> bool:
    return settings.AENV_SNAPSHOT_BACKEND == "s3"


async def _resume_on_node(sandbox: Sandbox, node, timeout: int, actor: str, operation: str,
                          memory: bool | None = None, home=None, volumes: list[dict] | None = None) -> Result:
    """Resumes it on ``node``: its own (the driver continues the saved VM), or another one
    (``home`` is its own): that node restores the pause image from the store under the same
    id, with the same envd token. A failure leaves it paused, on its own node. ``volumes``:
    its mounts for the node if the caller read them already."""
    client, _ = core.node_api()
    deadline = settings.AENV_LIFECYCLE_DEADLINE
    t0, started = time.monotonic(), timezone.now()
    home = home or node
    moving = node.pk != home.pk
    details = {"node": node.id, "via": operation, "timeout": timeout}
    reboot = {"memory": False} if memory is False else {}
    if reboot:
        details["mode"] = "reboot"
    if moving:
        details.update(mode="moved", from_node=home.pk)
    token = sandbox.envd_access_token or None
    if volumes is None:
        volumes = await sync_to_async(mounts.node_volumes)(sandbox.id)
    if volumes:
        reboot = {**reboot, "volumes": volumes}  # its new slot's server (the guest has them mounted)
    try:
        result = await core.await_node(asyncio.wait_for(
            client.restore_sandbox(node, sandbox_id=sandbox.id, snapshot_id=protocol.pause_image_of(sandbox.id),
                                   env_vars=sandbox.env_vars, access_token=token, source_token=token,
                                   network=network.spec_of(sandbox), template=True, deadline=deadline,
                                   **({"volumes": volumes} if volumes else {}))
            if moving else
            client.resume_sandbox(node, sandbox_id=sandbox.id, env_vars=sandbox.env_vars,
                                  access_token=token, deadline=deadline,
                                  network=network.spec_of(sandbox), **reboot),
            timeout=deadline + 15,
        ), sandbox.id, S.RESUMING)
    except core.Moved as moved:
        if moved.state == S.RUNNING:  # reconciled by the node: the resume had finished
            return Result(await core.reload(sandbox))
        await core.record(core.event(sandbox.id, "resume", outcome="aborted", from_state=S.RESUMING, started_at=started,
                                     duration_ms=core.ms(t0), actor=actor, details=details,
                                     message=f"sandbox became {moved.state} while resuming"))
        if moved.state == S.PAUSED:
            raise Unavailable(f'resume of sandbox "{sandbox.id}" was interrupted (node restarted); '
                              "it is still paused") from None
        raise NotFound(f'sandbox "{sandbox.id}" not found (killed while resuming)') from None
    except Exception as exc:  # mapped below
        error = core.node_failure(client, exc, node, "resume", deadline)
        reason, kind = error.message, error.kind
        log.warning("resume of sandbox %s failed, it stays paused: %s", sandbox.id, reason)
        # The node re-pauses a VM whose envd did not come back; the memory snapshot is
        # still there, so the sandbox stays paused and a later connect can try again. If
        # the node never answered and resumes it later anyway, its reconcile pauses it again.
        lost = {"memory_lost": True} if kind in MEMORY_LOST and not moving else {}
        event = core.event(sandbox.id, "resume", outcome="error", from_state=S.RESUMING, started_at=started,
                           duration_ms=core.ms(t0), message=reason, actor=actor,
                           details={**details, "kind": kind, **lost})
        if not await core.transition(sandbox.id, [S.RESUMING], S.PAUSED, event, node=home, **lost):
            await core.record(event)
        if moving:  # whatever the other node started of it is not the sandbox
            await core.kill_on_node(node, sandbox.id, core.CLEANUP_DEADLINE)
        raise error from exc

    timings = result.get("timings") or {}
    node_ms = float(timings.get("total_ms", 0)) + float(timings.get("init", 0)) if timings else None
    phases = core.op_phases(t0, node_ms)
    now = timezone.now()
    event = core.event(sandbox.id, "resume", from_state=S.RESUMING, started_at=started, duration_ms=core.ms(t0),
                       actor=actor, details={**details, "pid": result.get("pid"), "timings": timings, "phases": phases})
    running = await core.transition_row(sandbox.id, [S.RESUMING], S.RUNNING, event, envd_host=result["envd_host"],
                                        envd_port=result["envd_port"], guest_host=result.get("guest_host") or "",
                                        end_at=now + timedelta(seconds=timeout), pause_image_at=None,
                                        envd_unresponsive_at_pause=False, memory_lost=False)
    if running is None:
        cleanup = await core.kill_on_node(node, sandbox.id, core.CLEANUP_DEADLINE)
        await core.record(core.event(sandbox.id, "resume", outcome="aborted", from_state=S.RESUMING, started_at=started,
                                     duration_ms=core.ms(t0), actor=actor, message="sandbox was killed while resuming",
                                     details={**details, "cleanup": cleanup}))
        raise NotFound(f'sandbox "{sandbox.id}" not found (killed while resuming)')
    return Result(running, phases)
