"""Benchmark (issue 26): the Celery round trip of one node call alone, in-process. A stack of its
own (no API: migrations, signing keys, the node row) with bench/control_plane_node.py's node
worker (in-memory driver), and this process calling ``nodes.client.kill_sandbox`` on a sandbox
the node does not have (a task that does nothing) one after another on one event loop: the
round trip's wall time per call, the node process's CPU per call (/proc, user + system) and
this process's (the caller's side: subscribe, publish on a sender thread, the result's wait),
then ``nodes.client._publish`` alone on this thread (as a sender thread runs it): its wall
time and CPU (``thread_time``). The host's load is recorded next to them; the CPU figures
move with it much less than the milliseconds do.

    .venv/bin/python bench/node_round_trip.py [--calls 600] [--label …]
Writes bench/results/node_round_trip-<stamp>[-label].json (and prints it).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.control_plane import cpu_ms, summary  # noqa: E402

QUEUE = "bench.node-round-trip"  # publishes alone go here, nobody consumes it; emptied at the end


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=600)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--label", default="")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args()
    from harness.stack import Stack  # noqa: PLC0415

    stack = Stack(home=ROOT / "var" / "bench-runs" / f"rt-{uuid.uuid4().hex[:8]}", with_node=False,
                  with_lifecycle=False, extra_env={"AENV_DRIVER": "fake", "AENV_NETWORK": "slirp"})
    stack.start()
    stack.with_node = True
    stack._spawn("node", [sys.executable, str(ROOT / "bench" / "control_plane_node.py")])
    stack._wait_node()
    try:
        os.environ.update(stack.env)
        import django  # noqa: PLC0415

        django.setup()
        import redis  # noqa: PLC0415

        from nodes import client  # noqa: PLC0415
        from nodes.celery_app import app  # noqa: PLC0415
        from nodes.models import Node  # noqa: PLC0415

        node = Node.objects.get(pk=stack.node_id)
        client._init_sender_thread()  # this thread publishes as a sender thread does

        async def calls(n: int) -> list[float]:
            out = []
            for _ in range(n):
                client.read_now(node)
                t0 = time.perf_counter()
                await client.kill_sandbox(node, sandbox_id="not-here")
                out.append((time.perf_counter() - t0) * 1000)
            return out

        loop = asyncio.new_event_loop()
        loop.run_until_complete(calls(args.warmup))
        load0 = os.getloadavg()[0]
        npid = stack.procs["node"].pid
        n0, c0 = cpu_ms(npid), time.process_time()
        walls = loop.run_until_complete(calls(args.calls))
        n1, c1 = cpu_ms(npid), time.process_time()
        pubs, t0 = [], time.thread_time()
        for _ in range(args.calls):
            s = time.perf_counter()
            client._publish("aenv.nothing", QUEUE, {"sandbox_id": "x"}, 5.0)
            pubs.append((time.perf_counter() - s) * 1000)
        t1 = time.thread_time()
        load1 = os.getloadavg()[0]
        redis.Redis.from_url(app.conf.broker_url).delete(QUEUE)
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
        result = {
            "bench": "node_round_trip", "commit": commit, "label": args.label, "calls": args.calls,
            "transport": str(app.conf.broker_transport or "(the URL's)"),
            "load_1min": {"start": round(load0, 2), "end": round(load1, 2)}, "cores": os.cpu_count(),
            "round_trip_ms": summary(walls),
            "node_cpu_ms_per_call": round((n1 - n0) / args.calls, 3),
            "caller_cpu_ms_per_call": round((c1 - c0) * 1000 / args.calls, 3),
            "publish_ms": summary(pubs),
            "publish_cpu_ms": round((t1 - t0) * 1000 / args.calls, 3),
        }
    finally:
        stack.stop()
        shutil.rmtree(stack.home, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = args.out / f"node_round_trip-{stamp}{'-' + args.label if args.label else ''}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
