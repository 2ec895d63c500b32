"""Benchmark: load with service levels (issue 27 item 3). Virtual clients of the official E2B
async SDK (``AsyncSandbox``, bench/load_client.py) each loop create → ``--commands`` commands →
pause → resume (connect) → check the guest kept its state → kill for ``--duration`` seconds,
against a one-machine cluster (``cluster/``: each node worker in a network namespace of its
own, PostgreSQL, Redis, real VMs of the default template) of each ``--nodes`` size, at each
``--clients`` level.

Reported per level: complete cycles per minute, calls per second, p50 / p95 / p99 of each
operation, unexpected errors (target 0) and admission refusals apart (a 503 with
``Retry-After``: no node had room; the client waits what it was told, then tries again),
the API's Server-Timing phases, the most sandboxes each node held, and the CPU each of the
cluster's processes took (the first bottleneck's evidence; ``--py-spy NAME`` also samples one
process: ``api``, ``dataplane``, ``sweeper``, ``node-1``…).

    .venv/bin/python bench/load.py [--clients 100[,12]] [--duration 600] [--nodes 1,3]
        [--commands 20] [--vcpu-overcommit N] [--py-spy api] [--label …]
    .venv/bin/python bench/load.py --external --clients 4 --duration 60   # E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY

JSON + Markdown to bench/results/load-<UTC stamp>[-label].{json,md}. Needs root and
PostgreSQL on 127.0.0.1:5432 (not with --external). The cluster is ``acl`` on 10.219/16 and
10.220/16, Redis databases 13-15; it is purged at the start and the end.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cluster_parts import started_cluster  # noqa: E402
from bench.lifecycle_common import MIB, LoadMonitor, finish_run  # noqa: E402
from bench.load_client import Settings, run_clients  # noqa: E402
from bench.load_report import summarize, write_results  # noqa: E402
from bench.templates import git_state  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def cluster_of(nodes: int, extra_env: dict):
    return started_cluster(nodes, keep_logs=f"load-logs-{nodes}n", name="acl", link_net="10.219.0.0/16",
                           pool_net="10.220.0.0/16", database="aenv_load_bench", redis_db=13, extra_env=extra_env)


# -- what the cluster's processes cost ---------------------------------------------------------


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
                ppid = int(stat[stat.rindex(")") + 2:].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    return kids


def _tree_cpu_s(pid: int, kids: dict[int, list[int]], skip_qemu: bool = True) -> float:
    """CPU seconds of a process and its descendants (QEMU left out: guests are not aenv's code)."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        if skip_qemu and "(qemu-system" in stat:
            continue
        f = stat[stat.rindex(")") + 2:].split()
        total += (int(f[11]) + int(f[12])) / TICKS
        todo += kids.get(p, [])
    return total


def _named_pids(cluster) -> dict[str, int]:
    """The cluster's own processes by name, plus PostgreSQL's and Redis's servers."""
    names = ["api", "dataplane", "sweeper"] + [f"node-{n.index}" for n in cluster.layout.all_nodes]
    out = {}
    for name in names:
        pid = cluster.procs.pid(name)  # the node workers' names: node-<index>
        if pid:
            out[name] = pid
    for name, pattern in (("postgres", "postgres"), ("redis", "redis-server")):
        found = subprocess.run(["pgrep", "-o", "-x", pattern], capture_output=True, text=True).stdout.split()
        if found:
            out[name] = int(found[0])
    return out


class CpuWindow:
    """Each named process tree's CPU over a window, as % of one core."""

    def __init__(self, pids: dict[str, int]):
        self.pids, kids = pids, _children()
        self.t0, self.start = time.monotonic(), {n: _tree_cpu_s(p, kids) for n, p in pids.items()}

    def stop(self) -> dict:
        kids, elapsed = _children(), time.monotonic() - self.t0
        return {n: round(100 * (_tree_cpu_s(p, kids) - self.start[n]) / elapsed, 1) for n, p in self.pids.items()}


class PgWaits:
    """What the database's sessions do during a level, sampled every ``every`` s from
    pg_stat_activity: how many run a query, how many wait for a lock, and on which query
    (placement serializes on the node rows: lock waits there are its queue)."""

    def __init__(self, database: str, every: float = 0.5):
        import threading  # noqa: PLC0415

        self.database, self.every, self.samples = database, every, []
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        import psycopg  # noqa: PLC0415

        try:
            conn = psycopg.connect("host=127.0.0.1 user=postgres dbname=postgres", autocommit=True)
        except psycopg.Error:
            return
        with conn:
            while not self.stop_event.wait(self.every):
                rows = conn.execute("SELECT state, wait_event_type, left(regexp_replace(query, '\\s+', ' ', 'g'), 90) "
                                    "FROM pg_stat_activity WHERE datname = %s", (self.database,)).fetchall()
                self.samples.append(rows)

    def stop(self) -> dict:
        self.stop_event.set()
        self.thread.join(timeout=5)
        n = max(1, len(self.samples))
        active = sum(1 for rows in self.samples for st, _, _ in rows if st == "active")
        waits = Counter(q for rows in self.samples for st, w, q in rows if st == "active" and w == "Lock")
        idle_tx = sum(1 for rows in self.samples for st, _, _ in rows if st and st.startswith("idle in transaction"))
        return {"samples": len(self.samples), "sessions_mean": round(sum(len(r) for r in self.samples) / n, 1),
                "active_mean": round(active / n, 2), "lock_waiting_mean": round(sum(waits.values()) / n, 2),
                "idle_in_transaction_mean": round(idle_tx / n, 2),
                "lock_waiting_queries": {q: round(c / n, 2) for q, c in waits.most_common(5)}}


def py_spy(pid: int, seconds: int, out: Path) -> subprocess.Popen:
    spy = str(Path(sys.executable).parent / "py-spy")
    return subprocess.Popen([spy, "record", "--pid", str(pid), "--duration", str(seconds), "--rate", "50",
                             "--subprocesses", "--nonblocking", "--format", "raw", "--output", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def folded_summary(path: Path, top: int = 15) -> dict:
    """A py-spy raw (folded) profile: the hottest leaf frames and the hottest frames of
    aenv's own code (the innermost frame under the checkout, outside its virtualenv)."""
    packages = tuple(f"{d.name}/" for d in ROOT.iterdir() if d.is_dir() and not d.name.startswith(".")
                     and (d / "__init__.py").exists())
    leaf, own, total = Counter(), Counter(), 0
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return {}
    for line in lines:
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        count, frames = int(n), stack.split(";")
        total += count
        leaf[frames[-1]] += count
        mine = [f for f in frames if f.rpartition(" (")[2].startswith(packages)]
        if mine:
            own[mine[-1]] += count
    share = (lambda c: {k: round(100 * v / total, 1) for k, v in c.most_common(top)}) if total else (lambda c: {})
    return {"samples": total, "leaf_pct": share(leaf), "own_code_pct": share(own)}


# -- one level ---------------------------------------------------------------------------------


async def _nodes_peak(api_url: str, headers: dict, stop: asyncio.Event, peak: dict) -> None:
    async with httpx.AsyncClient(trust_env=False, headers=headers, timeout=10) as http:
        while not stop.is_set():
            try:
                resp = await http.get(f"{api_url}/nodes")
                if resp.status_code == 200:
                    for n in resp.json():
                        peak[n["id"]] = max(peak.get(n["id"], 0), n.get("sandboxCount", 0))
            except (httpx.HTTPError, ValueError):
                pass
            try:
                await asyncio.wait_for(stop.wait(), 5)
            except asyncio.TimeoutError:
                pass


def kill_leftovers(api_url: str, key: str) -> int:
    """Every sandbox of the team still alive (running or paused) killed; how many there were."""
    n = 0
    with httpx.Client(trust_env=False, headers={"X-API-Key": key}, timeout=120) as http:
        for _ in range(50):  # pages of at most 100 (the API's limit), each killed before the next look
            resp = http.get(f"{api_url}/v2/sandboxes", params=[("state", "running"), ("state", "paused"),
                                                              ("limit", "100")])
            alive = resp.json() if resp.status_code == 200 else []
            if not alive:
                break
            for sb in alive:
                http.delete(f"{api_url}/sandboxes/{sb['sandboxID']}")
                n += 1
    return n


def run_level(args, conn: dict, admin: dict, clients: int, cluster=None, tag: str = "", pids=None,
              database: str = "") -> dict:
    cfg = Settings(commands=args.commands)
    pids = _named_pids(cluster) if cluster is not None else (pids or {})
    spy = None
    if args.py_spy and args.py_spy in pids:
        spy_out = ROOT / "var" / "bench-runs" / "load-profiles" / f"load-{args.stamp}-{tag}-pyspy-{args.py_spy}.txt"
        spy_out.parent.mkdir(parents=True, exist_ok=True)  # raw and large: kept out of bench/results
        spy = py_spy(pids[args.py_spy], int(min(args.duration, args.py_spy_seconds)), spy_out)

    async def go():
        stop, peak = asyncio.Event(), {}
        sampler = asyncio.create_task(_nodes_peak(conn["api_url"], admin, stop, peak)) if admin else None
        rec = await run_clients(clients, args.duration, cfg, conn, ramp_s=args.ramp)
        stop.set()
        if sampler:
            await sampler
        return rec, peak

    window, pg = CpuWindow(pids), PgWaits(database) if database else None
    self_cpu0 = time.process_time()
    rec, peak = asyncio.run(go())
    generator_pct = round(100 * (time.process_time() - self_cpu0) / rec.wall_s, 1)
    out = summarize(rec, args.duration)
    out.update(clients=clients, nodes_peak=peak, process_cpu_pct_of_core={**window.stop(), "load_generator": generator_pct})
    if pg is not None:
        out["postgres_sessions"] = pg.stop()
    if spy is not None:
        spy.wait(timeout=args.py_spy_seconds + 60)
        out["py_spy"] = {"process": args.py_spy, "raw": str(spy_out.relative_to(ROOT)), **folded_summary(spy_out)}
    out["left_alive_killed"] = kill_leftovers(conn["api_url"], conn["api_key"])
    return out


def run_fake(args, clients: list[int], extra_env: dict, result: dict, monitor) -> None:
    """Each level against a stack whose node is the in-memory driver (harness.fake_stack), its
    room set by ``--vcpu-overcommit``: what the control plane alone does under the load, and
    how it refuses what does not fit."""
    pg = f"aenv_load_{uuid.uuid4().hex[:8]}" if args.pg else ""
    if pg:  # a fresh database of the stack's own, in the machine's PostgreSQL (as a cluster runs)
        subprocess.run(["psql", "-h", "127.0.0.1", "-U", "postgres", "-c", f"CREATE DATABASE {pg}"], check=True,
                       capture_output=True)
        extra_env = {**extra_env, "DATABASE_URL": f"postgres://postgres@127.0.0.1:5432/{pg}"}
    try:
        _run_fake(args, clients, extra_env, result, monitor)
    finally:
        if pg:
            subprocess.run(["psql", "-h", "127.0.0.1", "-U", "postgres", "-c", f"DROP DATABASE {pg} WITH (FORCE)"],
                           capture_output=True)


def _run_fake(args, clients: list[int], extra_env: dict, result: dict, monitor) -> None:
    from harness.fake_stack import fake_stack  # noqa: PLC0415

    with fake_stack("load", **extra_env) as stack:
        conn = {"api_url": stack.api_url, "sandbox_url": stack.sandbox_url, "api_key": stack.api_key,
                "request_timeout": 600.0, "retries": 0}
        pids = {name: proc.pid for name, proc in stack.procs.items()}
        for c in clients:
            monitor.phase = key = f"{c}c-fake"
            result["levels"][key] = lv = run_level(args, conn, stack.admin_headers(), c, pids=pids, tag=key,
                                                   database=extra_env.get("DATABASE_URL", "").rpartition("/")[2])
            print(f"[load] {key}: {lv['cycles']} cycles, {lv['unexpected_errors']} unexpected errors, "
                  f"{lv['admission_refusals']} refusals", flush=True)
    result["notes"].append("--fake: the node runs the in-memory driver (no VM, guest calls answered at once), "
                           f"database {'PostgreSQL' if args.pg else 'SQLite'}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", default="100", help="virtual clients, comma separated levels (e.g. 12,100)")
    p.add_argument("--duration", type=float, default=600.0, help="seconds each level runs (a cycle under way ends)")
    p.add_argument("--nodes", default="1,3", help="cluster sizes, comma separated, each 1..3")
    p.add_argument("--commands", type=int, default=20, help="commands per cycle")
    p.add_argument("--ramp", type=float, default=10.0, help="seconds over which the clients start")
    p.add_argument("--vcpu-overcommit", type=float, help="the nodes' AENV_NODE_VCPU_OVERCOMMIT (default: aenv's)")
    p.add_argument("--env", action="append", default=[], help="more settings for every process, NAME=VALUE")
    p.add_argument("--py-spy", help="sample this process during each level: api, dataplane, sweeper, node-1, …")
    p.add_argument("--py-spy-seconds", type=float, default=120.0)
    p.add_argument("--fake", action="store_true", help="the control plane alone: one stack whose node runs the "
                   "in-memory driver (no VM, no root; its room: --vcpu-overcommit); use --commands 0")
    p.add_argument("--pg", action="store_true", help="with --fake: PostgreSQL (a fresh database), not SQLite")
    p.add_argument("--external", action="store_true", help="the aenv of E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY")
    p.add_argument("--label", default="")
    p.add_argument("--out", type=Path, help="where the JSON + Markdown go (default bench/results/)")
    args = p.parse_args()
    clients = [int(c) for c in args.clients.split(",") if c]
    nodes = [int(n) for n in args.nodes.split(",") if n]
    if any(not 1 <= n <= 3 for n in nodes) or any(c < 1 for c in clients):
        p.error("--nodes: each 1..3; --clients: each at least 1")
    args.stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    args.out_dir = args.out or ROOT / "bench" / "results"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    extra_env = dict(kv.split("=", 1) for kv in args.env)
    if args.vcpu_overcommit:
        extra_env["AENV_NODE_VCPU_OVERCOMMIT"] = str(args.vcpu_overcommit)

    t_start, load0 = time.monotonic(), os.getloadavg()
    result: dict = {"benchmark": "load", "when": args.stamp, "label": args.label, "git": git_state(),
                    "settings": {k: v for k, v in vars(args).items() if k not in ("out", "out_dir", "stamp")},
                    "notes": [], "levels": {}}
    monitor = LoadMonitor().start()
    try:
        if args.fake:
            run_fake(args, clients, extra_env, result, monitor)
        elif args.external:
            conn = {"api_url": os.environ["E2B_API_URL"], "sandbox_url": os.environ.get("E2B_SANDBOX_URL"),
                    "api_key": os.environ["E2B_API_KEY"]}
            conn = {**conn, "request_timeout": 600.0, "retries": 0}
            token = os.environ.get("AENV_ADMIN_TOKEN", "")
            admin = {"X-API-Key": conn["api_key"], "X-Admin-Token": token} if token else {}
            for c in clients:
                monitor.phase = key = f"{c}c-external"
                result["levels"][key] = run_level(args, conn, admin, c, tag=key)
        else:
            if os.geteuid() != 0:
                print("cannot run: needs root (network namespaces and slots)", file=sys.stderr)
                return 1
            for n in nodes:
                with cluster_of(n, extra_env) as cluster:
                    conn = {"api_url": cluster.layout.api_url, "sandbox_url": cluster.layout.sandbox_url,
                            "api_key": cluster.api_key, "request_timeout": 600.0, "retries": 0}
                    admin = {"X-API-Key": cluster.api_key, "X-Admin-Token": cluster.admin_token}
                    for c in clients:
                        monitor.phase = key = f"{c}c-{n}n"
                        print(f"[load] {key}: {c} clients for {args.duration:g} s on {n} node(s)", flush=True)
                        result["levels"][key] = lv = run_level(args, conn, admin, c, cluster, tag=key,
                                                               database=cluster.layout.database)
                        print(f"[load] {key}: {lv['cycles']} cycles, {lv['unexpected_errors']} unexpected errors, "
                              f"{lv['admission_refusals']} refusals", flush=True)
    finally:
        finish_run(result, monitor.stop(), t_start, load0,
                   memory_mib=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // MIB)
        if result["levels"]:
            out = write_results(result, args.stamp, args.out_dir)
            print(out.with_suffix(".md").read_text())
            print(f"wrote {out} (+ .md)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
