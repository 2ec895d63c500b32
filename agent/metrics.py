"""The sandbox metrics sampler: every few seconds the node asks each of its running
sandboxes' envd for ``GET /metrics`` (guest CPU %, memory, disk) and stores one
``SandboxMetric`` row per answer, which the API serves as E2B's
``GET /sandboxes/{id}/metrics``.

Why on the node: only the node reaches a guest's envd (its slot address), and it knows
which VMs it runs. The sandboxes sampled are read from the database every round, so a
kill or a pause stops a sandbox's sampling at the next round, and a sample taken while
one was being paused or killed is dropped, not stored. Samples older than
``AENV_SANDBOX_METRICS_RETENTION`` are deleted as the rounds go.

A guest is hostile: what answers on envd's port may be anything the guest's root put there.
All sandboxes are asked at once in one event loop, and the round waits for them at most
``round_deadline(interval)``: a guest that drips or never answers is skipped this round and
leaves nothing behind (no thread, no connection). An answer is read up to
``envd_client.limits.METRICS_BYTES`` and every figure checked against its column's range;
a bad answer drops that sandbox's sample only, never the round's.
"""
from __future__ import annotations

import asyncio
import logging
import time
from datetime import timedelta

from django.db import DatabaseError, transaction
from django.utils import timezone

from envd_client import AsyncEnvdClient, EnvdError, EnvdUnavailable
from envd_client import limits as envd_limits
from envd_client.protocol import METRICS_TIMEOUT
from sandboxes.models import Sandbox, SandboxMetric
from sandboxes.states import SandboxState

from agent.periodic import Periodic

log = logging.getLogger(__name__)

ROUND_CONCURRENCY = 64  # envd asked at once (one event loop, no thread per guest)
PRUNE_EVERY = 12  # rounds between retention deletes
# What a failed insert of a guest's figures can raise: the database refusing a value
# (DataError, IntegrityError) or the driver refusing to bind it (sqlite3: OverflowError).
INSERT_ERRORS = (DatabaseError, OverflowError, ValueError)


def round_deadline(interval: float) -> float:
    """How long a round waits for the guests: half the interval, at most envd's
    METRICS_TIMEOUT, at least half a second. A guest that has not answered by then
    is skipped this round."""
    return max(0.5, min(METRICS_TIMEOUT, interval / 2))


def sampled_sandboxes(node_id: str) -> list[dict]:
    """The sandboxes of this node whose envd is asked: running ones with a route (not
    pausing, paused, snapshotting, forking or being killed: those VMs may be frozen)."""
    return list(Sandbox.objects.filter(node_id=node_id, state=SandboxState.RUNNING)
                .exclude(envd_host="").values("id", "envd_host", "envd_port", "envd_access_token"))


async def ask_envd(row: dict, timeout: float) -> SandboxMetric | None:
    """One sandbox's sample, or None: its envd did not answer within ``timeout`` in all
    (logged at debug: a guest busy under TCG may miss a round), or answered too much or
    something that is no sample (logged as a warning: only a guest that replaced envd does)."""
    try:
        async with AsyncEnvdClient.at(row["envd_host"], row["envd_port"], row["envd_access_token"] or None,
                                      timeout=timeout, connect_timeout=timeout) as envd:
            m = await envd.metrics(timeout=timeout)
    except EnvdUnavailable as exc:
        log.debug("metrics of sandbox %s: %s", row["id"], exc)
        return None
    except EnvdError as exc:
        log.warning("metrics of sandbox %s dropped: %s", row["id"], exc)
        return None
    return SandboxMetric(sandbox_id=row["id"], timestamp=timezone.now(), cpu_count=m.cpu_count,
                         cpu_used_pct=m.cpu_used_pct, mem_used=m.mem_used, mem_total=m.mem_total,
                         mem_cache=m.mem_cache, disk_used=m.disk_used, disk_total=m.disk_total)


