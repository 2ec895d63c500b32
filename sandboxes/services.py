"""The sandbox lifecycle service: the one place where sandbox state changes.

Every transition is a conditional update (``UPDATE … WHERE state IN expected``)
written together with its SandboxEvent in one transaction, before the caller is
answered, so two requests can never both win a transition and nothing is
acknowledged that is not on disk.

Everything here is ``async``: a create waits for a VM to boot on a node, and
doing that in a worker thread would let a handful of creates block the whole
server (asgiref runs sync code in a small pool). Database work runs through
Django's async ORM or short ``sync_to_async`` helpers."""
from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import time
from dataclasses import dataclass
from datetime import datetime, timedelta

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.db.models.fields.json import KeyTransform
from django.utils import timezone

from .errors import ApiError
from .models import Sandbox, SandboxEvent, Team, Template, new_envd_access_token
from .states import E2B_PAUSED, E2B_RUNNING, KILLABLE, LIVE, SETTLING, SandboxState
from .transitions import insert_creating, transition

log = logging.getLogger(__name__)

S = SandboxState
# A retried create with the same Idempotency-Key inside this window gets the same sandbox.
IDEMPOTENCY_WINDOW = timedelta(seconds=getattr(settings, "AENV_IDEMPOTENCY_WINDOW", 24 * 3600))
# How long a kill waits for the node before recording the kill as unconfirmed.
KILL_DEADLINE = float(getattr(settings, "AENV_KILL_DEADLINE", 30))
# Best-effort cleanup of a failed boot must not hold the error answer for long.
CLEANUP_DEADLINE = 10.0
# Failed creates are not retried by the SDK: each retry would insert (and fail) another
# sandbox, and neither "no capacity" nor "node dead" heals within its backoff.
NO_RETRY = {"Should-Retry": "false"}



def _snapshots():
    """snapshots.services, imported late (it builds on this module)."""
    from snapshots import services  # noqa: PLC0415

    return services


def _node_api():
    """The node client and placement modules, imported late so that this module
    loads (and can be mocked) independently of the node side."""
    from nodes import client, placement  # noqa: PLC0415

    return client, placement


# --------------------------------------------------------------------------- helpers


def _ms(since: float) -> float:
    return round((time.monotonic() - since) * 1000, 1)


def _event(sandbox_id: str, operation: str, *, outcome="ok", from_state="", to_state="",
           started_at=None, duration_ms=None, message="", details=None, actor="") -> SandboxEvent:
    return SandboxEvent(
        sandbox_id=sandbox_id, operation=operation, outcome=outcome, from_state=from_state,
        to_state=to_state, started_at=started_at or timezone.now(), duration_ms=duration_ms,
        message=message, details=details or {}, actor=actor,
    )


_transition = transition  # the one writer (sandboxes.transitions); shorter at the call sites


@sync_to_async
def _record(event: SandboxEvent) -> None:
    event.save()


def _check_str_map(name: str, value) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ApiError(400, f"{name} must be an object mapping strings to strings")
    return dict(value)


def _check_timeout(timeout) -> int:
    if timeout is None:
        return settings.AENV_DEFAULT_TIMEOUT
    if isinstance(timeout, bool) or not isinstance(timeout, int) or not 0 <= timeout <= settings.AENV_MAX_TIMEOUT:
        raise ApiError(400, f"timeout must be an integer between 0 and {settings.AENV_MAX_TIMEOUT} seconds")
    return timeout


async def resolve_template(team: Team, ref: str) -> Template:
    """A template by id or alias, visible to the team (its own or public).

    Unknown templates are a 400 (the request names something that does not exist),
    the same answer whether the template is missing or belongs to another team."""
    ref = (ref or "").strip()
    if not ref:
        raise ApiError(400, "templateID is required")
    visible = Q(public=True) | Q(team=team)
    for lookup in (Q(pk=ref), Q(alias=ref)):
        template = await Template.objects.filter(lookup & visible).afirst()
        if template is not None:
            return template
    raise ApiError(400, f'template "{ref}" not found')


async def _visible(team: Team, sandbox_id: str, states=None) -> Sandbox:
    """A sandbox of this team that the E2B API still shows; anything else is a 404
    (including other teams' sandboxes, so ids cannot be probed)."""
    sandbox = await Sandbox.objects.filter(
        pk=sandbox_id, team=team, state__in=states or LIVE
    ).afirst()
    if sandbox is None:
        raise ApiError(404, f'sandbox "{sandbox_id}" not found')
    return sandbox


# --------------------------------------------------------------------------- create


