"""Create: a new sandbox booted from a template, or restored from a snapshot.

``creating`` is inserted (with an Idempotency-Key, a retried create returns the same
sandbox), placement picks the node (a snapshot's node for a restore), the node boots or
restores the VM, then ``→ running``. The boot runs shielded: a client that goes away
mid-boot still leaves the sandbox ``running`` or ``error``, never a VM nobody knows about.
"""
from __future__ import annotations

import asyncio
import logging
import time
from datetime import timedelta

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import IntegrityError
from django.utils import timezone

from lifecycle import sources
from lifecycle import resolve

from sandboxes.models import Sandbox, SandboxEvent, Team, new_envd_access_token
from sandboxes.transitions import insert_creating
from lifecycle.sandboxes import core, network
from lifecycle.sandboxes.core import S, Result
from sandboxes.errors import (BUSY_NODE, FULL_NODE, REFUSED_BY_NODE, Conflict, Failed, Invalid, LifecycleError, NoRoom, Timeout,
                              Unavailable)
from lifecycle.sandboxes.options import SandboxOptions
from lifecycle.volumes import mounts

log = logging.getLogger(__name__)


async def create_sandbox(team: Team, template_ref: str, options: SandboxOptions | None = None, *,
                         timeout: int | None = None, idempotency_key: str | None = None,
                         actor: str = "", volume_mounts: list | None = None) -> Result:
    """Creates and boots a sandbox; returns it running, or raises a LifecycleError
    (failed creates are not worth retrying: ``retry`` is False). ``volume_mounts``: E2B's
    ``volumeMounts`` as sent (checked here: the team's volumes, clean paths)."""
    options = options or SandboxOptions()
    timeout = settings.AENV_DEFAULT_TIMEOUT if timeout is None else timeout
    network.spec_of(options)  # a policy the node could not be given is Invalid before anything exists
    # none asked for: nothing to read (a thread hop less for most creates, issue 26)
    requested = [] if volume_mounts is None else await sync_to_async(mounts.check)(team, volume_mounts)
    # A snapshot of the team, or a template (its ready build's result, or its image): spec §5.5.
    source = await resolve.resolve_source(team, template_ref)
    template, snapshot = source.template, source.snapshot
    inherited = [] if snapshot is None else await sync_to_async(mounts.of_snapshot)(snapshot.id)
    volumes = mounts.merged(inherited, requested)
    mounts.check_transport(volumes)
    # what the node serves, and what the guest must still mount (a restored memory has the rest)
    to_node = mounts.for_node(volumes, to_mount=[m for m in volumes if m not in inherited])

    now = timezone.now()
    fields = dict(
        team=team, template=template, alias=template.alias, envd_version=source.envd_version,
        envd_access_token=new_envd_access_token() if options.secure else "",
        traffic_access_token=network.traffic_access_token_for(options.network),
        cpu_count=source.cpu_count, memory_mb=source.memory_mb, disk_size_mb=source.disk_size_mb,
        idempotency_key=idempotency_key or "", created_at=now, started_at=now,
        end_at=now + timedelta(seconds=timeout), **options.fields(),
    )
    if snapshot is not None:
        # A restore: the snapshot's size and envd; a secure source's envd is handed to a token of its own.
        fields.update(source_snapshot=snapshot, cpu_count=snapshot.cpu_count, memory_mb=snapshot.memory_mb,
                      disk_size_mb=snapshot.disk_size_mb, envd_version=snapshot.envd_version)
        if snapshot.memory and snapshot.envd_access_token:
            fields.update(secure=True, envd_access_token=new_envd_access_token())
    build = source.build.pk if source.build is not None else None
    # From the row's insert on, shielded: a client gone mid-way never leaves a row in
    # ``creating`` (with its node's room reserved) that nothing boots
    return await core.shielded(_insert_and_boot(fields, actor, build, source.image, timeout, snapshot, volumes,
                                                to_node))


async def _insert_and_boot(fields: dict, actor: str, build, image: str, timeout: int, snapshot, volumes: list,
                           to_node: list[dict]) -> Result:
    placed = await _insert_placed(fields, actor, build) if snapshot is None else None
    if placed is not None:
        sandbox = placed.sandbox
    else:
        sandbox, replayed = await _insert(fields, actor, build)
        if replayed:
            return Result(await _replay(sandbox))
    if volumes:
        await _record_mounts(sandbox, volumes, actor)
    return await _boot(sandbox, image, timeout, actor, snapshot, to_node, placed)


