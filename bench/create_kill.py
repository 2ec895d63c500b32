"""Benchmark: sandbox create (API call → envd answering through the data plane) and
kill, with the time of each phase as reported by the API's Server-Timing header
(schedule, dispatch, boot, envd ready). Prints a table, writes JSON to bench/results/.

    .venv/bin/python bench/create_kill.py [--runs 5]          # starts its own stack
    E2B_API_URL=… E2B_SANDBOX_URL=… E2B_API_KEY=… .venv/bin/python bench/create_kill.py --external
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from envd import ENVD_PORT  # noqa: E402


def parse_server_timing(value: str) -> dict[str, float]:
    phases = {}
    for item in filter(None, (p.strip() for p in value.split(","))):
        name, *params = [x.strip() for x in item.split(";")]
        for param in params:
            if param.startswith("dur="):
                phases[name] = float(param[4:])
    return phases


def one_run(client: httpx.Client, api: str, sandbox_url: str, key: str) -> dict:
    h = {"X-API-Key": key}
    t0 = time.perf_counter()
    resp = client.post(f"{api}/v2/sandboxes", json={"templateID": "base", "metadata": {"bench": "create_kill"}},
                       headers=h, timeout=300)
    t_api = time.perf_counter()
    resp.raise_for_status()
    sid = resp.json()["sandboxID"]
    route = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(ENVD_PORT)}
    while client.get(f"{sandbox_url}/health", headers=route, timeout=30).status_code != 204:
        time.sleep(0.005)
    t_ready = time.perf_counter()
    t1 = time.perf_counter()
    kill = client.delete(f"{api}/sandboxes/{sid}", headers=h, timeout=120)
    t_kill = time.perf_counter() - t1
    kill.raise_for_status()
    row = {
        "create_api_ms": (t_api - t0) * 1000,
        "create_to_envd_ms": (t_ready - t0) * 1000,
        "kill_ms": t_kill * 1000,
    }
    row.update({f"phase_{k}_ms": v for k, v in parse_server_timing(resp.headers.get("server-timing", "")).items()})
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--external", action="store_true", help="use E2B_API_URL/E2B_SANDBOX_URL/E2B_API_KEY")
    args = parser.parse_args()

    stack = None
    if args.external:
        api, sandbox_url, key = os.environ["E2B_API_URL"], os.environ["E2B_SANDBOX_URL"], os.environ["E2B_API_KEY"]
    else:
        from harness.stack import Stack  # noqa: PLC0415

        stack = Stack(home=ROOT / "var" / "bench-runs" / uuid.uuid4().hex[:8]).start()
        api, sandbox_url, key = stack.api_url, stack.sandbox_url, stack.api_key
    try:
        with httpx.Client() as client:
            one_run(client, api, sandbox_url, key)  # warm-up: page cache, TCG, connections
            rows = [one_run(client, api, sandbox_url, key) for _ in range(args.runs)]
    finally:
        if stack:
            stack.shutdown()
            shutil.rmtree(stack.home, ignore_errors=True)

    metrics = sorted({k for r in rows for k in r})
    summary = {m: {"median": statistics.median(r[m] for r in rows if m in r),
                   "min": min(r[m] for r in rows if m in r),
                   "max": max(r[m] for r in rows if m in r)} for m in metrics}
    print(f"{'metric':28} {'median ms':>10} {'min':>10} {'max':>10}   (n={len(rows)})")
    for m in metrics:
        s = summary[m]
        print(f"{m:28} {s['median']:10.1f} {s['min']:10.1f} {s['max']:10.1f}")
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = out_dir / f"create_kill-{stamp}.json"
    out.write_text(json.dumps({
        "benchmark": "create_kill", "when": stamp, "runs": rows, "summary": summary,
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "kernel": platform.release()},
    }, indent=2))
    print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