async def create_sandbox(
    team: Team,
    template_ref: str,
    timeout: int | None = None,
    metadata: dict | None = None,
    env_vars: dict | None = None,
    secure: bool = False,
    auto_pause: bool = True,
    auto_resume: bool = False,
    auto_pause_memory: bool = True,
    allow_internet_access: bool | None = None,
    network: dict | None = None,
    idempotency_key: str | None = None,
    actor: str = "",
) -> Sandbox:
    """Creates and boots a sandbox; returns it running, or raises ApiError.

    The boot runs in its own task shielded from cancellation: if the client goes
    away mid-boot the sandbox still ends in ``running`` or ``error`` (never stuck in
    ``creating`` with a VM nobody knows about)."""
    timeout = _check_timeout(timeout)
    metadata = _check_str_map("metadata", metadata)
    env_vars = _check_str_map("envVars", env_vars)
    if idempotency_key is not None and not 1 <= len(idempotency_key) <= 255:
        raise ApiError(400, "Idempotency-Key must be 1 to 255 characters")
    snapshot = await _snapshots().resolve_snapshot(team, template_ref)
    template = snapshot.template if snapshot is not None else await resolve_template(team, template_ref)

    now = timezone.now()
    fields = dict(
        team=team, template=template, alias=template.alias,
        envd_version=template.envd_version, secure=secure,
        envd_access_token=new_envd_access_token() if secure else "",
        metadata=metadata, env_vars=env_vars, cpu_count=template.cpu_count,
        memory_mb=template.memory_mb, disk_size_mb=template.disk_size_mb,
        auto_pause=auto_pause, auto_resume=auto_resume, auto_pause_memory=auto_pause_memory,
        allow_internet_access=allow_internet_access, network=network,
        idempotency_key=idempotency_key or "", created_at=now, started_at=now,
        end_at=now + timedelta(seconds=timeout),
    )
    if snapshot is not None:
        # A restore: the snapshot's size and envd; a secure source's envd is handed to a token of its own.
        fields.update(source_snapshot=snapshot, cpu_count=snapshot.cpu_count, memory_mb=snapshot.memory_mb,
                      disk_size_mb=snapshot.disk_size_mb, envd_version=snapshot.envd_version)
        if snapshot.memory and snapshot.envd_access_token:
            fields.update(secure=True, envd_access_token=new_envd_access_token())
    sandbox = await _insert_creating(fields, actor)
    if getattr(sandbox, "_replayed", False):
        return await _replay(sandbox)
    task = asyncio.ensure_future(_boot(sandbox, template, timeout, actor, snapshot))
    # If the caller is cancelled the boot still finishes; its outcome is in the DB.
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return await asyncio.shield(task)


@sync_to_async
def _insert_creating(fields: dict, actor: str) -> Sandbox:
    """Inserts the ``creating`` row and its event; with an Idempotency-Key already
    used by this team, returns the earlier sandbox instead (marked ``_replayed``)."""
    key = fields["idempotency_key"]
    for _ in range(3):
        try:
            return insert_creating(_event("", "create", outcome="started", actor=actor,
                                          details={"template": fields["template"].id, "idempotency_key": key}),
                                   **fields)
        except IntegrityError:
            if not key:
                raise
        earlier = Sandbox.objects.filter(team=fields["team"], idempotency_key=key).first()
        if earlier is None:
            continue  # released meanwhile; try again
        if earlier.state != S.ERROR and earlier.created_at >= timezone.now() - IDEMPOTENCY_WINDOW:
            earlier._replayed = True
            return earlier
        # A failed or expired earlier create does not pin the key: release it (the
        # key stays in that sandbox's create event) and create a new sandbox.
        Sandbox.objects.filter(pk=earlier.pk, idempotency_key=key).update(idempotency_key="")
    raise ApiError(409, "Idempotency-Key is in use by a concurrent request")


async def _replay(sandbox: Sandbox) -> Sandbox:
    """The answer to a repeated create: waits while the first request is still
    booting, then returns the same sandbox (or the same kind of failure)."""
    deadline = time.monotonic() + settings.AENV_NODE_TASK_DEADLINE + 30
    while sandbox.state == S.CREATING and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        sandbox = await Sandbox.objects.aget(pk=sandbox.pk)
    if sandbox.state == S.CREATING:
        raise ApiError(504, f'sandbox "{sandbox.id}" is still being created', headers=NO_RETRY)
    if sandbox.state == S.ERROR:
        raise ApiError(500, f'sandbox "{sandbox.id}" failed to start: {sandbox.error_reason}', headers=NO_RETRY)
    return sandbox


