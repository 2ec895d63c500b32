"""Benchmark: aenv on one node and on many (issue 12), with real VMs of the default template
(``base``, 2 vCPU / 512 MiB), in one run:

1. capacity (``--parts capacity``): on a single-node stack with the default settings,
   ``base`` sandboxes are created (a few at a time, then one at a time) until the API
   refuses one (503: admission); all of them idle for ``--idle-seconds``: the host's CPU
   (/proc/stat, against a baseline taken before), each QEMU's CPU, MemAvailable drop, QEMU
   RSS / PSS (smaps_rollup) and the guest RAM in /dev/shm, per sandbox; the issue's target:
   at least 60. Then all killed.
2. memory (``memory``), on the same stack: pause → connect at once (the RAM has not left
   tmpfs yet, or is leaving it) vs pause → wait until the RAM is on the node's disk
   (``<state dir>/memory.ram``) → connect; pause and resume times through the API, and
   where each resume found the RAM (the node's resume timings).
3. creates (``creates``): ``--creates`` creates from ``--clients`` concurrent httpx clients
   against a one-node and then a three-node cluster (``cluster``, what
   ``scripts/cluster.sh`` runs: each node in a network namespace of its own, PostgreSQL,
   Redis): statuses, created/s, latency p50 / p99, placement per node; all killed between.
   Every node of a one-machine cluster believes it has the whole machine, so 3 nodes admit
   3× what the machine holds: the count is capped by MemAvailable (``--mem-reserve-mib``
   kept free, per-sandbox memory from part 1), and the cap is reported.
4. moves (``moves``): a stack with the S3 store (a moto server) and a second node worker;
   two sandboxes paused on node A and exported to the store; one connects at home, the
   other with A drained, restored on node B: connect times, p50 over ``--move-runs``.

Everything made is removed at the end: sandboxes, stacks, the clusters (``down(purge)``),
the moto server, the second node, the network instances (prefix ``--net-prefix``, pool
``--net-pool``; the clusters ``acb*`` on 10.216/16 and 10.217/16).

    sudo .venv/bin/python bench/cluster.py [--parts capacity,memory,creates,moves] [--quick]
JSON + Markdown to bench/results/cluster-<UTC stamp>.{json,md} (--quick: small counts, to
var/bench-quick/). Needs root (namespaces, slots) and PostgreSQL on 127.0.0.1:5432 (creates).
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import cluster_parts as parts  # noqa: E402
from bench.cluster_api import Api  # noqa: E402
from bench.cluster_report import write_results  # noqa: E402
from bench.lifecycle_common import MIB, LoadMonitor, finish_run, mem_available  # noqa: E402
from bench.templates import git_state  # noqa: E402

PARTS = ("capacity", "memory", "creates", "moves")
BUCKET = "aenv-bench-cluster"
DEFAULT_SANDBOX_MIB = 300  # host memory per idle base sandbox when part 1 did not measure it


def _home(tag: str) -> Path:
    # short: a VM's QMP socket is <home>/sandboxes/<id>/qmp.sock, at most 107 bytes
    return ROOT / "var" / "bench-runs" / f"{tag}-{uuid.uuid4().hex[:6]}"


def _shm_leftovers(ids) -> int:
    """RAM files in /dev/shm of sandboxes this run made (none after a clean run)."""
    n = 0
    for sid in ids:
        for f in Path("/dev/shm").glob(f"aenv-{sid}.ram"):
            f.unlink(missing_ok=True)
            n += 1
    return n


@contextmanager
def stack_of(tag: str, extra_env: dict | None = None):
    from harness.stack import Stack  # noqa: PLC0415

    stack = Stack(home=_home(tag), extra_env=extra_env or {})
    try:
        stack.start()
        yield stack
    finally:
        stack.shutdown()  # processes, VMs left, its slots, nftables table and resolver
        shutil.rmtree(stack.home, ignore_errors=True)


@contextmanager
def api_of(url: str, key: str, made: set, admin_token: str = ""):
    api = Api(url, key, admin_token)
    try:
        yield api
    finally:
        made.update(api.live)
        failures = api.kill_all()
        if failures:
            print(f"cleanup: {failures}", file=sys.stderr)
        api.close()


class ClusterDb:
    """``db(code)``: ORM code in a cluster's database, like Stack.db."""

    def __init__(self, cluster):
        self.cluster = cluster

    def db(self, code: str) -> str:
        return self.cluster.manage("shell", "-v", "0", "-c", code)


def cluster_of(nodes: int):
    return parts.started_cluster(nodes, name="acb", link_net="10.216.0.0/16", pool_net="10.217.0.0/16",
                                 database="aenv_cluster_bench", redis_db=7)


