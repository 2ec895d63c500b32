"""The sandbox metrics sampler: every few seconds the node asks each of its running
sandboxes' envd for ``GET /metrics`` (guest CPU %, memory, disk) and stores one
``SandboxMetric`` row per answer, which the API serves as E2B's
``GET /sandboxes/{id}/metrics``.

Why on the node: only the node reaches a guest's envd (its slot address), and it knows
which VMs it runs. The sandboxes sampled are read from the database every round, so a
kill or a pause stops a sandbox's sampling at the next round, and a sample taken while
one was being paused or killed is dropped, not stored. Samples older than
``AENV_SANDBOX_METRICS_RETENTION`` are deleted as the rounds go.
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

from django.db import IntegrityError, transaction
from django.utils import timezone

from envd_client import EnvdClient, EnvdError
from sandboxes.models import Sandbox, SandboxMetric
from sandboxes.states import SandboxState

from .periodic import Periodic

log = logging.getLogger(__name__)

SAMPLE_THREADS = 8
PRUNE_EVERY = 12  # rounds between retention deletes


def sampled_sandboxes(node_id: str) -> list[dict]:
    """The sandboxes of this node whose envd is asked: running ones with a route (not
    pausing, paused, snapshotting, forking or being killed: those VMs may be frozen)."""
    return list(Sandbox.objects.filter(node_id=node_id, state=SandboxState.RUNNING)
                .exclude(envd_host="").values("id", "envd_host", "envd_port", "envd_access_token"))


def ask_envd(row: dict, timeout: float) -> SandboxMetric | None:
    """One sandbox's sample, or None if its envd did not answer in time (logged at debug:
    a guest busy under TCG may miss a round)."""
    try:
        with EnvdClient.at(row["envd_host"], row["envd_port"], row["envd_access_token"] or None,
                           timeout=timeout, connect_timeout=timeout) as envd:
            m = envd.metrics(timeout=timeout)
    except EnvdError as exc:
        log.debug("metrics of sandbox %s: %s", row["id"], exc)
        return None
    return SandboxMetric(sandbox_id=row["id"], timestamp=timezone.now(), cpu_count=m.cpu_count,
                         cpu_used_pct=m.cpu_used_pct, mem_used=m.mem_used, mem_total=m.mem_total,
                         mem_cache=m.mem_cache, disk_used=m.disk_used, disk_total=m.disk_total)


def store(samples: list[SandboxMetric]) -> int:
    """Inserts the samples of sandboxes still running now; returns how many."""
    if not samples:
        return 0
    running = set(Sandbox.objects.filter(pk__in=[s.sandbox_id for s in samples], state=SandboxState.RUNNING)
                  .values_list("pk", flat=True))
    keep = [s for s in samples if s.sandbox_id in running]
    try:
        with transaction.atomic():
            SandboxMetric.objects.bulk_create(keep)
        return len(keep)
    except IntegrityError:  # a sandbox row deleted meanwhile: store the others one by one
        stored = 0
        for sample in keep:
            try:
                with transaction.atomic():
                    sample.save()
                stored += 1
            except IntegrityError:
                pass
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
        self._rounds = 0

    def sample_once(self) -> int:
        """One round: ask every running sandbox (in parallel), store the answers."""
        rows = sampled_sandboxes(self.node_id)
        timeout = max(0.5, min(2.0, self.interval / 2))
        if rows:
            with ThreadPoolExecutor(max_workers=min(SAMPLE_THREADS, len(rows)),
                                    thread_name_prefix=f"metrics-{self.node_id}") as pool:
                samples = [s for s in pool.map(lambda r: ask_envd(r, timeout), rows) if s is not None]
        else:
            samples = []
        stored = store(samples)
        if self.on_round is not None:
            self.on_round(len(rows), stored)
        self._rounds += 1
        if self.retention_s and self._rounds % PRUNE_EVERY == 1:
            prune(self.retention_s)
        return stored

    def round(self) -> None:
        self.sample_once()