def _started(fields: dict, actor: str, build) -> SandboxEvent:
    """A create's first event (``started``), what the insert records with the row."""
    details = {"template": fields["template"].id, "idempotency_key": fields["idempotency_key"]}
    if build is not None:
        details["build"] = str(build)
    return core.event("", "create", outcome="started", actor=actor, details=details)


class _Placed:
    """A ``creating`` row inserted with its node already chosen (``_insert_placed``)."""

    def __init__(self, t0: float, started):
        self.t0, self.started = t0, started
        self.sandbox: Sandbox | None = None
        self.node = None


async def _insert_placed(fields: dict, actor: str, build=None) -> _Placed | None:
    """The ``creating`` row and its event inserted by the placement's claim, in its
    transaction: the row is born with its node (its reservation), one database round and
    thread hop fewer than an insert and then a claim (issue 26). None when that is not how it
    goes (no room, an Idempotency-Key already used, placement broke): the caller takes the
    two-step way, which records a refusal on the row and replays a repeated create."""
    _, placement = core.node_api()
    placed = _Placed(time.monotonic(), timezone.now())

    def claim(node) -> None:
        placed.sandbox = insert_creating(_started(fields, actor, build), node=node, **fields)

    try:
        node = await placement.place(fields["cpu_count"], fields["memory_mb"], claim=claim)
    except Exception:  # noqa: BLE001 - nothing of it stays; the two-step way decides and records
        return None
    placed.node = core.fresh(node)
    return placed


@sync_to_async
def _insert(fields: dict, actor: str, build=None) -> tuple[Sandbox, bool]:
    """Inserts the ``creating`` row and its event → (sandbox, False); with an
    Idempotency-Key already used by this team → (the earlier sandbox, True)."""
    key = fields["idempotency_key"]
    window = timedelta(seconds=settings.AENV_IDEMPOTENCY_WINDOW)
    for _ in range(3):
        try:
            return insert_creating(_started(fields, actor, build), **fields), False
        except IntegrityError:
            if not key:
                raise
        earlier = Sandbox.objects.filter(team=fields["team"], idempotency_key=key).first()
        if earlier is None:
            continue  # released meanwhile; try again
        if earlier.state != S.ERROR and earlier.created_at >= timezone.now() - window:
            return earlier, True
        # A failed or expired earlier create does not pin the key: release it (the
        # key stays in that sandbox's create event) and create a new sandbox.
        Sandbox.objects.filter(pk=earlier.pk, idempotency_key=key).update(idempotency_key="")
    raise Conflict("Idempotency-Key is in use by a concurrent request")


async def _record_mounts(sandbox: Sandbox, volumes: list, actor: str) -> None:
    """The sandbox's volume rows (what makes its volumes "in use"); a volume deleted since
    the check fails the create (a 409), never a sandbox without its mount."""
    try:
        await sync_to_async(mounts.record_sandbox)(sandbox.id, volumes)
    except IntegrityError:
        reason = "a volume it mounts was deleted while the sandbox was being created"
        await _fail(sandbox, reason, time.monotonic(), timezone.now(), actor, node=None, kind="VolumeDeleted")
        raise Conflict(reason, retry=False) from None


async def _replay(sandbox: Sandbox) -> Sandbox:
    """The answer to a repeated create: waits while the first request is still
    booting, then returns the same sandbox (or the same kind of failure)."""
    deadline = time.monotonic() + settings.AENV_NODE_TASK_DEADLINE + 30
    while sandbox.state == S.CREATING and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        sandbox = await Sandbox.objects.aget(pk=sandbox.pk)
    if sandbox.state == S.CREATING:
        raise Timeout(f'sandbox "{sandbox.id}" is still being created', retry=False)
    if sandbox.state == S.ERROR:
        raise Failed(f'sandbox "{sandbox.id}" failed to start: {sandbox.error_reason}', retry=False)
    return sandbox


class _KilledMeanwhile(Conflict):
    """The sandbox left ``creating`` (a kill) before its placement was claimed."""


def _reserve(sandbox: Sandbox):
    """The placement's claim: the row names its node (its reservation) while still creating;
    a kill meanwhile makes it a Conflict (and the placement leaves nothing)."""
    def claim(node) -> None:
        if not Sandbox.objects.filter(pk=sandbox.pk, state=S.CREATING).update(node=node):
            raise _KilledMeanwhile(f'sandbox "{sandbox.id}" was killed while it was being created', retry=False)
    return claim