def stop_second_node(node) -> None:
    """The second node worker (its process group, which this run started), its VMs (by pid)
    and its network instance."""
    from cluster.cluster import kill_vms  # noqa: PLC0415
    from vmm.net import slots  # noqa: PLC0415

    if node.proc.poll() is None:
        os.killpg(node.proc.pid, signal.SIGTERM)
        try:
            node.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(node.proc.pid, signal.SIGKILL)
            node.proc.wait(timeout=10)
    kill_vms(node.home)
    if slots.netns_supported():
        from vmm.net.netns import remove_instance  # noqa: PLC0415

        remove_instance(node.env["AENV_NET_PREFIX"], node.env["AENV_NET_POOL"], node.home)
    node.log.close()


def run_single_node(args, result: dict, made: set, monitor: LoadMonitor) -> None:
    with stack_of("cs") as stack, api_of(stack.api_url, stack.api_key, made, stack.admin_token) as api:
        if "capacity" in args.parts:
            monitor.phase = "capacity"
            cap = parts.Capacity(api, stack.home, parallel=args.capacity_parallel, limit=args.capacity_max,
                                 idle_s=args.idle_seconds, floor_mib=args.mem_floor_mib)
            try:
                result["capacity"] = cap.run()
            finally:
                made.update(c["sandbox_id"] for c in cap.created)
                t0 = time.monotonic()
                failures = api.kill_all()
                if "capacity" in result:
                    result["capacity"].update(kill_all_s=round(time.monotonic() - t0, 1), kill_failures=failures)
            print(f"capacity: {result['capacity']['created']} sandboxes ({result['capacity']['stopped_by']})",
                  flush=True)
        if "memory" in args.parts:
            monitor.phase = "memory"
            result["memory"] = parts.memory_tmpfs_vs_disk(api, stack, runs=args.memory_runs)
            print(f"memory: resume p50 tmpfs {result['memory']['tmpfs']['resume_ms'].get('p50')} ms, "
                  f"disk {result['memory']['disk']['resume_ms'].get('p50')} ms", flush=True)


