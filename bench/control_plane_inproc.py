"""Benchmark helper (issue 26): the API's own CPU per lifecycle request, in-process.

``bench/control_plane.py`` measures the whole path (daphne, Django, the database, Celery there
and back, the node's bookkeeping) and its milliseconds move with the host's load. This runs
the API's ASGI application (``config.asgi.http_app``, middleware included) in this process
through httpx's ASGI transport, with the node's answer given at once in-process instead of
through the broker (``nodes.client._dispatch`` stubbed: no publish, no result wait), so what it
counts is Django, DRF, auth, the lifecycle's reads, transitions and events, the placement and
the thread hops: the API's part of each call without HTTP parsing or Celery. CPU is the
process's (``process_time``: every thread, the event loop's and the request's), less the same
client's cost for ``GET /health`` measured alongside, so the host's load moves it far less than
wall time. ``--profile``: cProfile on every thread, the top functions by own time printed.

    .venv/bin/python bench/control_plane_inproc.py [--runs 200] [--pg URL] [--profile] [--label before]

Prints the table; writes bench/results/control_plane_inproc-<UTC stamp>[-label].json and .md.
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import statistics
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.control_plane_pieces import fresh_database  # noqa: E402
from bench.lifecycle_common import write_results  # noqa: E402
from bench.templates import git_state  # noqa: E402

OPS = ("create", "pause", "resume", "connect", "kill")


def node_answers() -> dict:
    """What the node's tasks answer, by task name (the fields the lifecycle reads)."""
    booted = {"envd_host": "127.0.0.1", "envd_port": 40001, "pid": 4242, "accel": "tcg",
              "timings": {"total_ms": 1.0}}
    return {"boot": booted, "resume": {**booted, "envd_port": 40002}, "pause": {"to_disk": True, "timings": {}},
            "kill": {"killed": True}}


def stub_dispatch() -> None:
    """``nodes.client._dispatch`` answering at once with the task's usual result."""
    from celery import states  # noqa: PLC0415

    from nodes import client  # noqa: PLC0415

    answers = node_answers()

    async def dispatch(node, task, kwargs, deadline, what):
        for name, result in answers.items():
            if name in task:
                return {"status": states.SUCCESS, "result": dict(result)}
        raise AssertionError(f"no stub answer for the node task {task}")

    client._dispatch = dispatch


def fixtures():
    from django.utils import timezone  # noqa: PLC0415

    from nodes.models import Node  # noqa: PLC0415
    from sandboxes.models import ApiKey, Team, Template  # noqa: PLC0415

    team = Team.objects.create(name="bench", slug="bench-inproc")
    Template.objects.get_or_create(id="base", defaults=dict(alias="base", image="base", cpu_count=1, memory_mb=256,
                                                            disk_size_mb=2048))
    Node.objects.create(id="n-inproc", address="127.0.0.1", vcpu_capacity=10 ** 6, memory_mb_capacity=10 ** 9,
                        last_heartbeat_at=timezone.now())
    return ApiKey.generate(team)[1]


async def measure(key: str, runs: int, warmup: int) -> dict[str, list[float]]:
    import httpx  # noqa: PLC0415

    from config.asgi import http_app  # noqa: PLC0415
    from nodes.models import Node  # noqa: PLC0415

    cpu: dict[str, list[float]] = {op: [] for op in (*OPS, "health")}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=http_app), base_url="http://api",
                                 headers={"X-API-Key": key}, timeout=30) as api:
        async def timed(op, call, expect):
            c0 = time.process_time()
            r = await call()
            spent = (time.process_time() - c0) * 1e3
            assert r.status_code == expect, (op, r.status_code, r.text)
            return r, spent

        for i in range(warmup + runs):
            await Node.objects.filter(pk="n-inproc").aupdate(last_heartbeat_at=_now())
            r, c_create = await timed("create", lambda: api.post("/sandboxes", json={"templateID": "base"}), 201)
            sid = r.json()["sandboxID"]
            _, c_pause = await timed("pause", lambda: api.post(f"/sandboxes/{sid}/pause"), 204)
            _, c_resume = await timed("resume", lambda: api.post(f"/sandboxes/{sid}/connect", json={"timeout": 60}),
                                      201)
            _, c_connect = await timed("connect", lambda: api.post(f"/sandboxes/{sid}/connect",
                                                                   json={"timeout": 60}), 200)
            _, c_kill = await timed("kill", lambda: api.delete(f"/sandboxes/{sid}"), 204)
            _, c_health = await timed("health", lambda: api.get("/health"), 204)
            if i >= warmup:
                for op, spent in zip((*OPS, "health"), (c_create, c_pause, c_resume, c_connect, c_kill, c_health)):
                    cpu[op].append(spent)
    return cpu


