"""Benchmark: network slots (vmm/net, the netns + TAP backend's ground): how long making,
destroying and handing out a slot takes on this node, and the node table's update per slot.
Needs root and nft. Prints a table; writes JSON to bench/results/net_slots-<UTC stamp>.json.
``measure`` is also bench/lifecycle.py's slot part.

The slots are a network instance of the benchmark's own (prefix ``aenvbm``, pool
10.16.0.0/20), removed at the end: a running node's slots, table and addresses are never
touched.

    .venv/bin/python bench/net_slots.py [--runs 50] [--warm 8]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.lifecycle_common import percentile  # noqa: E402
from vmm.net import host_table, slots  # noqa: E402
from vmm.net.slot_pool import SlotPool  # noqa: E402

PREFIX = "aenvbm"
POOL = "10.16.0.0/20"


def ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


def measure(runs: int, warm: int, prefix: str = PREFIX, pool: str = POOL) -> dict[str, list[float]]:
    """ms per slot_create / slot_destroy (vmm.net.slots), pool_acquire_warm / pool_release
    (a SlotPool kept at ``warm``) and pool_acquire_cold (an empty pool makes the slot);
    everything of ``prefix`` is removed at the end."""
    out: dict[str, list[float]] = {"slot_create": [], "slot_destroy": [], "pool_acquire_warm": [],
                                   "pool_acquire_cold": [], "pool_release": []}
    try:
        for i in range(runs):
            t0 = time.perf_counter()
            slot = slots.create(slots.Slot(prefix, i + 1, pool))
            out["slot_create"].append(ms(t0))
            t0 = time.perf_counter()
            slots.destroy(slot)
            out["slot_destroy"].append(ms(t0))
        warm_pool = SlotPool(prefix, pool, warm=warm)
        warm_pool.adopt(set())
        warm_pool.start()
        try:
            for _ in range(runs):
                deadline = time.monotonic() + 30
                while warm_pool.ready() < warm and time.monotonic() < deadline:
                    time.sleep(0.01)
                t0 = time.perf_counter()
                slot = warm_pool.acquire()
                out["pool_acquire_warm"].append(ms(t0))
                t0 = time.perf_counter()
                warm_pool.release(slot)
                out["pool_release"].append(ms(t0))
        finally:
            warm_pool.close()
        cold = SlotPool(prefix, pool, warm=0)
        cold.adopt(set())
        for _ in range(runs):
            t0 = time.perf_counter()
            slot = cold.acquire()
            out["pool_acquire_cold"].append(ms(t0))
            cold.release(slot)
    finally:
        for slot in slots.list_slots(prefix, pool):
            slots.destroy(slot)
        host_table.remove(prefix)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--warm", type=int, default=8)
    args = parser.parse_args()
    if not slots.netns_supported():
        print("needs root, nft and nsenter", file=sys.stderr)
        return 2
    samples = measure(args.runs, args.warm)
    summary = {name: {"median_ms": round(statistics.median(v), 2), "p90_ms": round(percentile(v, 90), 2),
                      "p95_ms": round(percentile(v, 95), 2), "n": len(v)} for name, v in samples.items()}
    print("| operation | median ms | p90 ms | p95 ms | n |\n|---|---:|---:|---:|---:|")
    for name, row in summary.items():
        print(f"| {name} | {row['median_ms']} | {row['p90_ms']} | {row['p95_ms']} | {row['n']} |")
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = ROOT / "bench" / "results" / f"net_slots-{stamp}.json"
    path.write_text(json.dumps({"host": platform.node(), "kernel": platform.release(), "runs": args.runs,
                                "warm": args.warm, "summary": summary, "samples": samples}, indent=2))
    print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