async def _place(sandbox: Sandbox, snapshot, t0: float, started, actor: str):
    _, placement = core.node_api()
    try:
        if snapshot is not None:  # a restore runs where the snapshot's files are
            return core.fresh(await sources.restore_node(snapshot, claim=_reserve(sandbox)))
        # the claim's row: read in its transaction a moment ago, sent to without a second read
        return core.fresh(await placement.place(sandbox.cpu_count, sandbox.memory_mb, claim=_reserve(sandbox)))
    except _KilledMeanwhile:
        raise  # the kill owns the row now
    except LifecycleError as exc:
        await _fail(sandbox, exc.message, t0, started, actor, node=None, kind="SnapshotUnavailable")
        exc.retry = False
        raise
    except placement.NoNodeAvailable as exc:
        reason = f"no node available with {sandbox.cpu_count} vCPU and {sandbox.memory_mb} MB free"
        if str(exc):
            reason += f" ({exc})"
        await _fail(sandbox, reason, t0, started, actor, node=None, kind="NoNodeAvailable")
        raise NoRoom(reason, retry=False) from exc
    except Exception as exc:  # placement itself broke: still never leave "creating"
        reason = f"placement failed: {exc}"
        await _fail(sandbox, reason, t0, started, actor, node=None, kind=type(exc).__name__)
        raise Unavailable(reason, retry=False) from exc


async def _boot(sandbox: Sandbox, image: str, timeout: int, actor: str, snapshot=None,
                volumes: list[dict] | None = None, placed: _Placed | None = None) -> Result:
    client, _ = core.node_api()
    if placed is not None:  # inserted with its node
        t0, started, node = placed.t0, placed.started, placed.node
    else:
        t0 = time.monotonic()
        started = timezone.now()
        node = await _place(sandbox, snapshot, t0, started, actor)  # the row names its node now (its claim)
    t_scheduled = time.monotonic()
    spec = network.spec_of(sandbox)
    try:
        result = await core.await_node(asyncio.wait_for(
            client.boot_sandbox(
                node, sandbox_id=sandbox.id, image=image, cpu_count=sandbox.cpu_count,
                memory_mb=sandbox.memory_mb, disk_size_mb=sandbox.disk_size_mb,
                env_vars=sandbox.env_vars, access_token=sandbox.envd_access_token or None, network=spec,
                **({"volumes": volumes} if volumes else {}),
            ) if snapshot is None else client.restore_sandbox(
                node, sandbox_id=sandbox.id, snapshot_id=snapshot.id, env_vars=sandbox.env_vars,
                access_token=sandbox.envd_access_token or None, source_token=snapshot.envd_access_token or None,
                network=spec, template=snapshot.build_result, **({"volumes": volumes} if volumes else {}),
            ),
            # The node client enforces AENV_NODE_TASK_DEADLINE; this is only a backstop.
            timeout=settings.AENV_NODE_TASK_DEADLINE + 15,
        ), sandbox.id, S.CREATING, tolerate=(S.KILLING, S.KILLED))
    except core.Moved as moved:
        # A restarted node worker reconciled the row (creating → error) and owns the
        # cleanup of whatever VM was half-booted, or the sweeper declared the silent node's
        # sandbox lost: answer now, not at the deadline, saying which.
        why = moved.reason or "the node restarted while the sandbox was being created"
        reason = f"node {node.id}: {why} (now {moved.state})"
        await core.record(core.event(sandbox.id, "create", outcome="error", from_state=S.CREATING,
                                     started_at=started, duration_ms=core.ms(t0), actor=actor, message=reason,
                                     details={"node": node.id}))
        raise Unavailable(reason, retry=False) from None
    except Exception as exc:  # mapped to a domain error, never bare
        error, kind = _boot_failure(client, exc, node)
        if not isinstance(exc, (client.NodeError, asyncio.TimeoutError)):  # a bug or an unexpected answer
            log.exception("unexpected error booting sandbox %s", sandbox.id)
        await _fail(sandbox, error.message, t0, started, actor, node=node, kind=kind)
        raise error from exc

    phases = create_phases(t0, t_scheduled, time.monotonic(), result.get("timings") or {})
    now = timezone.now()
    done = core.event(
        sandbox.id, "create", from_state=S.CREATING, started_at=started, duration_ms=core.ms(t0), actor=actor,
        details={"node": node.id, "accel": result.get("accel"), "pid": result.get("pid"),
                 "timings": result.get("timings") or {}, "phases": phases},
    )
    running = await core.transition_row(
        sandbox.id, [S.CREATING], S.RUNNING, done, node=node,
        envd_host=result["envd_host"], envd_port=result["envd_port"], guest_host=result.get("guest_host") or "",
        started_at=now, end_at=now + timedelta(seconds=timeout),
    )
    if running is None:
        # Killed while booting: the kill could not reach a VM that did not exist yet.
        cleanup = await core.kill_on_node(node, sandbox.id, core.CLEANUP_DEADLINE)
        await core.record(core.event(sandbox.id, "create", outcome="aborted", from_state=S.CREATING,
                                     started_at=started, duration_ms=core.ms(t0), actor=actor,
                                     message="sandbox was killed while it was being created",
                                     details={"node": node.id, "cleanup": cleanup}))
        raise Conflict(f'sandbox "{sandbox.id}" was killed while it was being created', retry=False)
    return Result(running, phases)


