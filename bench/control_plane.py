"""Benchmark (issue 26, first row): the control plane's own cost per lifecycle call, with no
VM at all. A stack of its own (API under daphne, SQLite or DATABASE_URL's PostgreSQL, Redis
broker and result store, signed tasks) and a node worker on the in-memory driver
(bench/control_plane_node.py: AENV_DRIVER=fake, envd calls answered at once), so what a
request costs is HTTP, Django/DRF, auth, the DB transitions and events, Celery there and back
and the node task's bookkeeping, not emulation; the host's CPU noise (other VMs) still counts,
so the load is recorded next to the figures, and the CPU time the API and node
processes spent per call (/proc, user + system), which the host's load moves far less.

Per repetition, on one sandbox: create, pause (to disk), connect (resume: 201), connect on a
running sandbox (200), snapshot; the create's kill is timed too. Each call: client ms, and
from Server-Timing the node's part (its own timings) and ``dispatch`` (the Celery round trip
minus the node's timings). overhead = client − node, as bench/lifecycle.py reports it.

    .venv/bin/python bench/control_plane.py [--runs 200] [--warmup 20] [--pg]
        [--py-spy api|node] [--profile] [--label before]   (AENV_BENCH_PYSPY_GIL=1: py-spy --gil)
``--profile``: the API under cProfile on every thread (bench/control_plane_api.py; no py-spy
needed), its stats in ``control_plane-<stamp>-api.prof`` and the top of them in ``-api.txt``;
its own cost inflates the timings, so profile and measure in separate runs.
Writes bench/results/control_plane-<stamp>.json and .md (the table, also on stdout).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.create_kill import parse_server_timing  # noqa: E402

OPS = ("create", "pause", "resume", "connect", "snapshot", "kill")
PG_URL = "postgres://postgres@127.0.0.1:5432/aenv"


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def summary(values: list[float]) -> dict:
    return {"p50": round(statistics.median(values), 2), "p90": round(pct(values, 90), 2),
            "p99": round(pct(values, 99), 2), "min": round(min(values), 2), "n": len(values)}


class Bench:
    def __init__(self, api: str, key: str):
        import httpx  # noqa: PLC0415

        self.api, self.headers = api, {"X-API-Key": key}
        self.client = httpx.Client(timeout=60)
        self.samples: dict[str, dict[str, list[float]]] = {
            op: {"wall": [], "node": [], "dispatch": [], "api_cpu": [], "node_cpu": []} for op in OPS}
        self.pids: dict[str, int] = {}  # api / node: their CPU per call, read outside the timed window

    def call(self, op: str, method: str, path: str, expect: int, record: bool, node_of=None, **kw):
        cpu0 = {name: cpu_ms(pid) for name, pid in self.pids.items()} if record else {}
        t0 = time.perf_counter()
        resp = self.client.request(method, f"{self.api}{path}", headers=self.headers, **kw)
        wall = (time.perf_counter() - t0) * 1000
        cpu = {name: cpu_ms(pid) - cpu0[name] for name, pid in self.pids.items()} if record else {}
        if resp.status_code != expect:
            raise RuntimeError(f"{op}: {method} {path}: {resp.status_code} {resp.text[:400]}")
        if record:
            phases = parse_server_timing(resp.headers.get("server-timing", ""))
            node = node_of(phases) if node_of else phases.get("node", 0.0)
            s = self.samples[op]
            s["wall"].append(wall)
            s["node"].append(node or 0.0)
            s["dispatch"].append(phases.get("dispatch", 0.0))
            for name, used in cpu.items():
                s[f"{name}_cpu"].append(used)
        return resp

    @staticmethod
    def create_node(phases: dict) -> float:
        return phases.get("total", 0.0) - phases.get("schedule", 0.0) - phases.get("dispatch", 0.0)

    def one(self, template: str, record: bool) -> None:
        sbx = self.call("create", "POST", "/v2/sandboxes", 201, record, node_of=self.create_node,
                        json={"templateID": template, "timeout": 3600}).json()
        sid = sbx["sandboxID"]
        self.call("pause", "POST", f"/sandboxes/{sid}/pause", 204, record, json={})
        self.call("resume", "POST", f"/sandboxes/{sid}/connect", 201, record, json={"timeout": 3600})
        self.call("connect", "POST", f"/sandboxes/{sid}/connect", 200, record, node_of=lambda p: 0.0,
                  json={"timeout": 3600})
        snap = self.call("snapshot", "POST", f"/sandboxes/{sid}/snapshots", 201, record, json={}).json()
        self.call("kill", "DELETE", f"/sandboxes/{sid}", 204, record, node_of=lambda p: 0.0)
        self.client.delete(f"{self.api}/templates/{snap['snapshotID']}", headers=self.headers)

    def table(self) -> dict:
        out = {}
        for op, s in self.samples.items():
            if not s["wall"]:
                continue
            over = [w - n for w, n in zip(s["wall"], s["node"])]
            out[op] = {"wall": summary(s["wall"]), "node": summary(s["node"]), "overhead": summary(over),
                       "dispatch": summary(s["dispatch"])}
            if s["api_cpu"]:  # /proc's clock ticks (10 ms): the mean is the figure, not a percentile
                out[op]["cpu_ms_mean"] = {name: round(statistics.mean(s[f"{name}_cpu"]), 2)
                                          for name in ("api", "node") if s[f"{name}_cpu"]}
        return out


def start_stack(pg: bool):
    from harness.stack import Stack  # noqa: PLC0415

    env = {"AENV_DRIVER": "fake", "AENV_NETWORK": "slirp"}
    if pg:
        env["DATABASE_URL"] = PG_URL
    stack = Stack(home=ROOT / "var" / "bench-runs" / f"cp-{uuid.uuid4().hex[:8]}", with_node=False,
                  with_lifecycle=False, extra_env=env)
    if pg:  # a fresh database of the stack's own in the test server
        name = f"aenv_bench_{uuid.uuid4().hex[:8]}"
        subprocess.run(["psql", "-h", "127.0.0.1", "-U", "postgres", "-c", f"CREATE DATABASE {name}"], check=True,
                       capture_output=True)
        env["DATABASE_URL"] = f"postgres://postgres@127.0.0.1:5432/{name}"
        stack.pg_name = name
    stack.start()
    stack.with_node = True
    stack._spawn("node", [sys.executable, str(ROOT / "bench" / "control_plane_node.py")])
    stack._wait_node()
    return stack


def profile_api(stack, out: Path | None) -> None:
    """The stack's API restarted on its port by bench/control_plane_api.py: under cProfile when
    ``out`` is given; with AENV_BENCH_SWITCH_INTERVAL, that GIL switch interval."""
    port = stack.api_url.rsplit(":", 1)[1]
    stack.stop("api")
    if out is not None:
        stack.extra_env["AENV_BENCH_PROFILE_OUT"] = str(out)
    stack._spawn("api", [sys.executable, str(ROOT / "bench" / "control_plane_api.py"), "-b", "127.0.0.1", "-p", port,
                         "config.asgi:application"])
    stack._wait_http(f"{stack.api_url}/health", "api")


def dump_profile(stack, out: Path, wait: float = 300) -> None:
    """Asks the profiled API for its stats (SIGUSR2) and waits until they are written."""
    proc = stack.procs.get("api")
    if proc is None or proc.poll() is not None:
        return
    before = out.stat().st_mtime if out.exists() else None
    proc.send_signal(signal.SIGUSR2)
    end = time.monotonic() + wait
    while time.monotonic() < end:
        if out.exists() and out.stat().st_mtime != before:
            size = -1
            while size != out.stat().st_size:  # written whole
                size = out.stat().st_size
                time.sleep(0.5)
            return
        time.sleep(0.2)


def profile_report(out: Path, top: int = 60) -> str:
    """The profile's top functions by own and by cumulative time, also written next to it (.txt)."""
    import io  # noqa: PLC0415
    import pstats  # noqa: PLC0415

    if not out.exists():
        return f"no profile at {out} (the API did not exit cleanly)\n"
    buf = io.StringIO()
    stats = pstats.Stats(str(out), stream=buf)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    out.with_suffix(".txt").write_text(buf.getvalue())
    return f"profile: {out} (top in {out.with_suffix('.txt')})\n"