async def _boot(sandbox: Sandbox, template: Template, timeout: int, actor: str, snapshot=None) -> Sandbox:
    client, placement = _node_api()
    t0 = time.monotonic()
    started = timezone.now()
    node = None
    try:
        if snapshot is not None:  # a restore runs where the snapshot's files are
            node = await _snapshots().restore_node(snapshot, placement.NoNodeAvailable)
        else:
            node = await placement.pick_node(sandbox.cpu_count, sandbox.memory_mb)
    except ApiError as exc:
        await _fail_create(sandbox, str(exc.detail), t0, started, actor, node=None, kind="SnapshotUnavailable")
        raise
    except placement.NoNodeAvailable as exc:
        reason = f"no node available with {sandbox.cpu_count} vCPU and {sandbox.memory_mb} MB free"
        if str(exc):
            reason += f" ({exc})"
        await _fail_create(sandbox, reason, t0, started, actor, node=None, kind="NoNodeAvailable")
        raise ApiError(503, reason, headers=NO_RETRY) from exc
    except Exception as exc:  # placement itself broke: still never leave "creating"
        reason = f"placement failed: {exc}"
        await _fail_create(sandbox, reason, t0, started, actor, node=None, kind=type(exc).__name__)
        raise ApiError(503, reason, headers=NO_RETRY) from exc

    t_scheduled = time.monotonic()
    # Remember the node before booting: if we crash mid-boot, the VM can be found.
    if not await Sandbox.objects.filter(pk=sandbox.pk, state=S.CREATING).aupdate(node=node):
        raise ApiError(409, f'sandbox "{sandbox.id}" was killed while it was being created', headers=NO_RETRY)
    try:
        result = await _await_node(asyncio.wait_for(
            client.boot_sandbox(
                node, sandbox_id=sandbox.id, image=template.image, cpu_count=sandbox.cpu_count,
                memory_mb=sandbox.memory_mb, disk_size_mb=sandbox.disk_size_mb,
                env_vars=sandbox.env_vars, access_token=sandbox.envd_access_token or None,
            ) if snapshot is None else client.restore_sandbox(
                node, sandbox_id=sandbox.id, snapshot_id=snapshot.id, env_vars=sandbox.env_vars,
                access_token=sandbox.envd_access_token or None, source_token=snapshot.envd_access_token or None,
            ),
            # The node client enforces AENV_NODE_TASK_DEADLINE; this is only a backstop.
            timeout=settings.AENV_NODE_TASK_DEADLINE + 15,
        ), sandbox.id, S.CREATING, tolerate=(S.KILLING, S.KILLED))
    except _Moved as moved:
        # A restarted node worker reconciled the row (creating → error) and owns the
        # cleanup of whatever VM was half-booted: answer now, not at the deadline.
        reason = f"node {node.id} restarted while the sandbox was being created (now {moved.state})"
        await _record(_event(sandbox.id, "create", outcome="error", from_state=S.CREATING, started_at=started,
                             duration_ms=_ms(t0), actor=actor, message=reason, details={"node": node.id}))
        raise ApiError(503, reason, headers=NO_RETRY) from None
    except (client.NodeTimeout, asyncio.TimeoutError) as exc:
        reason = f"node {node.id} did not finish booting within {settings.AENV_NODE_TASK_DEADLINE} s"
        await _fail_create(sandbox, reason, t0, started, actor, node=node, kind="NodeTimeout")
        raise ApiError(504, reason, headers=NO_RETRY) from exc
    except client.NodeUnavailable as exc:
        reason = f"node {node.id} is unavailable: {exc}"
        await _fail_create(sandbox, reason, t0, started, actor, node=node, kind="NodeUnavailable")
        raise ApiError(503, reason, headers=NO_RETRY) from exc
    except client.NodeTaskFailed as exc:
        kind = getattr(exc, "kind", "") or "NodeTaskFailed"
        reason = f"boot failed on node {node.id}: {kind}: {exc}"
        await _fail_create(sandbox, reason, t0, started, actor, node=node, kind=kind)
        raise ApiError(500, reason, error_code=_snake(kind), headers=NO_RETRY) from exc
    except Exception as exc:  # a bug or an unexpected node answer: JSON 500, never bare
        reason = f"boot failed on node {node.id}: {type(exc).__name__}: {exc}"
        log.exception("unexpected error booting sandbox %s", sandbox.id)
        await _fail_create(sandbox, reason, t0, started, actor, node=node, kind=type(exc).__name__)
        raise ApiError(500, reason, headers=NO_RETRY) from exc

    phases = create_phases(t0, t_scheduled, time.monotonic(), result.get("timings") or {})
    now = timezone.now()
    event = _event(
        sandbox.id, "create", from_state=S.CREATING, started_at=started, duration_ms=_ms(t0), actor=actor,
        details={"node": node.id, "accel": result.get("accel"), "pid": result.get("pid"),
                 "timings": result.get("timings") or {}, "phases": phases},
    )
    won = await _transition(
        sandbox.id, [S.CREATING], S.RUNNING, event, node=node,
        envd_host=result["envd_host"], envd_port=result["envd_port"],
        started_at=now, end_at=now + timedelta(seconds=timeout),
    )
    if not won:
        # Killed while booting: the kill could not reach a VM that did not exist yet.
        cleanup = await _kill_on_node(node, sandbox.id, CLEANUP_DEADLINE)
        await _record(_event(sandbox.id, "create", outcome="aborted", from_state=S.CREATING,
                             started_at=started, duration_ms=_ms(t0), actor=actor,
                             message="sandbox was killed while it was being created",
                             details={"node": node.id, "cleanup": cleanup}))
        raise ApiError(409, f'sandbox "{sandbox.id}" was killed while it was being created', headers=NO_RETRY)
    created = await Sandbox.objects.select_related("template").aget(pk=sandbox.pk)
    created.op_phases = phases
    return created


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


def _snake(kind: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in kind).lstrip("_")