async def _collect(rows: list[dict], deadline: float) -> list[SandboxMetric]:
    gate = asyncio.Semaphore(ROUND_CONCURRENCY)

    async def one(row: dict) -> SandboxMetric | None:
        async with gate:
            try:
                return await ask_envd(row, deadline)
            except Exception:  # one guest never costs the others their samples
                log.exception("metrics of sandbox %s", row["id"])
                return None

    tasks = [asyncio.create_task(one(row)) for row in rows]
    done, late = await asyncio.wait(tasks, timeout=deadline)
    for task in late:
        task.cancel()
    if late:
        await asyncio.wait(late, timeout=1.0)  # their connections close; asyncio.run reaps the rest
        log.info("metrics: %d of %d sandboxes did not answer within the round's %.1f s",
                 len(late), len(rows), deadline)
    return [s for s in (task.result() for task in tasks if task in done) if s is not None]


def collect(rows: list[dict], deadline: float) -> list[SandboxMetric]:
    """Asks every row's envd at once, in one event loop of the calling thread, and returns
    the samples that came by ``deadline`` seconds; the calls still open then are cancelled,
    so nothing of a round outlives it (no thread, no connection)."""
    if not rows:
        return []
    return asyncio.run(_collect(rows, deadline))


def valid(sample: SandboxMetric) -> bool:
    """Whether every figure fits its column (``envd_client.limits``: the client checked
    them already; this keeps ``store`` safe whoever made the sample)."""
    try:
        envd_limits.guest_int(sample.cpu_count, "cpu_count", envd_limits.COUNT_MAX)
        envd_limits.guest_percent(sample.cpu_used_pct, "cpu_used_pct")
        for name in ("mem_used", "mem_total", "mem_cache", "disk_used", "disk_total"):
            envd_limits.guest_int(getattr(sample, name), name, envd_limits.BYTES_MAX)
    except ValueError as exc:
        log.warning("metrics of sandbox %s dropped: %s", sample.sandbox_id, exc)
        return False
    return True


def store(samples: list[SandboxMetric]) -> int:
    """Inserts the valid samples of sandboxes still running now; returns how many. A value
    the database refuses costs only its own sample: the others are then inserted one by one."""
    samples = [s for s in samples if valid(s)]
    if not samples:
        return 0
    running = set(Sandbox.objects.filter(pk__in=[s.sandbox_id for s in samples], state=SandboxState.RUNNING)
                  .values_list("pk", flat=True))
    keep = [s for s in samples if s.sandbox_id in running]
    try:
        with transaction.atomic():
            SandboxMetric.objects.bulk_create(keep)
        return len(keep)
    except INSERT_ERRORS:  # a sandbox row deleted meanwhile, or a value refused: store the others one by one
        stored = 0
        for sample in keep:
            sample.pk = None
            try:
                with transaction.atomic():
                    sample.save()
                stored += 1
            except INSERT_ERRORS as exc:
                log.warning("metrics of sandbox %s not stored: %s", sample.sandbox_id, exc)
        return stored


def prune(retention_s: float) -> int:
    """Deletes samples older than the retention; returns how many."""
    deleted, _ = SandboxMetric.objects.filter(timestamp__lt=timezone.now() - timedelta(seconds=retention_s)).delete()
    return deleted


class MetricsSampler(Periodic):
    """Samples every ``interval`` seconds until stopped; never dies on a DB or envd error.
    ``on_round(asked, stored)`` (the node's Prometheus counters) is told each round's counts."""

    def __init__(self, node_id: str, interval: float, retention_s: float, on_round=None):
        super().__init__(f"metrics-{node_id}", interval, at_once=True)
        self.node_id = node_id
        self.retention_s = retention_s
        self.on_round = on_round
        self.last_round_seconds = 0.0  # how long the last round waited for the guests
        self._rounds = 0

    def sample_once(self) -> int:
        """One round: ask every running sandbox at once, store the answers that came
        within the round's deadline."""
        rows = sampled_sandboxes(self.node_id)
        started = time.monotonic()
        samples = collect(rows, round_deadline(self.interval))
        self.last_round_seconds = time.monotonic() - started
        stored = store(samples)
        if self.on_round is not None:
            self.on_round(len(rows), stored)
        self._rounds += 1
        if self.retention_s and self._rounds % PRUNE_EVERY == 1:
            prune(self.retention_s)
        return stored

    def round(self) -> None:
        self.sample_once()
