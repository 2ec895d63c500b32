"""What every lifecycle operation is built on: events and the one state writer, the
team's view of its sandboxes, the node calls (shielded from client disconnects, watching
for a node restart, failures turned into domain errors) and the result value.

Why here and public: ``create``, ``kill``, ``pause``, ``ttl`` and
``lifecycle.snapshots`` all need exactly these, and each used to keep a private copy or
reach into another module's privates."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connection
from django.utils import timezone

from lifecycle import own_thread
from nodes import client as node_client, placement
from nodes.models import Node
from sandboxes.models import Sandbox, SandboxEvent, Team
from sandboxes.prepared import PreparedQuery
from sandboxes.states import LIVE, SETTLING, SandboxState
from sandboxes.transitions import transition, transition_row  # noqa: F401 - the one writer, re-exported
from sandboxes.errors import (BUSY_NODE, FULL_NODE, REFUSED_BY_NODE, UNRESPONSIVE_GUEST, VM_GONE, Conflict, Failed, Invalid,
                              LifecycleError, NoRoom, NotFound, Timeout, Unavailable)

log = logging.getLogger(__name__)

S = SandboxState
# Best-effort cleanup of a failed operation must not hold the error answer for long.
CLEANUP_DEADLINE = 10.0
# Polls while waiting for another request's transition, and for a node restart.
SETTLE_POLL = 0.1
WATCH_POLL = 0.5


@dataclass
class Result:
    """What an operation hands back: the sandbox as it now is, and how long each phase
    took (ms; the API's Server-Timing header)."""

    sandbox: Sandbox
    phases: dict = field(default_factory=dict)


def node_api():
    """The node gateway and placement: one function the operations call, so a test can
    stand a fake node side in for both."""
    return node_client, placement


def ms(since: float) -> float:
    return round((time.monotonic() - since) * 1000, 1)


def event(sandbox_id: str, operation: str, *, outcome="ok", from_state="", to_state="",
          started_at=None, duration_ms=None, message="", details=None, actor="") -> SandboxEvent:
    return SandboxEvent(
        sandbox_id=sandbox_id, operation=operation, outcome=outcome, from_state=from_state,
        to_state=to_state, started_at=started_at or timezone.now(), duration_ms=duration_ms,
        message=message, details=details or {}, actor=actor,
    )


@sync_to_async
def record(ev: SandboxEvent) -> None:
    """Records an event that changes no state (a failure after the row moved on, a cleanup)."""
    ev.save()


def snake(kind: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in kind).lstrip("_")


# The team's sandbox and its node by the sandbox's id, per set of states: the SQL compiled once
# (sandboxes.prepared; compiling this select of ~70 columns cost more than running it, issue 26).
_VISIBLE: dict[tuple, PreparedQuery] = {}


def visible_sync(team: Team, sandbox_id: str, states=None) -> Sandbox | None:
    """``visible``'s read: the row (its node cached on it) or None."""
    states = tuple(sorted(states or LIVE))
    prepared = _VISIBLE.get(states)
    if prepared is None:
        # One row by its key: no ORDER BY (first() would add one, and ordering a select of the
        # sandbox's and the node's ~70 columns cost Django more than the rest of the query).
        prepared = _VISIBLE.setdefault(states, PreparedQuery(
            lambda key, team: Sandbox.objects.select_related("node")
            .filter(pk=key, team=team, state__in=list(states)).order_by()[:1],
            key=Sandbox._meta.pk, team=Team._meta.pk))
    return prepared.first(key=sandbox_id, team=team.pk)


def shown_sync(team: Team, sandbox_id: str, states=None) -> Sandbox:
    """``visible_sync``'s row, or NotFound (in a thread hop that goes on to write)."""
    sandbox = visible_sync(team, sandbox_id, states)
    if sandbox is None:
        raise NotFound(f'sandbox "{sandbox_id}" not found')
    return sandbox


async def visible(team: Team, sandbox_id: str, states=None) -> Sandbox:
    """A sandbox of this team that the E2B API still shows; anything else is NotFound
    (including other teams' sandboxes, so ids cannot be probed). Its node comes in the same
    query (``node_of`` then needs no second one: one thread hop less per operation)."""
    sandbox = await sync_to_async(shown_sync)(team, sandbox_id, states)
    fresh(sandbox.node)  # a node call right after needs no second read of it
    return sandbox


def fresh(node):
    """``node`` as just read from the database (``nodes.client.read_now``): a node call made
    right after checks it as it is instead of reading it again."""
    return node_client.read_now(node)


def not_running(sandbox_id: str, state: str) -> Conflict:
    return Conflict(f'sandbox "{sandbox_id}" is not running (it is {state})')


async def settle(team: Team, sandbox_id: str) -> Sandbox:
    """The sandbox once it is out of a transitional state (another request's pause,
    resume or create finishing); NotFound if it is gone."""
    deadline = time.monotonic() + settings.AENV_LIFECYCLE_DEADLINE + 30
    sandbox = await visible(team, sandbox_id)
    while sandbox.state in SETTLING and time.monotonic() < deadline:
        await asyncio.sleep(SETTLE_POLL)
        sandbox = await visible(team, sandbox_id)
    if sandbox.state in SETTLING:
        raise Timeout(f'sandbox "{sandbox_id}" is still {sandbox.state}')
    if sandbox.state == S.KILLING:
        raise NotFound(f'sandbox "{sandbox_id}" not found (being killed)')
    return sandbox


async def node_of(sandbox: Sandbox):
    if Sandbox.node.is_cached(sandbox):  # read with the sandbox (``visible``)
        return node_of_sync(sandbox)
    return await sync_to_async(node_of_sync)(sandbox)


def node_of_sync(sandbox: Sandbox):
    """The sandbox's node (as read with it, else read now); Unavailable if it has none."""
    if Sandbox.node.is_cached(sandbox):
        node = sandbox.node
    else:
        node = Node.objects.filter(pk=sandbox.node_id).first() if sandbox.node_id else None
    if node is None:
        raise Unavailable(f'sandbox "{sandbox.id}" has no node (node {sandbox.node_id} is gone)')
    return node


async def shielded(coro):
    """Runs ``coro`` to completion even if the caller is cancelled (the client went
    away): its outcome is written to the DB either way, never a half-done transition. Its ORM
    calls run on a thread of its own whose connection is closed at its end (it may outlive the
    request: ``lifecycle.own_thread`` says why); the request gives its own connection back to
    the pool while it waits (a create waits for its node for seconds: N such requests must not
    hold N pooled connections)."""
    task = asyncio.ensure_future(own_thread.on_a_thread_of_its_own(coro))
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    await release_connection()
    return await asyncio.shield(task)


def node_failure(client, exc: BaseException, node, what: str, deadline: float) -> LifecycleError:
    """The domain error for a failed node call; ``kind`` names what failed (the node's
    error class, for events) and a node-side failure carries it as ``code``."""
    if isinstance(exc, (client.NodeTimeout, asyncio.TimeoutError)):
        error, kind = Timeout(f"node {node.id} did not finish the {what} within {deadline:g} s"), "NodeTimeout"
    elif isinstance(exc, client.NodeUnavailable):
        error, kind = Unavailable(f"node {node.id} is unavailable: {exc}"), "NodeUnavailable"
    else:
        kind = (getattr(exc, "kind", "") or "NodeTaskFailed") if isinstance(exc, client.NodeTaskFailed) \
            else type(exc).__name__
        if isinstance(exc, client.NodeTaskFailed) and kind in REFUSED_BY_NODE:
            error = Invalid(f"node {node.id} cannot do this {what}: {exc}", code=snake(kind))
        elif isinstance(exc, client.NodeTaskFailed) and kind in FULL_NODE:
            error = NoRoom(f"node {node.id} has no room for this {what} now: {exc}")
        elif isinstance(exc, client.NodeTaskFailed) and kind in BUSY_NODE:
            error = NoRoom(f"node {node.id} is too busy for this {what} now (undone, nothing changed): {exc}")
        elif isinstance(exc, client.NodeTaskFailed) and kind in UNRESPONSIVE_GUEST:
            error = Unavailable(f"no {what}: {exc}")
        elif isinstance(exc, client.NodeTaskFailed) and kind in VM_GONE:
            error = Conflict(f"no {what}: the sandbox is lost, node {node.id} has no VM for it ({exc})",
                             code="sandbox_lost", retry=False)
        else:
            error = Failed(f"{what} failed on node {node.id}: {kind}: {exc}", code=snake(kind))
    error.kind = kind
    return error


def op_phases(t0: float, node_ms: float | None) -> dict:
    total = (time.monotonic() - t0) * 1000
    phases = {"total": total}
    if node_ms is not None:
        phases = {"dispatch": max(total - node_ms, 0.0), "node": node_ms, "total": total}
    return {k: round(float(v), 2) for k, v in phases.items()}


class Moved(Exception):
    """While we waited for the node, the sandbox left the transitional state this
    operation put it in: a kill, the node reconciling it after a restart, or the sweeper
    declaring it lost with its silent node."""

    def __init__(self, state: str | None, reason: str = ""):
        super().__init__(state)
        self.state = state
        self.reason = reason  # the row's error_reason, when whoever moved it gave one


async def await_node(call, sandbox_id: str, state: str, tolerate: tuple = ()):
    """The node call's result — unless the sandbox leaves ``state`` first (then
    ``Moved``): a node worker that restarts mid-operation never answers the task, but
    it reconciles the row to the VM's real state, and the caller should learn that
    now, not at the deadline. States in ``tolerate`` keep the wait going (e.g. a kill
    during a create, which needs the boot's answer to clean up the VM)."""
    task = asyncio.ensure_future(call)
    try:
        while True:
            await release_connection()
            done, _ = await asyncio.wait({task}, timeout=WATCH_POLL)
            if done:
                return task.result()
            row = await Sandbox.objects.filter(pk=sandbox_id).values_list("state", "error_reason").afirst()
            current, reason = row if row is not None else (None, "")
            if current != state and current not in tolerate:
                raise Moved(current, reason or "")
    finally:
        if not task.done():
            task.cancel()


def _release_pooled() -> None:
    if connection.connection is not None and not connection.in_atomic_block:
        connection.close()  # with a pool: back into it


async def release_connection() -> None:
    """Gives this request's database connection back to the pool while it waits for a node
    (seconds to minutes): the requests waiting at once are not capped by the pool's size
    (``AENV_DB_POOL_SIZE``), and never time out on it. Only with a pool (PostgreSQL); a
    SQLite connection is not a shared resource and is kept."""
    if connection.settings_dict.get("OPTIONS", {}).get("pool"):
        await sync_to_async(_release_pooled)()


async def kill_on_node(node, sandbox_id: str, deadline: float) -> dict:
    """Asks the node to kill a VM, never waiting longer than ``deadline`` and never
    raising; returns what happened, for the event log."""
    client, _ = node_api()
    try:
        result = await asyncio.wait_for(client.kill_sandbox(node, sandbox_id=sandbox_id), timeout=deadline)
        return {"ok": True, "killed": bool((result or {}).get("killed"))}
    except asyncio.TimeoutError:
        return {"ok": False, "error": f"NodeTimeout: no answer within {deadline:g} s"}
    except Exception as exc:  # noqa: BLE001 - reported, never raised
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


async def reload(sandbox: Sandbox) -> Sandbox:
    return await Sandbox.objects.select_related("template").aget(pk=sandbox.pk)
