"""Benchmark helper (issue 26): the control plane's pieces timed in-process, no stack, no VM,
no broker: each sync piece a lifecycle call runs (the ``templateID`` resolve, the placement
with its claim, the team's sandbox read, the state transitions with their events, the
create's insert) called directly on one thread against a database of its own (SQLite in a
temp dir, or ``--pg URL``: a fresh database there), CPU (``thread_time``) and wall per call,
median of ``--runs`` after a warm-up. A measuring tool for before / after a change to one of
them: the figures are a piece's own cost without thread hops, Django's request or Celery.

    .venv/bin/python bench/control_plane_pieces.py [--runs 300] [--pieces resolve,place,...] [--pg URL]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def setup(pg: str | None) -> str | None:
    home = tempfile.mkdtemp(prefix="aenv-cp-pieces-")
    os.environ["AENV_HOME"] = home
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    created = None
    if pg:
        import psycopg  # noqa: PLC0415

        created = f"aenv_pieces_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(pg, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {created}")
        os.environ["DATABASE_URL"] = pg.rsplit("/", 1)[0] + "/" + created
    else:
        os.environ.pop("DATABASE_URL", None)
    import django  # noqa: PLC0415

    django.setup()
    from django.core.management import call_command  # noqa: PLC0415

    call_command("migrate", verbosity=0)
    return created


def drop(pg: str, name: str) -> None:
    from django.db import connections  # noqa: PLC0415
    import psycopg  # noqa: PLC0415

    connections.close_all()
    with psycopg.connect(pg, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@contextmanager
def fresh_database(pg: str | None):
    """Django set up on a database of its own (``setup``), dropped again at the end."""
    created = setup(pg)
    try:
        yield
    finally:
        if created:
            drop(pg, created)


def timed(fn, runs: int, warmup: int = 30) -> dict:
    for _ in range(warmup):
        fn()
    cpu, wall = [], []
    for _ in range(runs):
        c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        fn()
        wall.append((time.perf_counter_ns() - w0) / 1000)
        cpu.append((time.thread_time_ns() - c0) / 1000)
    return {"cpu_us": round(statistics.median(cpu)), "wall_us": round(statistics.median(wall)),
            "wall_p90_us": round(sorted(wall)[int(0.9 * (len(wall) - 1))])}


def pieces(runs: int, only: set[str]) -> dict:
    from django.utils import timezone  # noqa: PLC0415

    from lifecycle import resolve  # noqa: PLC0415
    from lifecycle.sandboxes import core  # noqa: PLC0415
    from nodes import placement  # noqa: PLC0415
    from nodes.models import Node  # noqa: PLC0415
    from sandboxes.models import Sandbox, Team, Template  # noqa: PLC0415
    from sandboxes.states import LIVE, SandboxState as S  # noqa: PLC0415
    from sandboxes import transitions  # noqa: PLC0415

    team = Team.objects.create(name="bench", slug=f"bench-{uuid.uuid4().hex[:6]}")
    Template.objects.get_or_create(id="base", defaults=dict(alias="base", image="base", cpu_count=1, memory_mb=256,
                                                            disk_size_mb=2048))
    node = Node.objects.create(id=f"n-{uuid.uuid4().hex[:6]}", address="127.0.0.1", vcpu_capacity=10 ** 6,
                               memory_mb_capacity=10 ** 9, last_heartbeat_at=timezone.now())
    template = Template.objects.get(pk="base")

    def new_row(state=S.RUNNING) -> Sandbox:
        now = timezone.now()
        return Sandbox.objects.create(team=team, template=template, node=node, state=state, cpu_count=1,
                                      memory_mb=256, disk_size_mb=2048, created_at=now, started_at=now,
                                      end_at=now + timezone.timedelta(hours=1))

    for _ in range(20):  # a few live sandboxes on the node for the placement to count
        new_row()
    out = {}

    def want(name):
        return not only or name in only

    if want("resolve"):
        out["resolve base (resolve_source_sync)"] = timed(lambda: resolve.resolve_source_sync(team, "base"), runs)
    if want("place"):
        row = new_row(S.CREATING)

        def claim(n):
            Sandbox.objects.filter(pk=row.pk, state=S.CREATING).update(node=n)

        out["placement with its claim (place_sync)"] = timed(lambda: placement.place_sync(1, 256, claim=claim), runs)
    if want("visible"):
        row = new_row()
        out["visible's read (sandbox + node, team-scoped)"] = timed(
            lambda: core.visible_sync(team, row.pk) if hasattr(core, "visible_sync") else
            Sandbox.objects.select_related("node").filter(pk=row.pk, team=team, state__in=LIVE).order_by()[:1][0],
            runs)
    if want("transition"):
        row = new_row()
        flip = {"state": S.RUNNING}

        def pair():
            ev = core.event(row.pk, "pause", outcome="started", from_state=S.RUNNING, details={"memory": None})
            assert transitions.transition_sync(row.pk, [S.RUNNING], S.PAUSING, ev)
            ev = core.event(row.pk, "pause", from_state=S.PAUSING, details={"timings": {"total_ms": 1.0}})
            assert transitions.transition_row_sync(row.pk, [S.PAUSING], S.PAUSED, ev,
                                                   envd_unresponsive_at_pause=False) is not None
            Sandbox.objects.filter(pk=row.pk).update(**flip)

        def flip_only():
            Sandbox.objects.filter(pk=row.pk).update(state=S.RUNNING)
        base = timed(flip_only, runs)
        both = timed(pair, runs)
        out["pause's two transitions (transition_sync + transition_row_sync)"] = {
            k: both[k] - base[k] for k in ("cpu_us", "wall_us")}
        resumed = new_row(S.PAUSED)

        def resume_pair():
            ev = core.event(resumed.pk, "resume", outcome="started", from_state=S.PAUSED, details={"via": "connect"})
            assert transitions.transition_sync(resumed.pk, [S.PAUSED], S.RESUMING, ev, node=node,
                                               reserved_vcpus=None, reserved_memory_mb=None)
            now = timezone.now()
            ev = core.event(resumed.pk, "resume", from_state=S.RESUMING, details={"timings": {}})
            assert transitions.transition_row_sync(
                resumed.pk, [S.RESUMING], S.RUNNING, ev, envd_host="127.0.0.1", envd_port=40000, guest_host="",
                end_at=now + timezone.timedelta(hours=1), pause_image_at=None,
                envd_unresponsive_at_pause=False) is not None
            Sandbox.objects.filter(pk=resumed.pk).update(state=S.PAUSED)
        both = timed(resume_pair, runs)
        out["resume's two transitions"] = {k: both[k] - base[k] for k in ("cpu_us", "wall_us")}
    if want("insert"):
        def insert():
            now = timezone.now()
            transitions.insert_creating(core.event("", "create", outcome="started", details={"template": "base"}),
                                        team=team, template=template, alias="base", cpu_count=1, memory_mb=256,
                                        disk_size_mb=2048, created_at=now, started_at=now,
                                        end_at=now + timezone.timedelta(hours=1))
        out["create's insert (insert_creating)"] = timed(insert, runs)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=300)
    p.add_argument("--pieces", default="", help="comma-separated: resolve,place,visible,transition,insert")
    p.add_argument("--pg", default="", help="a PostgreSQL server URL: a fresh database there instead of SQLite")
    args = p.parse_args()
    with fresh_database(args.pg or None):
        from django.db import connection  # noqa: PLC0415

        results = pieces(args.runs, {s for s in args.pieces.split(",") if s})
        print(f"{connection.vendor}, {args.runs} runs, 1-min load {os.getloadavg()[0]:.2f}; median µs per call")
        print("| piece | CPU µs | wall µs |")
        print("|---|---:|---:|")
        for name, r in results.items():
            print(f"| {name} | {r['cpu_us']} | {r['wall_us']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
