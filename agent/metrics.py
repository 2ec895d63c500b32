"""The sandbox metrics sampler: every few seconds the node asks its running sandboxes'
envd for ``GET /metrics`` (guest CPU %, memory, disk) and stores one ``SandboxMetric`` row
per answer, which the API serves as E2B's ``GET /sandboxes/{id}/metrics``.

What it costs the guests (issue 26): under TCG every request into a guest is emulated work,
and asking an idle guest every 5 s over a new TCP connection cost it more host CPU than the
idle guest itself (docs/benchmarks.md, "Idle guests"). So the sampler keeps one client with
one kept-alive connection per guest from round to round (``Scraper``: one event loop owned by
the sampler's thread), and asks an *idle* sandbox only every ``idle_interval`` seconds
instead of every round. Idle: its last sample showed the guest under ``IDLE_GUEST_CPU_PCT``
and, where the node can read it (``host_cpu``: the VM process's CPU time, no guest involved),
its VM took under ``IDLE_HOST_CPU_PCT`` of a core since the previous round; a guest that
gets busy is asked again from the next round on. envd's CPU % is the average since the
previous request (up to 30 s), so an idle sandbox's samples are fewer, not wrong.

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
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import httpx

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
IDLE_GUEST_CPU_PCT = 5.0  # a sample under this (% of the guest's vCPUs) counts as idle
IDLE_HOST_CPU_PCT = 3.0  # a VM under this (% of a host core since the last round) counts as idle
# A kept-alive connection unused this long is closed by the client (envd keeps one 75 s):
# longer than any idle interval, so an idle guest's next request reuses it.
KEEPALIVE_EXPIRY = 60.0
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


async def ask_envd(row: dict, timeout: float, client: AsyncEnvdClient | None = None) -> SandboxMetric | None:
    """One sandbox's sample, or None: its envd did not answer within ``timeout`` in all
    (logged at debug: a guest busy under TCG may miss a round), or answered too much or
    something that is no sample (logged as a warning: only a guest that replaced envd does).
    ``client``: a kept one (``Scraper``), else a new connection made and closed here."""
    try:
        if client is not None:
            m = await client.metrics(timeout=timeout)
        else:
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


async def _collect(rows: list[dict], deadline: float, ask=ask_envd) -> list[SandboxMetric]:
    gate = asyncio.Semaphore(ROUND_CONCURRENCY)

    async def one(row: dict) -> SandboxMetric | None:
        async with gate:
            try:
                return await ask(row, deadline)
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


def vm_cpu_seconds(driver) -> dict[str, float]:
    """sandbox id → CPU seconds its VM process has used so far (user + system, all threads,
    ``/proc/<pid>/stat``), for the VMs running on this node: what the host knows of a guest's
    activity without asking it."""
    tick = float(os.sysconf("SC_CLK_TCK"))
    out = {}
    for info in driver.list():
        if not info.pid or getattr(info.status, "value", info.status) != "running":
            continue
        try:
            fields = Path(f"/proc/{info.pid}/stat").read_text().rpartition(")")[2].split()
            out[info.sandbox_id] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        except (OSError, ValueError, IndexError):
            continue
    return out


@dataclass
class Seen:
    """What the sampler knows of one sandbox between rounds."""

    asked_at: float = 0.0  # monotonic time of its last request
    cpu_pct: float | None = None  # its last sample's guest CPU %, None: the last request failed


class Scraper:
    """The node's envd clients, kept from round to round on one event loop owned by the
    calling thread (one client and at most one kept-alive connection per guest), and the
    choice of which sandboxes are asked in a round (every round while busy, every
    ``idle_interval`` seconds while idle). ``host_cpu()``: sandbox id → its VM's CPU seconds
    so far (``vm_cpu_seconds``), or None where the node cannot read it."""

    def __init__(self, interval: float, idle_interval: float,
                 host_cpu: Callable[[], dict[str, float]] | None = None, clock=time.monotonic):
        self.interval = interval
        self.idle_interval = max(interval, idle_interval)
        self.host_cpu = host_cpu
        self.clock = clock
        self.loop = asyncio.new_event_loop()
        self.seen: dict[str, Seen] = {}
        self._clients: dict[str, tuple[tuple, AsyncEnvdClient]] = {}
        self._host: dict[str, tuple[float, float]] = {}  # sandbox id → (when, its VM's CPU seconds then)
        self._host_pct: dict[str, float] = {}

    # -- which sandboxes are asked ---------------------------------------------------------

    def _read_host(self, ids: set[str]) -> None:
        """Each VM's host CPU % of a core since the previous round, where readable."""
        self._host_pct = {}
        if self.host_cpu is None:
            return
        try:
            now_cpu = self.host_cpu()
        except Exception:  # noqa: BLE001 - without it every sandbox is judged by its samples alone
            log.exception("metrics: reading the VMs' host CPU")
            now_cpu = {}
        now = self.clock()
        for sid in ids:
            if sid not in now_cpu:
                self._host.pop(sid, None)
                continue
            before = self._host.get(sid)
            if before is not None and now > before[0]:
                self._host_pct[sid] = 100.0 * (now_cpu[sid] - before[1]) / (now - before[0])
            self._host[sid] = (now, now_cpu[sid])

    def idle(self, sid: str) -> bool:
        """Whether the sandbox looked idle: its last sample (which came) under
        ``IDLE_GUEST_CPU_PCT`` and its VM, where known, under ``IDLE_HOST_CPU_PCT``."""
        seen = self.seen.get(sid)
        if seen is None or seen.cpu_pct is None or seen.cpu_pct >= IDLE_GUEST_CPU_PCT:
            return False
        return self._host_pct.get(sid, 0.0) < IDLE_HOST_CPU_PCT

    def due(self, rows: list[dict]) -> list[dict]:
        """The rows to ask this round: new ones, busy ones, ones whose last request failed,
        and idle ones whose last request is ``idle_interval`` old (within half a round).
        Forgets (and disconnects from) sandboxes no longer among ``rows``."""
        ids = {row["id"] for row in rows}
        self.forget(set(self.seen) - ids)
        self._read_host(ids)
        now = self.clock()
        return [row for row in rows if not self.idle(row["id"])
                or now - self.seen[row["id"]].asked_at >= self.idle_interval - self.interval / 2]

    # -- asking ----------------------------------------------------------------------------

    def _client(self, row: dict, timeout: float) -> AsyncEnvdClient:
        key = (row["envd_host"], row["envd_port"], row["envd_access_token"] or None)
        held = self._clients.get(row["id"])
        if held is not None and held[0] == key:
            return held[1]
        if held is not None:  # resumed elsewhere, or a new token: the old connection is of no use
            self._close_later(held[1])
        # verify=False: plain http to envd, so no TLS context (httpx's default costs ~20 ms to build)
        transport = httpx.AsyncHTTPTransport(verify=False, limits=httpx.Limits(
            max_connections=1, max_keepalive_connections=1, keepalive_expiry=KEEPALIVE_EXPIRY))
        client = AsyncEnvdClient.at(key[0], key[1], key[2], timeout=timeout, connect_timeout=timeout,
                                    transport=transport)
        self._clients[row["id"]] = (key, client)
        return client

    async def _ask(self, row: dict, timeout: float) -> SandboxMetric | None:
        sid = row["id"]
        seen = self.seen.setdefault(sid, Seen())
        seen.asked_at, seen.cpu_pct = self.clock(), None
        try:
            sample = await ask_envd(row, timeout, self._client(row, timeout))
        except BaseException:
            self._drop(sid)
            raise
        if sample is None:
            self._drop(sid)  # a failed or refused answer: its connection is not reused
        else:
            seen.cpu_pct = sample.cpu_used_pct
        return sample

    def collect(self, rows: list[dict], deadline: float) -> list[SandboxMetric]:
        """``collect`` over the kept clients: the samples that came within ``deadline``."""
        samples = self.loop.run_until_complete(_collect(rows, deadline, self._ask)) if rows else []
        self._settle()
        return samples

    def _settle(self) -> None:
        """Lets the closes started since (and late requests cancelled) finish, so nothing of
        a round holds a socket past the next one."""
        pending = asyncio.all_tasks(self.loop)
        if pending:
            self.loop.run_until_complete(asyncio.wait(pending, timeout=2.0))

    # -- connections -----------------------------------------------------------------------

    def _drop(self, sid: str) -> None:
        held = self._clients.pop(sid, None)
        if held is not None:
            self._close_later(held[1])

    def _close_later(self, client: AsyncEnvdClient) -> None:
        self.loop.create_task(_close(client))  # runs in this or the next round's loop run

    def forget(self, ids: set[str]) -> None:
        """Drops what is kept of sandboxes no longer sampled (killed, paused, moved)."""
        for sid in ids:
            self.seen.pop(sid, None)
            self._host.pop(sid, None)
            self._drop(sid)

    def close(self) -> None:
        """Closes every kept connection and the event loop."""
        if self.loop.is_closed():
            return
        self.forget(set(self.seen) | set(self._clients))
        self._settle()
        for task in asyncio.all_tasks(self.loop):
            task.cancel()
        self.loop.run_until_complete(self.loop.shutdown_default_executor())
        self.loop.close()


