"""TTL and retention enforcement: what the lifecycle sweeper does once per tick.

Why a sweeper over the database (and not a timer per sandbox): the deadlines live in
the ``end_at`` column, so expiry survives restarts of every process, and any number
of sweepers may run at once — each action goes through the lifecycle service, whose
conditional transitions ("running and still expired", "paused and untouched since
we looked") let exactly one sweeper act and make the others skip.

Rules:
- a running sandbox past ``end_at`` is paused (``auto_pause``; filesystem-only when
  ``auto_pause_memory`` is false) or killed (``autoPause: false``);
- a sandbox paused for longer than AENV_PAUSED_RETENTION seconds is killed, which
  deletes its files on the node (0 keeps paused sandboxes forever);
- a fork capture stored for children on other nodes is deleted once none of them is live
  (``lifecycle.snapshots.captures``, every ``CAPTURE_SWEEP`` seconds);
- new lifecycle events are made and their due webhook attempts handed to the events worker
  (``events.dispatch``), and events past AENV_EVENT_RETENTION_DAYS deleted (every
  ``EVENTS_PURGE`` seconds).
Every action is recorded by the service as SandboxEvents with actor ``lifecycle``."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections
from django.db.models import OuterRef, Subquery
from django.db.models.functions import Coalesce
from django.utils import timezone

from events import dispatch as events_dispatch
from lifecycle import lost
from lifecycle.sandboxes import kill, pause
from lifecycle.snapshots import captures
from sandboxes.errors import Conflict, LifecycleError, NotFound
from sandboxes.models import Sandbox, SandboxEvent, Team
from sandboxes.states import SandboxState

log = logging.getLogger(__name__)

ACTOR = "lifecycle"
S = SandboxState


@dataclass(frozen=True)
class Action:
    """One thing the sweeper decided to do: ``kind`` is expire_pause, expire_kill or
    retention_kill; ``seen`` is the moment the decision was based on."""

    sandbox_id: str
    team_id: object
    kind: str
    seen: datetime
    memory: bool = True
    updated_at: datetime | None = None


def _paused_since():
    """When the sandbox last became paused: the newest event that moved it there."""
    last = (SandboxEvent.objects.filter(sandbox=OuterRef("pk"), to_state=S.PAUSED)
            .order_by("-started_at").values("started_at")[:1])
    return Coalesce(Subquery(last), "updated_at")


async def due(now: datetime | None = None, *, limit: int = 100, retention: int | None = None) -> list[Action]:
    """The actions due at ``now``: expired running sandboxes (oldest deadline first),
    then paused sandboxes past the retention period."""
    now = now or timezone.now()
    retention = settings.AENV_PAUSED_RETENTION if retention is None else retention
    actions = []
    expired = Sandbox.objects.filter(state=S.RUNNING, end_at__lte=now).order_by("end_at")[:limit]
    async for sb in expired.only("id", "team_id", "auto_pause", "auto_pause_memory"):
        kind = "expire_pause" if sb.auto_pause else "expire_kill"
        actions.append(Action(sb.id, sb.team_id, kind, now, memory=sb.auto_pause_memory))
    if retention > 0 and len(actions) < limit:
        cutoff = now - timedelta(seconds=retention)
        old = (Sandbox.objects.filter(state=S.PAUSED).annotate(paused_since=_paused_since())
               .filter(paused_since__lte=cutoff).order_by("paused_since")[: limit - len(actions)])
        async for sb in old.only("id", "team_id", "updated_at"):
            actions.append(Action(sb.id, sb.team_id, "retention_kill", now, updated_at=sb.updated_at))
    return actions


async def apply(action: Action) -> str:
    """Carries out one action through the lifecycle service; returns its outcome
    ("paused", "killed", or "skipped: …" when another sweeper or a user got there first,
    "failed: …" when the node failed — the service has recorded that already)."""
    team = Team(pk=action.team_id)
    try:
        if action.kind == "expire_pause":
            await pause.pause_sandbox(team, action.sandbox_id, memory=action.memory, actor=ACTOR,
                                         expired_by=action.seen)
            return "paused"
        if action.kind == "expire_kill":
            await kill.kill_sandbox(team, action.sandbox_id, actor=ACTOR, from_states=[S.RUNNING],
                                    where={"end_at__lte": action.seen}, reason="expired")
            return "killed"
        if action.kind == "retention_kill":
            await kill.kill_sandbox(team, action.sandbox_id, actor=ACTOR, from_states=[S.PAUSED],
                                    where={"updated_at": action.updated_at}, reason="retention")
            return "killed"
        raise ValueError(f"unknown action {action.kind!r}")
    except (NotFound, Conflict) as exc:
        return f"skipped: {exc.message}"
    except LifecycleError as exc:
        log.warning("lifecycle %s of %s failed: %s", action.kind, action.sandbox_id, exc.message)
        return f"failed: {exc.message}"


class Sweeper:
    """Runs due actions with bounded concurrency and never starts a second action for a
    sandbox whose first one (a slow pause under TCG) is still running in this process."""

    # After a failed action (node down) the sandbox is left alone this long, so a broken
    # node is not asked again every tick.
    BACKOFF = 30.0
    # How often unused fork captures are looked for (a query; a release asks nodes).
    CAPTURE_SWEEP = 10.0
    # How often expired lifecycle events are deleted (new ones are made every tick).
    EVENTS_PURGE = 60.0

    def __init__(self, concurrency: int | None = None, limit: int = 100):
        self.concurrency = concurrency or settings.AENV_LIFECYCLE_CONCURRENCY
        self.limit = limit
        self.running: dict[str, asyncio.Task] = {}
        self.backoff: dict[str, float] = {}
        self.outcomes: list[tuple[str, str, str]] = []
        self.releasing: asyncio.Task | None = None
        self.released_at: float | None = None
        self.eventing: asyncio.Task | None = None
        self.purged_at: float | None = None

    async def tick(self, now: datetime | None = None) -> list[Action]:
        """Declares the sandboxes of dead nodes lost (lifecycle.lost), then starts the
        actions due now (up to the free concurrency); returns them."""
        for sandbox_id, was, now_state in await lost.mark_lost(now):
            log.warning("lifecycle: sandbox %s (%s) lost with its node → %s", sandbox_id, was, now_state)
        self._release_captures()
        self._events()
        free = self.concurrency - len(self.running)
        if free <= 0:
            return []
        started = []
        mono = asyncio.get_running_loop().time()
        self.backoff = {k: v for k, v in self.backoff.items() if v > mono}
        for action in await due(now, limit=self.limit + len(self.running) + len(self.backoff)):
            if action.sandbox_id in self.running or action.sandbox_id in self.backoff:
                continue
            task = asyncio.create_task(self._run(action))
            self.running[action.sandbox_id] = task
            started.append(action)
            if len(started) >= free:
                break
        return started

    def _release_captures(self) -> None:
        """Starts a release of unused fork captures in the background, at most every
        ``CAPTURE_SWEEP`` seconds and one at a time (it waits for nodes)."""
        mono = asyncio.get_running_loop().time()
        if (self.releasing is not None and not self.releasing.done()) or \
                (self.released_at is not None and mono - self.released_at < self.CAPTURE_SWEEP):
            return
        self.released_at = mono

        async def release() -> None:
            try:
                for snapshot_id in await captures.release_unused(actor=ACTOR):
                    self.outcomes.append((snapshot_id, "release_capture", "deleted"))
            except Exception:  # noqa: BLE001 - a bug must not stop the sweeper
                log.exception("lifecycle: releasing fork captures failed")
        self.releasing = asyncio.create_task(release())

    def _events(self) -> None:
        """Starts a pass of the events work (``events.dispatch.run``) in the background,
        one at a time, so slow webhook bookkeeping never delays an expiry."""
        if self.eventing is not None and not self.eventing.done():
            return
        mono = asyncio.get_running_loop().time()
        purge = self.purged_at is None or mono - self.purged_at >= self.EVENTS_PURGE
        if purge:
            self.purged_at = mono

        async def run() -> None:
            try:
                await sync_to_async(events_dispatch.run)(purge=purge)
            except Exception:  # noqa: BLE001 - a bug or a database blip must not stop the sweeper
                log.exception("lifecycle: the events pass failed")
        self.eventing = asyncio.create_task(run())

    async def _run(self, action: Action) -> None:
        try:
            outcome = await apply(action)
        except Exception as exc:  # noqa: BLE001 - a bug must not stop the sweeper
            log.exception("lifecycle %s of %s crashed", action.kind, action.sandbox_id)
            outcome = f"failed: {type(exc).__name__}: {exc}"
        finally:
            self.running.pop(action.sandbox_id, None)
        if outcome.startswith("failed"):
            self.backoff[action.sandbox_id] = asyncio.get_running_loop().time() + self.BACKOFF
        self.outcomes.append((action.sandbox_id, action.kind, outcome))
        log.info("lifecycle: %s %s → %s", action.kind, action.sandbox_id, outcome)

    async def drain(self, timeout: float | None = None) -> None:
        """Waits for the actions in flight (shutdown, tests)."""
        waiting = list(self.running.values()) + [t for t in (self.releasing, self.eventing) if t is not None]
        if waiting:
            await asyncio.wait(waiting, timeout=timeout)

    async def run(self, period: float, stop: asyncio.Event, heartbeat: Callable[[], None] | None = None) -> None:
        """Ticks every ``period`` seconds until ``stop`` is set; a failing tick (database
        briefly unreachable) is logged and retried on the next one. ``heartbeat`` is called
        after each tick that went through (run_lifecycle --heartbeat: a liveness file)."""
        while not stop.is_set():
            try:
                await self.tick()
            except Exception:  # noqa: BLE001
                log.exception("lifecycle sweep failed")
            else:
                if heartbeat is not None:
                    heartbeat()
            finally:
                # A long-lived loop has no request cycle: drop a broken connection here.
                await sync_to_async(close_old_connections)()
            try:
                await asyncio.wait_for(stop.wait(), timeout=period)
            except asyncio.TimeoutError:
                pass


async def sweep_once(now: datetime | None = None) -> list[tuple[str, str, str]]:
    """One full sweep, waiting for every action: ``[(sandbox_id, kind, outcome)]``."""
    sweeper = Sweeper(concurrency=100)
    await sweeper.tick(now)
    await sweeper.drain()
    return sweeper.outcomes