async def _fail_create(sandbox, reason, t0, started, actor, *, node, kind) -> None:
    """Marks a failed create ``error`` (with reason and event) and removes whatever
    the node may have started, so a failure never leaks a VM."""
    cleanup = await _kill_on_node(node, sandbox.id, CLEANUP_DEADLINE) if node is not None else None
    event = _event(sandbox.id, "create", outcome="error", from_state=S.CREATING, started_at=started,
                   duration_ms=_ms(t0), message=reason, actor=actor,
                   details={"kind": kind, "node": getattr(node, "id", None), "cleanup": cleanup})
    if not await _transition(sandbox.id, [S.CREATING], S.ERROR, event, error_reason=reason):
        await _record(event)  # killed meanwhile: keep the failure in the log anyway
    log.warning("create of sandbox %s failed: %s", sandbox.id, reason)


async def _kill_on_node(node, sandbox_id: str, deadline: float) -> dict:
    """Asks the node to kill a VM, never waiting longer than ``deadline`` and never
    raising; returns what happened, for the event log."""
    client, _ = _node_api()
    try:
        result = await asyncio.wait_for(client.kill_sandbox(node, sandbox_id=sandbox_id), timeout=deadline)
        return {"ok": True, "killed": bool((result or {}).get("killed"))}
    except asyncio.TimeoutError:
        return {"ok": False, "error": f"NodeTimeout: no answer within {deadline:g} s"}
    except Exception as exc:  # noqa: BLE001 - reported, never raised
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


# --------------------------------------------------------------------------- kill


async def kill_sandbox(team: Team, sandbox_id: str, actor: str = "", *, from_states=None,
                       where: dict | None = None, reason: str = "") -> Sandbox:
    """Kills a sandbox: ``→ killing`` (durable), the node kills the VM, ``→ killed``.

    If the node cannot confirm within KILL_DEADLINE (dead node, broker down) the
    sandbox is still recorded ``killed`` — the user asked for it, and it must stop
    being served — with the failure in ``error_reason`` and the event, so the node
    reconciles the orphan VM when it comes back. Unknown, already killed or another
    team's sandbox: 404; of two concurrent kills exactly one wins, the other gets 404.

    The lifecycle sweeper narrows the start condition (``from_states`` / ``where``,
    e.g. "running and still expired") and names its ``reason``; if the condition no
    longer holds the kill does not happen (409)."""
    sandbox = await _visible(team, sandbox_id)
    t0, started = time.monotonic(), timezone.now()
    if sandbox.state == S.KILLING:
        raise ApiError(404, f'sandbox "{sandbox_id}" not found (already being killed)')
    details = {"reason": reason} if reason else {}
    event = _event(sandbox_id, "kill", outcome="started", from_state=sandbox.state, actor=actor, details=details)
    if not await _transition(sandbox_id, from_states or KILLABLE, S.KILLING, event, where=where):
        if from_states or where:
            raise ApiError(409, f'sandbox "{sandbox_id}" changed meanwhile; not killed')
        raise ApiError(404, f'sandbox "{sandbox_id}" not found (already being killed)')

    node_id = sandbox.node_id
    if node_id is None:
        outcome = {"ok": True, "killed": False, "note": "no node: nothing was running"}
    else:
        from nodes.models import Node  # noqa: PLC0415

        node = await Node.objects.filter(pk=node_id).afirst()
        outcome = (await _kill_on_node(node, sandbox_id, KILL_DEADLINE) if node is not None
                   else {"ok": False, "error": f"node {node_id} no longer exists"})
    failure = "" if outcome["ok"] else f"VM kill not confirmed by node {node_id}: {outcome['error']}"
    if failure:
        log.warning("sandbox %s: %s", sandbox_id, failure)
    done = _event(sandbox_id, "kill", outcome="ok" if outcome["ok"] else "unconfirmed",
                  from_state=S.KILLING, started_at=started, duration_ms=_ms(t0), actor=actor,
                  message=failure, details={"node": node_id, **details, **outcome})
    fields = {"killed_at": timezone.now()}
    if failure:
        fields["error_reason"] = failure
    await _transition(sandbox_id, [S.KILLING], S.KILLED, done, **fields)
    return await Sandbox.objects.aget(pk=sandbox_id)


# --------------------------------------------------------------------------- read


async def get_sandbox(team: Team, sandbox_id: str) -> Sandbox:
    return await _visible(team, sandbox_id)


def decode_metadata_filter(raw: str | None) -> dict[str, str]:
    """The SDK's triple-encoded ``metadata`` query value (already URL-decoded once
    by Django) → ``{key: value}``: parse as form data, then percent-decode each
    key and value once more (spec §2.5)."""
    from urllib.parse import parse_qsl, unquote  # noqa: PLC0415

    if not raw:
        return {}
    try:
        pairs = parse_qsl(raw, keep_blank_values=True, strict_parsing=True)
    except ValueError as exc:
        raise ApiError(400, f"metadata filter must look like key=value&key2=value2: {exc}") from exc
    return {unquote(k): unquote(v) for k, v in pairs}


def _apply_metadata(qs, metadata: dict[str, str]):
    for i, (key, value) in enumerate(metadata.items()):
        alias = f"_meta_{i}"
        qs = qs.annotate(**{alias: KeyTransform(key, "metadata")}).filter(**{alias: value})
    return qs


async def list_running(team: Team, metadata: dict[str, str] | None = None) -> list[Sandbox]:
    """v1 list: every running sandbox of the team, newest first."""
    qs = Sandbox.objects.filter(team=team, state__in=E2B_RUNNING)
    qs = _apply_metadata(qs, metadata or {}).order_by("-started_at", "-id")
    return [s async for s in qs]