def _now():
    from django.utils import timezone  # noqa: PLC0415

    return timezone.now()


class ThreadProfiles:
    """cProfile on this thread and on every thread started from now on (the request threads).
    Each profile's clock is its thread's CPU time, so a thread waiting (for the GIL, a queue,
    the event loop's poll) counts nothing: the table is where the CPU goes, not the wall time."""

    def __init__(self):
        self.profiles: list[cProfile.Profile] = []
        self._lock = threading.Lock()

    def _start(self, frame, event, arg):
        sys.setprofile(None)
        self._add().enable()

    def _add(self) -> cProfile.Profile:
        profile = cProfile.Profile(time.thread_time)
        with self._lock:
            self.profiles.append(profile)
        return profile

    def __enter__(self):
        threading.setprofile(self._start)
        self._add().enable()
        return self

    def __exit__(self, *exc):
        threading.setprofile(None)
        self.profiles[0].disable()

    def stats(self) -> pstats.Stats:
        stats = None
        for profile in self.profiles:
            profile.create_stats()
            if profile.stats:
                stats = pstats.Stats(profile) if stats is None else stats.add(profile)
        return stats


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--pg", default="", help="a PostgreSQL server URL: a fresh database there instead of SQLite")
    p.add_argument("--profile", action="store_true", help="cProfile every thread; print the top by own time")
    p.add_argument("--label", default="", help="added to the results' file name (e.g. before, after)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args()
    os.environ.setdefault("AENV_REQUEST_THREADS_IDLE", "16")
    import logging  # noqa: PLC0415

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request is the client's cost, not the API's
    with fresh_database(args.pg or None):
        from django.db import connection  # noqa: PLC0415

        stub_dispatch()
        key = fixtures()
        connection.close()  # the requests use their own threads' connections
        if args.profile:
            with ThreadProfiles() as profiles:
                cpu = asyncio.run(measure(key, args.runs, args.warmup))
            profiles.stats().sort_stats("tottime").print_stats(45)
        else:
            cpu = asyncio.run(measure(key, args.runs, args.warmup))
        vendor = connection.vendor
    write_results(args.out, "control_plane_inproc" + (f"-{args.label}" if args.label else ""),
                  *report(cpu, vendor, args))
    return 0


def report(cpu: dict[str, list[float]], vendor: str, args) -> tuple[dict, str]:
    """The results (JSON) and their table: CPU ms per request less ``GET /health``'s median."""
    health = statistics.median(cpu["health"])
    load = os.getloadavg()[0]
    table = {}
    for op in OPS:
        values = sorted(v - health for v in cpu[op])
        table[op] = {"p50": round(statistics.median(values), 2), "p90": round(values[int(0.9 * (len(values) - 1))], 2)}
    when = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    result = {"when": when, "git": git_state(), "database": vendor, "runs": args.runs, "load_1min": round(load, 2),
              "health_cpu_ms": round(health, 2), "cpu_ms_beyond_health": table, "label": args.label}
    lines = [f"{vendor}, {args.runs} runs, 1-min load {load:.2f}; CPU ms per request (median; GET /health "
             f"{health:.2f} ms, the client's and Django's floor, subtracted)", "",
             "| op | CPU ms p50 | p90 |", "|---|---:|---:|"]
    lines += [f"| {op} | {row['p50']:.2f} | {row['p90']:.2f} |" for op, row in table.items()]
    return result, "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