def burst_size(args, result: dict) -> int:
    """``--creates``, or fewer if that many sandboxes alive at once would leave less than
    ``--mem-reserve-mib`` of MemAvailable (all nodes of a one-machine cluster share it)."""
    per = (result.get("capacity") or {}).get("mem_available_drop_per_sandbox_mib") or DEFAULT_SANDBOX_MIB
    per = max(per, 100)
    fits = int((mem_available() / MIB - args.mem_reserve_mib) // per)
    n = max(1, min(args.creates, fits))
    if n < args.creates:
        result["notes"].append(f"creates: {n} per run instead of {args.creates}: at {per:.0f} MiB per sandbox "
                               f"(part 1's MemAvailable drop) more would leave under {args.mem_reserve_mib} MiB of "
                               f"the machine's MemAvailable ({mem_available() // MIB} MiB before the run), and the "
                               "three nodes of a one-machine cluster each admit as if they had the whole machine")
    return n


def run_creates(args, result: dict, made: set, monitor: LoadMonitor) -> None:
    n = burst_size(args, result)
    for nodes in (1, 3):
        monitor.phase = f"creates_{nodes}"
        with cluster_of(nodes) as cluster, api_of(cluster.layout.api_url, cluster.api_key, made, cluster.admin_token) as api:
            result[f"creates_{nodes}"] = c = parts.creates(api, ClusterDb(cluster), creates=n, clients=args.clients)
        print(f"creates, {nodes} node(s): {c['statuses']}, {c['creates_per_s']}/s, p50 "
              f"{c['latency_ms_created'].get('p50')} ms, p99 {c['latency_ms_created'].get('p99')} ms", flush=True)


def stored_bytes(url: str, sandbox_id: str) -> dict[str, int]:
    """Bytes of a sandbox's pause image in the S3 store, per file (the non-zero chunks of
    each, from its manifest)."""
    import json  # noqa: PLC0415

    from nodes.protocol import pause_image_of  # noqa: PLC0415
    from harness.moto_s3 import client  # noqa: PLC0415

    s3 = client(url)
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
        for o in page.get("Contents", []):
            if o["Key"].endswith(f"snapshots/{pause_image_of(sandbox_id)}/manifest.json"):
                doc = json.loads(s3.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read())
                return {name: sum(c[1] for c in f["chunks"]) for name, f in doc["files"].items()}
    return {}


def run_moves(args, result: dict, made: set, monitor: LoadMonitor) -> None:
    from harness.second_node import SecondNode  # noqa: PLC0415
    from harness.moto_s3 import CREDENTIALS, moto_server  # noqa: PLC0415

    monitor.phase = "moves"
    with moto_server(BUCKET) as url:
        env = {"AENV_SNAPSHOT_BACKEND": "s3", "AENV_S3_ENDPOINT": url, "AENV_S3_BUCKET": BUCKET,
               "AENV_S3_REGION": "us-east-1", "AENV_S3_PREFIX": f"b-{uuid.uuid4().hex[:6]}", **CREDENTIALS,
               "AENV_PAUSE_EXPORT_DELAY": str(args.export_delay)}
        with stack_of("cm", env) as stack:
            root = _home("cn")
            root.mkdir(parents=True)
            node_b = None
            try:
                node_b = SecondNode(stack, root)
                with api_of(stack.api_url, stack.api_key, made, stack.admin_token) as api:
                    result["moves"] = mv = parts.resume_same_vs_other_node(
                        api, stack, node_b.id, runs=args.move_runs, image_bytes=lambda sid: stored_bytes(url, sid))
            finally:
                if node_b is not None:
                    stop_second_node(node_b)
                shutil.rmtree(root, ignore_errors=True)
    print(f"moves: same node p50 {mv['same_node_ms'].get('p50')} ms, other node {mv['other_node_ms'].get('p50')} ms",
          flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma separated, of {', '.join(PARTS)}")
    parser.add_argument("--quick", action="store_true", help="small counts, results to var/bench-quick/")
    parser.add_argument("--out", type=Path, help="where the JSON + Markdown go (default bench/results/)")
    parser.add_argument("--capacity-parallel", type=int, default=4, help="creates at a time while filling the node")
    parser.add_argument("--capacity-max", type=int, default=0, help="stop filling at this many (0: until refused)")
    parser.add_argument("--idle-seconds", type=float, default=30.0)
    parser.add_argument("--mem-floor-mib", type=int, default=3072, help="stop filling below this MemAvailable")
    parser.add_argument("--creates", type=int, default=100, help="creates per burst (capped by memory, see above)")
    parser.add_argument("--clients", type=int, default=100, help="concurrent clients of a burst")
    parser.add_argument("--mem-reserve-mib", type=int, default=4096, help="MemAvailable a burst must leave")
    parser.add_argument("--memory-runs", type=int, default=10, help="pause/resume pairs of each kind")
    parser.add_argument("--move-runs", type=int, default=5, help="same-node / other-node resume pairs")
    parser.add_argument("--export-delay", type=float, default=0.5, help="AENV_PAUSE_EXPORT_DELAY of the moves stack")
    parser.add_argument("--net-prefix", default="aenvc", help="network instance prefix (stacks: <prefix>s<N>)")
    parser.add_argument("--net-pool", default="10.19.0.0/20", help="the stacks take later /20s of its /16")
    args = parser.parse_args()
    args.parts = [p for p in args.parts.split(",") if p]
    unknown = set(args.parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    if os.geteuid() != 0:
        print("cannot run: needs root (network namespaces and slots)", file=sys.stderr)
        return 1
    if args.quick:
        args.capacity_max = args.capacity_max or 6
        args.idle_seconds, args.creates, args.clients = 10.0, min(args.creates, 10), min(args.clients, 10)
        args.memory_runs, args.move_runs = 2, 1
    out_dir = args.out or (ROOT / "var" / "bench-quick" if args.quick else ROOT / "bench" / "results")
    os.environ["AENV_NET_PREFIX"], os.environ["AENV_NET_POOL"] = args.net_prefix, args.net_pool

    t_start, load0 = time.monotonic(), os.getloadavg()
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    result: dict = {"benchmark": "cluster", "when": stamp, "quick": args.quick, "parts": args.parts,
                    "git": git_state(), "settings": {k: v for k, v in vars(args).items() if k != "out"},
                    "notes": []}
    made: set[str] = set()
    monitor = LoadMonitor().start()
    try:
        if {"capacity", "memory"} & set(args.parts):
            run_single_node(args, result, made, monitor)
        if "creates" in args.parts:
            run_creates(args, result, made, monitor)
        if "moves" in args.parts:
            run_moves(args, result, made, monitor)
    finally:
        left = _shm_leftovers(made)
        if left:
            result["notes"].append(f"cleanup: removed {left} RAM file(s) left in /dev/shm")
        finish_run(result, monitor.stop(), t_start, load0,
                   memory_mib=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // MIB)
        out = write_results(result, stamp, out_dir)
        print(out.with_suffix(".md").read_text())
        print(f"wrote {out} (+ .md)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