def cpu_ms(pid: int) -> float:
    """User + system CPU of a process so far (ms): what a call costs it, whatever the host's load."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000 / os.sysconf("SC_CLK_TCK")


def py_spy(pid: int, seconds: int, out: Path) -> subprocess.Popen:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    gil = ["--gil"] if os.environ.get("AENV_BENCH_PYSPY_GIL") else []  # only the GIL's holder: Python's own CPU
    return subprocess.Popen([spy, "record", "-p", str(pid), "-d", str(seconds), "-r", "250", "-f", "raw",
                             "-o", str(out), "--nonblocking", *gil], stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--pg", action="store_true", help="PostgreSQL (a fresh database) instead of SQLite")
    p.add_argument("--py-spy", choices=("api", "node"), help="sample that process during the run (raw folded)")
    p.add_argument("--profile", action="store_true", help="the API under cProfile (its stats next to the results)")
    p.add_argument("--label", default="")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    stack = start_stack(args.pg)
    spy = None
    profile_out = None
    if args.profile:
        profile_out = args.out / f"control_plane-{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}-api.prof"
        profile_api(stack, profile_out)
    elif os.environ.get("AENV_BENCH_SWITCH_INTERVAL"):
        profile_api(stack, None)
    try:
        bench = Bench(stack.api_url, stack.api_key)
        for _ in range(args.warmup):
            bench.one("base", record=False)
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        if args.py_spy:
            folded = args.out / f"control_plane-{stamp}-{args.py_spy}.folded"
            spy = py_spy(stack.procs[args.py_spy].pid, 3600, folded)
            time.sleep(1)
        load0 = os.getloadavg()
        pids = {name: stack.procs[name].pid for name in ("api", "node")}
        bench.pids = pids
        cpu0 = {name: cpu_ms(pid) for name, pid in pids.items()}
        t0 = time.monotonic()
        loads = []
        for i in range(args.runs):
            bench.one("base", record=True)
            if i % 10 == 0:
                loads.append(os.getloadavg()[0])
        took = time.monotonic() - t0
        cpu = {name: round((cpu_ms(pid) - cpu0[name]) / args.runs / len(OPS), 2) for name, pid in pids.items()}
    finally:
        if profile_out is not None:
            dump_profile(stack, profile_out)
        if spy is not None:
            spy.send_signal(2)
            spy.wait(30)
        stack.shutdown()
        if getattr(stack, "pg_name", None):
            subprocess.run(["psql", "-h", "127.0.0.1", "-U", "postgres", "-c", f"DROP DATABASE {stack.pg_name}"],
                           capture_output=True)
        shutil.rmtree(stack.home, ignore_errors=True)
    if profile_out is not None:
        print(profile_report(profile_out), end="")
    table = bench.table()
    result = {"benchmark": "control_plane", "label": args.label, "when": stamp,
              "db": "postgresql" if args.pg else "sqlite",
              "runs": args.runs, "warmup": args.warmup, "duration_s": round(took, 1),
              "cpu_ms_per_call": cpu,
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                       text=True).stdout.strip(),
              "host": {"cpus": os.cpu_count(), "load_at_start": [round(x, 2) for x in load0],
                       "load1_during_mean": round(statistics.mean(loads), 2), "load1_during_max": round(max(loads), 2),
                       "load_at_end": [round(x, 2) for x in os.getloadavg()]},
              "table": table, "samples": bench.samples}
    path = args.out / f"control_plane-{stamp}{'-' + args.label if args.label else ''}.json"
    path.write_text(json.dumps(result, indent=1))
    text = report(result)
    path.with_suffix(".md").write_text(text)
    print(text, end="")
    print(f"wrote {path} (+ .md)")
    return 0


TARGET = {"p50": 10.0, "p99": 25.0}  # issue 26: overhead per operation, quiet host


def report(result: dict) -> str:
    """The run as a markdown table: overhead (ms) against the target, with the host's load."""
    host = result["host"]
    lines = [f"control plane, {result['db']}, commit {result['commit']}, {result['runs']} runs "
             f"({result['label'] or 'no label'}); 1-min load during the run {host['load1_during_mean']} "
             f"(max {host['load1_during_max']}) on {host['cpus']} cores; CPU ms per call "
             f"(mean of the ops): {result['cpu_ms_per_call']}", "",
             "| op | client p50 | node p50 | overhead p50 / p90 / p99 | Celery round trip p50 / p99 | "
             f"API / node CPU per call (mean) | target (≤ {TARGET['p50']:g} / ≤ {TARGET['p99']:g}) |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for op, t in result["table"].items():
        o, d = t["overhead"], t["dispatch"]
        met = "yes" if o["p50"] <= TARGET["p50"] and o["p99"] <= TARGET["p99"] else "no"
        cpu = t.get("cpu_ms_mean") or {}
        lines.append(f"| {op} | {t['wall']['p50']} | {t['node']['p50']} | {o['p50']} / {o['p90']} / {o['p99']} | "
                     f"{d['p50']} / {d['p99']} | {cpu.get('api', '–')} / {cpu.get('node', '–')} | "
                     f"{met if op != 'kill' else '(not a target)'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