@dataclass
class Page:
    items: list
    next_token: str | None


def encode_page_token(when: datetime, pk: str) -> str:
    """Opaque ``nextToken`` of a keyset page: the last row's (timestamp, id)."""
    raw = json.dumps([when.isoformat(), pk]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_page_token(token: str) -> tuple[datetime, str]:
    """``encode_page_token``'s (timestamp, id); anything else is a 400."""
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        stamp, pk = json.loads(raw)
        when = datetime.fromisoformat(stamp)
        if not isinstance(pk, str) or when.tzinfo is None:
            raise ValueError("bad token contents")
        return when, pk
    except (ValueError, TypeError, binascii.Error, UnicodeDecodeError) as exc:
        raise ApiError(400, "invalid nextToken") from exc


async def list_sandboxes(
    team: Team,
    *,
    states: list[str] | None = None,
    metadata: dict[str, str] | None = None,
    order: str = "desc",
    started_after: datetime | None = None,
    template: str | None = None,
    limit: int = 100,
    next_token: str | None = None,
) -> Page:
    """v2 list: keyset pagination on (started_at, id) so pages never repeat or skip
    a sandbox even while others are created or killed between calls."""
    db_states: list[str] = []
    for state in states or ["running", "paused"]:
        db_states += E2B_RUNNING if state == "running" else E2B_PAUSED
    qs = Sandbox.objects.filter(team=team, state__in=db_states)
    qs = _apply_metadata(qs, metadata or {})
    if started_after is not None:
        qs = qs.filter(started_at__gte=started_after)
    if template:
        qs = qs.filter(Q(template_id=template) | Q(template__alias=template))
    if next_token:
        when, last_id = decode_page_token(next_token)
        if order == "asc":
            qs = qs.filter(Q(started_at__gt=when) | Q(started_at=when, id__gt=last_id))
        else:
            qs = qs.filter(Q(started_at__lt=when) | Q(started_at=when, id__lt=last_id))
    qs = qs.order_by(*(["started_at", "id"] if order == "asc" else ["-started_at", "-id"]))
    rows = [s async for s in qs[: limit + 1]]
    more = len(rows) > limit
    rows = rows[:limit]
    return Page(rows, encode_page_token(rows[-1].started_at, rows[-1].id) if more else None)


# --------------------------------------------------------------------------- TTL


async def set_timeout(team: Team, sandbox_id: str, seconds: int, actor: str = "") -> Sandbox:
    """``end_at = now + seconds`` (may shorten: 0 expires the sandbox at once)."""
    seconds = _check_timeout(seconds)
    sandbox = await _visible(team, sandbox_id)
    end_at = timezone.now() + timedelta(seconds=seconds)
    await _set_end_at(sandbox, end_at, "set_timeout", actor, {"timeout": seconds})
    return sandbox


async def refresh(team: Team, sandbox_id: str, seconds: int, actor: str = "") -> Sandbox:
    """Keep-alive: extends ``end_at`` to ``now + seconds`` but never shortens it."""
    seconds = _check_timeout(seconds)
    sandbox = await _visible(team, sandbox_id)
    end_at = max(sandbox.end_at, timezone.now() + timedelta(seconds=seconds))
    if end_at != sandbox.end_at:
        await _set_end_at(sandbox, end_at, "refresh", actor, {"duration": seconds})
    return sandbox


@sync_to_async
def _set_end_at(sandbox: Sandbox, end_at: datetime, operation: str, actor: str, details: dict) -> None:
    with transaction.atomic():
        updated = Sandbox.objects.filter(pk=sandbox.pk, state__in=LIVE).update(
            end_at=end_at, updated_at=timezone.now()
        )
        if not updated:
            raise ApiError(404, f'sandbox "{sandbox.pk}" not found')
        _event(sandbox.pk, operation, from_state=sandbox.state, to_state=sandbox.state, actor=actor,
               details={**details, "end_at": end_at.isoformat()}).save()
    sandbox.end_at = end_at


# --------------------------------------------------------------------------- pause / resume / connect

# How long a pause / resume may take on the node (a TCG pause to disk writes the RAM file).
LIFECYCLE_DEADLINE = float(getattr(settings, "AENV_LIFECYCLE_DEADLINE", settings.AENV_NODE_TASK_DEADLINE))
SETTLE_POLL = 0.1


def _not_running(sandbox_id: str, state: str) -> ApiError:
    return ApiError(409, f'sandbox "{sandbox_id}" is not running (it is {state})')


async def _settle(team: Team, sandbox_id: str) -> Sandbox:
    """The sandbox once it is out of a transitional state (another request's pause,
    resume or create finishing); 404 if it is gone."""
    deadline = time.monotonic() + LIFECYCLE_DEADLINE + 30
    sandbox = await _visible(team, sandbox_id)
    while sandbox.state in SETTLING and time.monotonic() < deadline:
        await asyncio.sleep(SETTLE_POLL)
        sandbox = await _visible(team, sandbox_id)
    if sandbox.state in SETTLING:
        raise ApiError(504, f'sandbox "{sandbox_id}" is still {sandbox.state}')
    if sandbox.state == S.KILLING:
        raise ApiError(404, f'sandbox "{sandbox_id}" not found (being killed)')
    return sandbox


async def _node_of(sandbox: Sandbox):
    from nodes.models import Node  # noqa: PLC0415

    node = await Node.objects.filter(pk=sandbox.node_id).afirst() if sandbox.node_id else None
    if node is None:
        raise ApiError(503, f'sandbox "{sandbox.id}" has no node (node {sandbox.node_id} is gone)')
    return node


def _shielded(coro):
    """Runs ``coro`` to completion even if the caller is cancelled (the client went
    away): its outcome is written to the DB either way, never a half-done transition."""
    task = asyncio.ensure_future(coro)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return asyncio.shield(task)


def _node_failure(client, exc: BaseException, node, what: str) -> tuple[int, str, str]:
    """(status, reason, kind) for a failed node call, mapped like create's."""
    if isinstance(exc, (client.NodeTimeout, asyncio.TimeoutError)):
        return 504, f"node {node.id} did not finish the {what} within {LIFECYCLE_DEADLINE:g} s", "NodeTimeout"
    if isinstance(exc, client.NodeUnavailable):
        return 503, f"node {node.id} is unavailable: {exc}", "NodeUnavailable"
    if isinstance(exc, client.NodeTaskFailed):
        kind = getattr(exc, "kind", "") or "NodeTaskFailed"
        return 500, f"{what} failed on node {node.id}: {kind}: {exc}", kind
    return 500, f"{what} failed on node {node.id}: {type(exc).__name__}: {exc}", type(exc).__name__


def _op_phases(t0: float, node_ms: float | None) -> dict:
    total = (time.monotonic() - t0) * 1000
    phases = {"total": total}
    if node_ms is not None:
        phases = {"dispatch": max(total - node_ms, 0.0), "node": node_ms, "total": total}
    return {k: round(float(v), 2) for k, v in phases.items()}


class _Moved(Exception):
    """While we waited for the node, the sandbox left the transitional state this
    operation put it in: a kill, or the node reconciling it after a restart."""

    def __init__(self, state: str | None):
        super().__init__(state)
        self.state = state


WATCH_POLL = 0.5


async def _await_node(call, sandbox_id: str, state: str, tolerate: tuple = ()):
    """The node call's result — unless the sandbox leaves ``state`` first (then
    ``_Moved``): a node worker that restarts mid-operation never answers the task, but
    it reconciles the row to the VM's real state, and the caller should learn that
    now, not at the deadline. States in ``tolerate`` keep the wait going (e.g. a kill
    during a create, which needs the boot's answer to clean up the VM)."""
    task = asyncio.ensure_future(call)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=WATCH_POLL)
            if done:
                return task.result()
            current = await Sandbox.objects.filter(pk=sandbox_id).values_list("state", flat=True).afirst()
            if current != state and current not in tolerate:
                raise _Moved(current)
    finally:
        if not task.done():
            task.cancel()