def _boot_failure(client, exc: BaseException, node) -> tuple[LifecycleError, str]:
    """(domain error, kind) of a failed boot or restore; never worth a retry."""
    if isinstance(exc, (client.NodeTimeout, asyncio.TimeoutError)):
        return Timeout(f"node {node.id} did not finish booting within {settings.AENV_NODE_TASK_DEADLINE} s",
                       retry=False), "NodeTimeout"
    if isinstance(exc, client.NodeUnavailable):
        return Unavailable(f"node {node.id} is unavailable: {exc}", retry=False), "NodeUnavailable"
    kind = (getattr(exc, "kind", "") or "NodeTaskFailed") if isinstance(exc, client.NodeTaskFailed) \
        else type(exc).__name__
    code = core.snake(kind) if isinstance(exc, client.NodeTaskFailed) else None
    if code and kind in REFUSED_BY_NODE:
        return Invalid(f"node {node.id} cannot start this sandbox: {exc}", code=code, retry=False), kind
    if code and kind in FULL_NODE:
        return NoRoom(f"node {node.id} has no room for this sandbox now: {exc}", retry=False), kind
    if code and kind in BUSY_NODE:
        return NoRoom(f"node {node.id} is too busy to start this sandbox now (undone): {exc}", retry=False), kind
    return Failed(f"boot failed on node {node.id}: {kind}: {exc}", code=code, retry=False), kind


def create_phases(t0: float, t_scheduled: float, t_done: float, node_timings: dict) -> dict:
    """Splits a create into phases (ms) for the Server-Timing header and the event:
    schedule (placement), dispatch (Celery there and back, node bookkeeping),
    disk (top layer), spawn (QEMU start), boot (spawn → envd /health), init (envd /init)."""
    roundtrip = (t_done - t_scheduled) * 1000
    node_ms = float(node_timings.get("total_ms", 0)) + float(node_timings.get("init", 0))
    phases = {"schedule": (t_scheduled - t0) * 1000, "dispatch": max(roundtrip - node_ms, 0.0),
              "disk": node_timings.get("disk_ms"), "spawn": node_timings.get("spawn_ms"),
              "boot": node_timings.get("envd_ms"), "init": node_timings.get("init"),
              "total": (t_done - t0) * 1000}
    return {k: round(float(v), 2) for k, v in phases.items() if v is not None}


async def _fail(sandbox, reason, t0, started, actor, *, node, kind) -> None:
    """Marks a failed create ``error`` (with reason and event) and removes whatever
    the node may have started, so a failure never leaks a VM."""
    cleanup = await core.kill_on_node(node, sandbox.id, core.CLEANUP_DEADLINE) if node is not None else None
    failed = core.event(sandbox.id, "create", outcome="error", from_state=S.CREATING, started_at=started,
                        duration_ms=core.ms(t0), message=reason, actor=actor,
                        details={"kind": kind, "node": getattr(node, "id", None), "cleanup": cleanup})
    if not await core.transition(sandbox.id, [S.CREATING], S.ERROR, failed, error_reason=reason):
        await core.record(failed)  # killed meanwhile: keep the failure in the log anyway
    log.warning("create of sandbox %s failed: %s", sandbox.id, reason)
