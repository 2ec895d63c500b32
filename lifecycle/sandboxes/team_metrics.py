"""A team's sandbox counts over time, as E2B's ``GET /teams/{id}/metrics`` and
``/metrics/max`` serve them: how many of its sandboxes ran at once (``concurrentSandboxes``,
the most in each step) and how many were started per second (``sandboxStartRate``).

Why computed and not sampled: E2B samples a gauge every 5 s into ClickHouse; aenv already
keeps, for every sandbox, the moment it was created and each state change with its time
(``SandboxEvent``), so the exact series can be read back from those for any window, with
nothing new to store or expire. A sandbox counts as running while the E2B API shows it as
``running`` (``sandboxes.states.E2B_VIEW``: creating, running, resuming, snapshotting, forking,
killing); paused ones do not count. A start is a new sandbox (a create, a restore from a
snapshot, a fork child); a resume is not a start.

Steps follow E2B's table (5 s under an hour … 15 min from a week); a window longer than
``MAX_POINTS`` steps of 15 min gets a longer step (a multiple of 15 min), so an answer never
has more than ``MAX_POINTS`` points."""
from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from django.db.models import Q

from sandboxes.models import Sandbox, SandboxEvent, Team
from sandboxes.states import E2B_VIEW, LIVE

DEFAULT_RANGE = timedelta(days=7)
RATE_STEP = 5  # seconds: the window E2B's maximum start rate is measured over (its export period)
STEPS = ((3600, 5), (6 * 3600, 30), (12 * 3600, 60), (24 * 3600, 120), (7 * 24 * 3600, 300))
LONG_STEP = 900
MAX_POINTS = 2880
RUNNING = frozenset(state for state, shown in E2B_VIEW.items() if shown == "running")
METRICS = ("concurrent_sandboxes", "sandbox_start_rate")


@dataclass(frozen=True)
class Point:
    timestamp: datetime
    concurrent_sandboxes: int
    sandbox_start_rate: float


@dataclass(frozen=True)
class MaxPoint:
    timestamp: datetime
    value: float


def step_for(seconds: float) -> int:
    """E2B's step for a window of ``seconds`` (then longer, past ``MAX_POINTS`` long steps)."""
    for below, step in STEPS:
        if seconds < below:
            return step
    return LONG_STEP * max(1, math.ceil(seconds / (LONG_STEP * MAX_POINTS)))


def window(start: int | None, end: int | None, now: datetime | None = None) -> tuple[datetime, datetime]:
    """``start`` / ``end`` (unix seconds, either omitted: a week ago / now) as datetimes.
    The caller has checked that start is not after end."""
    now = now or datetime.now(timezone.utc)
    return (datetime.fromtimestamp(start, timezone.utc) if start is not None else now - DEFAULT_RANGE,
            datetime.fromtimestamp(end, timezone.utc) if end is not None else now)


async def _changes(team: Team, start: datetime, end: datetime) -> tuple[list, list[float]]:
    """``([(unix time, +1 | -1)], [creation unix times])``: each moment one of the team's
    sandboxes began or stopped counting as running, up to ``end``, for every sandbox that may
    have run in the window; and when each of them was created."""
    around = Q(created_at__lte=end) & (Q(updated_at__gte=start) | Q(state__in=list(LIVE)))
    sandboxes = {sid: (created.timestamp(), state) async for sid, created, state in
                 Sandbox.objects.filter(around, team=team).values_list("id", "created_at", "state")}
    events: dict[str, list[tuple[float, str]]] = {}
    async for sid, at, to_state in (SandboxEvent.objects.filter(
            sandbox__team=team, sandbox__created_at__lte=end, started_at__lte=end)
            .filter(Q(sandbox__updated_at__gte=start) | Q(sandbox__state__in=list(LIVE)))
            .exclude(to_state="").order_by("started_at", "id").values_list("sandbox_id", "started_at", "to_state")):
        events.setdefault(sid, []).append((at.timestamp(), to_state))
    deltas = []
    for sid, (created, state) in sandboxes.items():
        timeline = events.get(sid) or [(created, state)]  # no history kept: its state since creation
        running = False
        for at, to_state in timeline:
            now_running = to_state in RUNNING
            if now_running != running:
                deltas.append((at, 1 if now_running else -1))
                running = now_running
    deltas.sort()
    return deltas, sorted(created for created, _ in sandboxes.values())


async def series(team: Team, start: datetime, end: datetime) -> list[Point]:
    """One point per step from the step holding ``start`` to the one holding ``end``
    (steps aligned to multiples of the step in unix time, as E2B's are): the most sandboxes
    running at once in it, and its starts per second."""
    t0, t1 = start.timestamp(), end.timestamp()
    step = step_for(t1 - t0)
    deltas, created = await _changes(team, start, end)
    first = math.floor(t0 / step) * step
    count = int((math.floor(t1 / step) * step - first) // step) + 1
    level = 0
    i = 0
    while i < len(deltas) and deltas[i][0] < first:
        level += deltas[i][1]
        i += 1
    c = 0
    while c < len(created) and created[c] < first:
        c += 1
    points = []
    for n in range(count):
        lo, hi = first + n * step, first + (n + 1) * step
        peak = level
        while i < len(deltas) and deltas[i][0] < hi:
            level += deltas[i][1]
            peak = max(peak, level)
            i += 1
        starts = 0
        while c < len(created) and created[c] < hi:
            starts += 1
            c += 1
        points.append(Point(datetime.fromtimestamp(lo, timezone.utc), max(peak, 0), starts / step))
    return points


async def maximum(team: Team, metric: str, start: datetime, end: datetime,
                  now: datetime | None = None) -> MaxPoint:
    """The largest value of ``metric`` in the window and when it was reached: the first
    moment the most sandboxes ran at once, or the start of the 5 s with the most starts.
    Nothing in the window: 0 at the window's end (E2B answers 0 too)."""
    now = now or datetime.now(timezone.utc)
    t0, t1 = start.timestamp(), end.timestamp()
    deltas, created = await _changes(team, start, end)
    best, when = 0.0, min(t1, now.timestamp())
    if metric == "concurrent_sandboxes":
        level = sum(d for at, d in deltas if at < t0)
        if level > 0:
            best, when = float(level), t0
        for at, d in deltas:
            if t0 <= at <= t1:
                level += d
                if level > best:
                    best, when = float(level), at
    else:
        per_bucket: dict[int, int] = {}
        for at in created:
            if t0 <= at <= t1:
                bucket = math.floor(at / RATE_STEP) * RATE_STEP
                per_bucket[bucket] = per_bucket.get(bucket, 0) + 1
        if per_bucket:
            bucket, most = min(per_bucket.items(), key=lambda kv: (-kv[1], kv[0]))
            best, when = most / RATE_STEP, bucket
    return MaxPoint(datetime.fromtimestamp(when, timezone.utc), best)