async def pause_sandbox(team: Team, sandbox_id: str, memory: bool | None = None, actor: str = "", *,
                        expired_by: datetime | None = None) -> Sandbox:
    """Pauses a running sandbox: ``running → pausing`` (durable), the node saves the VM
    to disk (its QEMU process exits), ``→ paused``. ``memory=False`` is E2B's
    filesystem-only pause (only the disk is kept; a resume cold-boots on it).

    A pause already in progress is joined (the answer comes when it is paused). Not
    running: 409; unknown: 404; node not alive: 503 and nothing changes.

    ``expired_by`` is the lifecycle sweeper's TTL pause: it happens only while the
    sandbox is running with ``end_at <= expired_by`` (a concurrent timeout extension
    wins), and never joins; otherwise 409."""
    while True:
        sandbox = await _visible(team, sandbox_id)
        if sandbox.state == S.PAUSING and expired_by is None:
            sandbox = await _settle(team, sandbox_id)
            if sandbox.state == S.PAUSED:
                return sandbox  # joined the concurrent pause
            raise _not_running(sandbox_id, sandbox.state)
        if sandbox.state != S.RUNNING:
            raise _not_running(sandbox_id, sandbox.state)
        node = await _node_of(sandbox)
        if not node.is_alive():
            raise ApiError(503, f"node {node.id} is not alive (no recent heartbeat); sandbox not paused")
        details = {"memory": memory}
        if expired_by is not None:
            details["reason"] = "expired"
        event = _event(sandbox_id, "pause", outcome="started", from_state=S.RUNNING, actor=actor, details=details)
        where = {"end_at__lte": expired_by} if expired_by is not None else None
        if await _transition(sandbox_id, [S.RUNNING], S.PAUSING, event, where=where):
            break  # else another request changed it meanwhile: look again
        if expired_by is not None:
            raise ApiError(409, f'sandbox "{sandbox_id}" is no longer running and expired')
    return await _shielded(_pause_on_node(sandbox, node, memory, actor))