async def _close(client: AsyncEnvdClient) -> None:
    try:
        async with asyncio.timeout(2.0):
            await client.aclose()
    except Exception:  # noqa: BLE001 - a guest's socket that will not close cleanly is gone anyway
        pass


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
    """Samples every ``interval`` seconds until stopped (idle sandboxes every
    ``idle_interval``: ``Scraper``); never dies on a DB or envd error. ``on_round(asked,
    stored)`` (the node's Prometheus counters) is told each round's counts. The scraper's
    event loop belongs to the thread that runs the rounds (the sampler's own once started)."""

    def __init__(self, node_id: str, interval: float, retention_s: float, on_round=None,
                 idle_interval: float | None = None, host_cpu: Callable[[], dict[str, float]] | None = None):
        super().__init__(f"metrics-{node_id}", interval, at_once=True)
        self.node_id = node_id
        self.retention_s = retention_s
        self.on_round = on_round
        self.idle_interval = interval if idle_interval is None else idle_interval
        self.host_cpu = host_cpu
        self.last_round_seconds = 0.0  # how long the last round waited for the guests
        self.scraper: Scraper | None = None
        self._rounds = 0

    def sample_once(self) -> int:
        """One round: ask the sandboxes due (``Scraper.due``) at once, store the answers
        that came within the round's deadline."""
        if self.scraper is None:
            self.scraper = Scraper(self.interval, self.idle_interval, self.host_cpu)
        rows = self.scraper.due(sampled_sandboxes(self.node_id))
        started = time.monotonic()
        samples = self.scraper.collect(rows, round_deadline(self.interval))
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

    def run(self) -> None:
        try:
            super().run()
        finally:
            self.close()

    def close(self) -> None:
        """Closes the kept connections (in the thread that ran the rounds)."""
        if self.scraper is not None:
            self.scraper.close()
            self.scraper = None