async def _pause_on_node(sandbox: Sandbox, node, memory: bool | None, actor: str) -> Sandbox:
    client, _ = _node_api()
    t0, started = time.monotonic(), timezone.now()
    fs_only = memory is False
    mode = "filesystem" if fs_only else "memory"
    details = {"node": node.id, "to_disk": True, "memory": memory, "mode": mode}
    try:
        result = await _await_node(asyncio.wait_for(
            client.pause_sandbox(node, sandbox_id=sandbox.id, to_disk=True, memory=not fs_only,
                                 deadline=LIFECYCLE_DEADLINE),
            timeout=LIFECYCLE_DEADLINE + 15,
        ), sandbox.id, S.PAUSING)
    except _Moved as moved:
        if moved.state == S.PAUSED:  # the node reconciled it: the pause had finished
            return await Sandbox.objects.select_related("template").aget(pk=sandbox.pk)
        await _record(_event(sandbox.id, "pause", outcome="aborted", from_state=S.PAUSING, started_at=started,
                             duration_ms=_ms(t0), actor=actor, details=details,
                             message=f"sandbox became {moved.state} while pausing"))
        if moved.state == S.RUNNING:
            raise ApiError(409, f'pause of sandbox "{sandbox.id}" was interrupted (node restarted); '
                                "it is running") from None
        raise ApiError(404, f'sandbox "{sandbox.id}" not found (killed while pausing)') from None
    except Exception as exc:  # mapped below, never a bare 500
        status, reason, kind = _node_failure(client, exc, node, "pause")
        log.warning("pause of sandbox %s failed: %s", sandbox.id, reason)
        details = {**details, "kind": kind}
        if isinstance(exc, client.NodeTaskFailed):
            # The node answered: the QEMU driver continues the VM when saving fails (and a
            # revoked task never touched it), so the sandbox is running again.
            event = _event(sandbox.id, "pause", outcome="error", from_state=S.PAUSING, started_at=started,
                           duration_ms=_ms(t0), message=reason, actor=actor, details=details)
            if not await _transition(sandbox.id, [S.PAUSING], S.RUNNING, event):
                await _record(event)  # killed meanwhile
        else:
            # No answer (timeout, broker gone): the VM may be running, paused or mid-save.
            # Guessing would be wrong half the time, so the sandbox stays "pausing" (shown
            # paused; connect waits) and the node reconciles it to the VM's real state when
            # it answers again (nodes.reconcile) — the VM is not killed.
            await _record(_event(sandbox.id, "pause", outcome="unconfirmed", from_state=S.PAUSING,
                                 started_at=started, duration_ms=_ms(t0), message=reason, actor=actor,
                                 details=details))
        raise ApiError(status, reason, error_code=_snake(kind) if status == 500 else None) from exc

    timings = (result or {}).get("timings") or {}
    phases = _op_phases(t0, timings.get("total_ms"))
    event = _event(sandbox.id, "pause", from_state=S.PAUSING, started_at=started, duration_ms=_ms(t0),
                   actor=actor, details={**details, "timings": timings, "phases": phases})
    if not await _transition(sandbox.id, [S.PAUSING], S.PAUSED, event):
        await _record(_event(sandbox.id, "pause", outcome="aborted", from_state=S.PAUSING, started_at=started,
                             duration_ms=_ms(t0), actor=actor, message="sandbox was killed while pausing",
                             details=details))
        raise ApiError(404, f'sandbox "{sandbox.id}" not found (killed while pausing)')
    paused = await Sandbox.objects.select_related("template").aget(pk=sandbox.pk)
    paused.op_phases = phases
    return paused


async def resume_sandbox(team: Team, sandbox_id: str, timeout: int | None = None, actor: str = "") -> Sandbox:
    """v1 resume: ``paused → resuming → running`` with ``end_at = now + timeout``.
    Already running: 409; unknown or killed: 404. A pause in progress is waited for."""
    timeout = _check_timeout(timeout)
    resumed, sandbox = await _resume_or_running(team, sandbox_id, timeout, actor, operation="resume")
    if not resumed:
        raise ApiError(409, f'sandbox "{sandbox_id}" is already running')
    return sandbox


async def connect_sandbox(team: Team, sandbox_id: str, timeout: int | None = None,
                          actor: str = "", memory: bool | None = None) -> tuple[bool, Sandbox]:
    """Connect: a running sandbox only has its TTL extended (``end_at = max(end_at,
    now + timeout)``) → ``(False, sandbox)``; a paused one is resumed → ``(True, sandbox)``.
    ``memory=False`` (SDK ``on_resume="reboot"``) resumes a paused sandbox by a cold
    boot on its disk, ignoring its memory snapshot."""
    timeout = _check_timeout(timeout)
    resumed, sandbox = await _resume_or_running(team, sandbox_id, timeout, actor, operation="connect",
                                                memory=memory)
    if not resumed:
        end_at = max(sandbox.end_at, timezone.now() + timedelta(seconds=timeout))
        if end_at != sandbox.end_at:
            await _set_end_at(sandbox, end_at, "connect", actor, {"timeout": timeout})
    return resumed, sandbox


async def auto_resume(sandbox_id: str) -> Sandbox | None:
    """The data plane's autoResume: traffic reached a paused (or pausing / resuming)
    sandbox. If it was created with ``autoResume`` it is resumed exactly like a connect
    (same transitions, events and node calls; concurrent callers join one resume) with
    a TTL of at least AENV_AUTO_RESUME_TIMEOUT; returns it running. None when the
    sandbox is unknown, not paused or has no autoResume. Raises ApiError on failure."""
    sandbox = await (Sandbox.objects.select_related("team")
                     .filter(pk=sandbox_id, state__in=[S.PAUSING, S.PAUSED, S.RESUMING]).afirst())
    if sandbox is None or not sandbox.auto_resume:
        return None
    _, running = await connect_sandbox(sandbox.team, sandbox_id, settings.AENV_AUTO_RESUME_TIMEOUT,
                                       actor="autoresume")
    return running


async def _resume_or_running(team, sandbox_id, timeout, actor, operation, memory=None) -> tuple[bool, Sandbox]:
    while True:
        sandbox = await _settle(team, sandbox_id)
        if sandbox.state == S.RUNNING:
            return False, sandbox
        if sandbox.state != S.PAUSED:
            raise ApiError(409, f'sandbox "{sandbox_id}" cannot be resumed (it is {sandbox.state})')
        node = await _node_of(sandbox)
        event = _event(sandbox_id, "resume", outcome="started", from_state=S.PAUSED, actor=actor,
                       details={"via": operation, "timeout": timeout, "memory": memory})
        if await _transition(sandbox_id, [S.PAUSED], S.RESUMING, event):
            break
    return True, await _shielded(_resume_on_node(sandbox, node, timeout, actor, operation, memory))


async def _resume_on_node(sandbox: Sandbox, node, timeout: int, actor: str, operation: str,
                          memory: bool | None = None) -> Sandbox:
    client, _ = _node_api()
    t0, started = time.monotonic(), timezone.now()
    details = {"node": node.id, "via": operation, "timeout": timeout}
    reboot = {"memory": False} if memory is False else {}
    if reboot:
        details["mode"] = "reboot"
    try:
        result = await _await_node(asyncio.wait_for(
            client.resume_sandbox(node, sandbox_id=sandbox.id, env_vars=sandbox.env_vars,
                                  access_token=sandbox.envd_access_token or None, deadline=LIFECYCLE_DEADLINE,
                                  **reboot),
            timeout=LIFECYCLE_DEADLINE + 15,
        ), sandbox.id, S.RESUMING)
    except _Moved as moved:
        if moved.state == S.RUNNING:  # reconciled by the node: the resume had finished
            return await Sandbox.objects.select_related("template").aget(pk=sandbox.pk)
        await _record(_event(sandbox.id, "resume", outcome="aborted", from_state=S.RESUMING, started_at=started,
                             duration_ms=_ms(t0), actor=actor, details=details,
                             message=f"sandbox became {moved.state} while resuming"))
        if moved.state == S.PAUSED:
            raise ApiError(503, f'resume of sandbox "{sandbox.id}" was interrupted (node restarted); '
                                "it is still paused") from None
        raise ApiError(404, f'sandbox "{sandbox.id}" not found (killed while resuming)') from None
    except Exception as exc:  # mapped below
        status, reason, kind = _node_failure(client, exc, node, "resume")
        log.warning("resume of sandbox %s failed, it stays paused: %s", sandbox.id, reason)
        # The node re-pauses a VM whose envd did not come back; the memory snapshot is
        # still there, so the sandbox stays paused and a later connect can try again. If
        # the node never answered and resumes it later anyway, its reconcile pauses it again.
        event = _event(sandbox.id, "resume", outcome="error", from_state=S.RESUMING, started_at=started,
                       duration_ms=_ms(t0), message=reason, actor=actor, details={**details, "kind": kind})
        if not await _transition(sandbox.id, [S.RESUMING], S.PAUSED, event):
            await _record(event)
        raise ApiError(status, reason, error_code=_snake(kind) if status == 500 else None) from exc

    timings = result.get("timings") or {}
    node_ms = float(timings.get("total_ms", 0)) + float(timings.get("init", 0)) if timings else None
    phases = _op_phases(t0, node_ms)
    now = timezone.now()
    event = _event(sandbox.id, "resume", from_state=S.RESUMING, started_at=started, duration_ms=_ms(t0),
                   actor=actor, details={**details, "pid": result.get("pid"), "timings": timings, "phases": phases})
    won = await _transition(sandbox.id, [S.RESUMING], S.RUNNING, event, envd_host=result["envd_host"],
                            envd_port=result["envd_port"], end_at=now + timedelta(seconds=timeout))
    if not won:
        cleanup = await _kill_on_node(node, sandbox.id, CLEANUP_DEADLINE)
        await _record(_event(sandbox.id, "resume", outcome="aborted", from_state=S.RESUMING, started_at=started,
                             duration_ms=_ms(t0), actor=actor, message="sandbox was killed while resuming",
                             details={**details, "cleanup": cleanup}))
        raise ApiError(404, f'sandbox "{sandbox.id}" not found (killed while resuming)')
    resumed = await Sandbox.objects.select_related("template").aget(pk=sandbox.pk)
    resumed.op_phases = phases
    return resumed
