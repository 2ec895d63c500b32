"""Benchmark: the workflow aenv exists for (issue 13), one run, two ways on the same node, with
real VMs of the default template and the official E2B SDK, against a stack of its own
(harness/stack.py):

(a) fork: one sandbox is set up once — a wheelhouse (``pip download`` of --packages on the
    host, from the host's PyPI mirror) and a git bundle of a tiny RL environment are uploaded
    with ``files.write_files``, installed offline (``pip install --no-index --find-links``) and
    cloned, and a warm Python worker (bench/rl_guest.py) is started that has imported the
    package and the repo — then forked into N children (batches of ≤ 20, the SDK's limit);
    each child gets a short task (a seeded rollout of the environment) through the inherited
    warm worker, its answer is read back and checked, and all are killed.
(b) fresh: the same N rollouts, each a fresh sandbox of the template that repeats the whole
    setup, then runs the task and is killed (--fresh-concurrency at a time).

Per way and N (--ns, default 4,16,32): rollouts/hour/node, time to first result, p50 / p99
rollout latency, host memory per live rollout (PSS of the rollout's QEMU; MemAvailable drop)
and the throughput ratio (a)/(b) against the issue's ≥ 2× target.

Everything made is removed at the end (and on Ctrl-C / SIGTERM): sandboxes, the stack
(processes, VMs, its network instance ``<--net-prefix>s1`` on a /20 of --net-pool), the
host-side wheelhouse and bundle. Run VM benchmarks under the host's VM lock:

    flock /tmp/aenv-vm.lock .venv/bin/python bench/rl.py [--ns 4,16,32] [--quick] [--out DIR]
JSON + Markdown to bench/results/rl-<UTC stamp>.{json,md} (--quick: N=2, to var/bench-quick/).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import rl_prep as prep  # noqa: E402
from bench.lifecycle_common import LoadMonitor, finish_run, mem_available, smaps_rollup  # noqa: E402
from bench.rl_guest import client_command  # noqa: E402
from bench.rl_report import TARGET_RATIO, memory_summary, ratio, run_summary, table, write_results  # noqa: E402

SDK_FORK_MAX = 20  # the SDK refuses a larger count
TTL_S = 3600
REQUEST_TIMEOUT_S = 1800  # client side: 32 guests on 2 emulated cores are slow, not lost


def batches(n: int, size: int = SDK_FORK_MAX) -> list[int]:
    """N children as fork calls of at most ``size`` each: 32 → [20, 12]."""
    if n < 1 or size < 1:
        raise ValueError("n and size must be positive")
    return [min(size, n - i) for i in range(0, n, size)]


@lru_cache(maxsize=None)
def expected(seed: int, steps: int) -> tuple:
    return tuple(sorted(prep.expected_result(seed, steps).items()))


def check_answer(answer: dict, seed: int, steps: int) -> str:
    """'' if the guest's answer is the host's, else what is wrong."""
    if answer.get("error"):
        return str(answer["error"])
    want = dict(expected(seed, steps))
    bad = {k: (answer.get(k), v) for k, v in want.items() if answer.get(k) != v}
    return f"wrong answer {bad}" if bad else ""


class MemWatch:
    """MemAvailable sampled every 0.5 s with the number of live rollouts: the drop from
    ``avail0`` at the sample with the most live rollouts (the lowest MemAvailable among those)."""

    def __init__(self):
        self.live, self.lock = 0, threading.Lock()
        self.avail0 = mem_available()
        self.best: tuple[int, int] = (0, self.avail0)  # (live, avail)
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def add(self, k: int) -> None:
        with self.lock:
            self.live += k
        if k > 0:
            self.sample()

    def sample(self) -> None:
        avail = mem_available()
        with self.lock:
            live = self.live
            if live > self.best[0] or (live == self.best[0] and avail < self.best[1]):
                self.best = (live, avail)

    def _loop(self) -> None:
        while not self.stop_event.wait(0.5):
            self.sample()

    def stop(self) -> tuple[int | None, int]:
        self.stop_event.set()
        self.thread.join(timeout=2)
        live, avail = self.best
        return (self.avail0 - avail if live else None), live


class Bench:
    def __init__(self, stack, art: prep.Artifacts, steps: int, retries: int = 0):
        self.stack, self.art, self.steps, self.retries = stack, art, steps, retries
        self.made: set[str] = set()
        self.lock = threading.Lock()

    # --- sandboxes --------------------------------------------------------------------------------

    def create(self):
        from e2b import Sandbox  # noqa: PLC0415

        sbx = Sandbox.create(timeout=TTL_S, metadata={"bench": "rl"}, request_timeout=REQUEST_TIMEOUT_S)
        with self.lock:
            self.made.add(sbx.sandbox_id)
        return sbx

    def kill(self, sbx) -> None:
        try:
            sbx.kill(request_timeout=300)
        finally:
            with self.lock:
                self.made.discard(sbx.sandbox_id)

    def kill_all_made(self) -> list[str]:
        from e2b import Sandbox  # noqa: PLC0415

        failed = []
        for sid in sorted(self.made):
            try:
                Sandbox.kill(sid, request_timeout=120)
            except Exception as exc:  # noqa: BLE001 - the stack's shutdown kills the VM anyway
                failed.append(f"{sid}: {exc}")
        self.made.clear()
        return failed

    def pss_kib(self, sandbox_id: str) -> int | None:
        pids = self.stack.qemu_pids(sandbox_id)
        try:
            return sum(smaps_rollup(pid).get("Pss", 0) for pid in pids) if pids else None
        except OSError:
            return None

    # --- the setup and the task ----------------------------------------------------------------------

    def setup(self, sbx) -> dict:
        """Upload, offline install + clone, warm worker started and ready: seconds per phase."""
        t0 = time.monotonic()
        sbx.files.write_files([{"path": p, "data": d} for p, d in self.art.files], request_timeout=600)
        t1 = time.monotonic()
        sbx.commands.run(prep.install_command(self.art), timeout=900, request_timeout=900)
        t2 = time.monotonic()
        sbx.commands.run(prep.worker_start_command(self.art), timeout=120, request_timeout=300)
        ready = json.loads(sbx.commands.run(prep.ready_wait_command(seconds=600), timeout=900,
                                            request_timeout=900).stdout)
        t3 = time.monotonic()
        return {"upload_s": round(t1 - t0, 2), "install_s": round(t2 - t1, 2), "warm_s": round(t3 - t2, 2),
                "total_s": round(t3 - t0, 2), "worker": ready}

    def run_retrying(self, sbx, cmd: str, row: dict):
        """commands.run, again (after 1, 2, ... s) while the data plane could not reach envd at
        all (its 3 s connect timeout, with dozens of emulated guests on 2 cores): the command did
        not start, so a retry is safe. ``row["retries"]`` counts them."""
        from e2b.exceptions import SandboxUnreachableException  # noqa: PLC0415

        row["retries"] = 0
        while True:
            try:
                return sbx.commands.run(cmd, timeout=600, request_timeout=600)
            except SandboxUnreachableException:
                if row["retries"] >= self.retries:
                    raise
                row["retries"] += 1
                time.sleep(row["retries"])

    def task(self, sbx, i: int, t_req: float, t_run: float) -> dict:
        row = {"i": i, "sandbox_id": sbx.sandbox_id, "ok": False}
        task = {"id": f"r{i}", "seed": i, "steps": self.steps}
        try:
            out = self.run_retrying(sbx, client_command(prep.GUEST_ROOT, task), row)
            t = time.monotonic()
            answer = json.loads(out.stdout.strip().splitlines()[-1])
            row["error"] = check_answer(answer, i, self.steps)
            row.update(ok=not row["error"], worker_pid=answer.get("worker_pid"), task_ms=answer.get("task_ms"))
        except Exception as exc:  # noqa: BLE001 - a failed rollout is a result
            t = time.monotonic()
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        row.update(latency_s=round(t - t_req, 3), result_at_s=round(t - t_run, 3))
        return row

    # --- (a) and (b) ---------------------------------------------------------------------------------

    def run_fork(self, n: int) -> dict:
        t_run = time.monotonic()
        parent = self.create()
        rows, children, errors, calls = [], [], [], []
        try:
            setup = self.setup(parent)
            parent_pid = setup["worker"]["pid"]
            mem = MemWatch()  # the parent is set up: the drop is the children's
            with ThreadPoolExecutor(max_workers=n) as pool:
                futures = []
                for b in batches(n):
                    t_req = time.monotonic()
                    got = parent.fork(count=b, timeout=TTL_S, request_timeout=REQUEST_TIMEOUT_S)
                    calls.append({"count": b, "s": round(time.monotonic() - t_req, 2)})
                    kids = [c for c in got if not isinstance(c, Exception)]
                    errors += [str(c)[:300] for c in got if isinstance(c, Exception)]
                    with self.lock:
                        self.made.update(c.sandbox_id for c in kids)
                    mem.add(len(kids))
                    for c in kids:
                        futures.append(pool.submit(self.task, c, len(children), t_req, t_run))
                        children.append(c)
                rows = [f.result() for f in futures]
            pss = [p for p in (self.pss_kib(c.sandbox_id) for c in children) if p]  # all alive, all answered
            mem.sample()
            drop, live = mem.stop()
            t_k = time.monotonic()
            with ThreadPoolExecutor(max_workers=8) as pool:
                list(pool.map(self.kill, children))
            children = []
            self.kill(parent)
            kill_s = time.monotonic() - t_k
        finally:
            for c in children:
                self.kill(c)
            if parent.sandbox_id in self.made:
                self.kill(parent)
        wall = time.monotonic() - t_run
        rows += [{"i": -1, "ok": False, "error": e, "latency_s": 0, "result_at_s": 0} for e in errors]
        s = run_summary(rows, wall)
        inherited = sum(1 for r in rows if r.get("ok") and r.get("worker_pid") == parent_pid)
        s.update(setup_s=setup["total_s"], setup=setup, fork_calls=calls, kill_s=round(kill_s, 2),
                 memory=memory_summary(pss, drop, live), answered_by_parents_worker=inherited, rollouts=rows)
        return s

    def run_fresh(self, n: int, concurrency: int) -> dict:
        t_run = time.monotonic()
        mem = MemWatch()
        pss: list[int] = []
        setups: list[float] = []

        def one(i: int) -> dict:
            t_req = time.monotonic()
            try:
                sbx = self.create()
            except Exception as exc:  # noqa: BLE001 - a failed rollout is a result
                return {"i": i, "ok": False, "error": f"create: {exc}"[:300], "latency_s": 0, "result_at_s": 0}
            mem.add(1)
            try:
                setup = self.setup(sbx)
                setups.append(setup["total_s"])
                row = self.task(sbx, i, t_req, t_run)
                p = self.pss_kib(sbx.sandbox_id)
                if p:
                    pss.append(p)
                row["setup"] = {k: v for k, v in setup.items() if k != "worker"}
                return row
            except Exception as exc:  # noqa: BLE001
                t = time.monotonic()
                return {"i": i, "ok": False, "error": f"setup: {type(exc).__name__}: {exc}"[:300],
                        "latency_s": round(t - t_req, 3), "result_at_s": round(t - t_run, 3)}
            finally:
                try:
                    self.kill(sbx)
                finally:
                    mem.add(-1)

        with ThreadPoolExecutor(max_workers=min(n, concurrency)) as pool:
            rows = list(pool.map(one, range(n)))
        wall = time.monotonic() - t_run
        drop, live = mem.stop()
        s = run_summary(rows, wall)
        s.update(setup_s=round(sorted(setups)[len(setups) // 2], 2) if setups else None, concurrency=min(n, concurrency),
                 memory=memory_summary(pss, drop, live), rollouts=rows)
        return s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ns", default="4,16,32", help="rollout counts")
    parser.add_argument("--ways", default="fork,fresh")
    parser.add_argument("--packages", default="pytest", help="what the setup installs from the wheelhouse")
    parser.add_argument("--steps", type=int, default=20000, help="environment steps per rollout (the task)")
    parser.add_argument("--fresh-concurrency", type=int, default=8,
                        help="(b): fresh sandboxes at a time (2 emulated cores; more only queue)")
    parser.add_argument("--task-retries", type=int, default=0,
                        help="retries of a task the data plane could not deliver (envd unreachable)")
    parser.add_argument("--quick", action="store_true", help="N=2; to var/bench-quick/")
    parser.add_argument("--out", type=Path, help="where the JSON + Markdown go (default bench/results/)")
    parser.add_argument("--net-prefix", default="aenvrl")
    parser.add_argument("--net-pool", default="10.21.0.0/20", help="the stack takes the next /20 of its /16")
    args = parser.parse_args()
    ns = [2] if args.quick else [int(x) for x in args.ns.split(",") if x.strip()]
    ways = [w for w in args.ways.split(",") if w]
    out_dir = args.out or (ROOT / "var" / "bench-quick" if args.quick else ROOT / "bench" / "results")
    os.environ["AENV_NET_PREFIX"], os.environ["AENV_NET_POOL"] = args.net_prefix, args.net_pool
    from bench.templates import base_shape, git_state  # noqa: PLC0415
    from harness.stack import Stack  # noqa: PLC0415

    def on_term(signum, frame):  # noqa: ARG001 - cleanup runs in the finally blocks
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    t_start, load0 = time.monotonic(), os.getloadavg()
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    home = ROOT / "var" / "bench-runs" / f"rl-{uuid.uuid4().hex[:8]}"  # short: QMP socket paths ≤ 107 bytes
    work = Path(tempfile.mkdtemp(prefix="aenv-rl-"))
    packages = [p for p in args.packages.split(",") if p]
    result: dict = {"benchmark": "rl", "when": stamp, "quick": args.quick, "git": git_state(), "template": "base",
                    "ns": ns, "ways": ways, "steps": args.steps, "fresh_concurrency": args.fresh_concurrency,
                    "task_retries": args.task_retries,
                    "target_ratio": TARGET_RATIO, "runs": {}, "notes": []}
    monitor = LoadMonitor().start()
    stack = bench = None
    interrupted = False
    try:
        art = prep.prepare(work, packages)
        result["artifacts"] = art.describe()
        print(f"wheelhouse {sorted(art.wheels)}; bundle {len(art.bundle)} B (commit {art.commit[:10]})", flush=True)
        stack = Stack(home=home)
        stack.start()
        os.environ.update(E2B_API_URL=stack.api_url, E2B_SANDBOX_URL=stack.sandbox_url, E2B_API_KEY=stack.api_key)
        os.environ.pop("E2B_DEBUG", None)
        shape = base_shape(stack)
        shape.pop("team_id", None)
        result["shape"] = shape
        bench = Bench(stack, art, args.steps, args.task_retries)
        monitor.phase = "warmup"
        t0 = time.monotonic()
        bench.kill(bench.create())  # page cache, connections: the first run is not the only cold one
        result["warmup_create_kill_s"] = round(time.monotonic() - t0, 2)
        for n in ns:
            entry = result["runs"].setdefault(str(n), {})
            for way in ways:
                monitor.phase = f"{way}{n}"
                print(f"N={n} {way} ...", flush=True)
                try:
                    if way == "fork":
                        entry[way] = bench.run_fork(n)
                    else:
                        entry[way] = bench.run_fresh(n, args.fresh_concurrency)
                except Exception as exc:  # noqa: BLE001 - reported; the other runs go on
                    result["notes"].append(f"N={n} {way}: the run failed: {type(exc).__name__}: {exc}"[:600])
                    print(f"  failed: {type(exc).__name__}: {exc}", flush=True)
                    bench.kill_all_made()
                    continue
                s = entry[way]
                print(f"  {s['ok']}/{s['n']} ok, {s['rollouts_per_hour_per_node']} rollouts/h, first "
                      f"{s['time_to_first_result_s']} s, p50 {s['latency_p50_ms']} ms, p99 {s['latency_p99_ms']} ms, "
                      f"wall {s['wall_s']} s, PSS/rollout {s['memory']['pss_per_rollout_mib']} MiB", flush=True)
                if s["errors"]:
                    errs = sorted({r.get('error', '')[:200] for r in s['rollouts'] if not r.get('ok')})
                    print(f"  errors: {errs}", flush=True)
                time.sleep(2)
            if entry.get("fork") and entry.get("fresh"):
                entry["ratio"] = ratio(entry["fork"], entry["fresh"])
                print(f"  (a)/(b) = {entry['ratio']}×", flush=True)
    except KeyboardInterrupt:
        interrupted = True
        result["notes"].append("interrupted: the results are those measured before the interruption")
    finally:
        cleanup: dict = {}
        if bench is not None:
            cleanup["kill_failures"] = bench.kill_all_made()
        if stack is not None:
            left = stack.vm_leftovers()["processes"]
            cleanup["qemu_left_before_shutdown"] = len(left)
            stack.shutdown()  # processes, VMs, its slots, nftables table and resolver
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
        result["cleanup"] = cleanup
    add_notes(result)
    finish_run(result, monitor.stop(), t_start, load0)
    out = write_results(result, stamp, out_dir)
    print(out.with_suffix(".md").read_text())
    print(f"wrote {out} (+ .md)")
    return 130 if interrupted else 0


def add_notes(result: dict) -> None:
    for n, entry in (result.get("runs") or {}).items():
        a, b = entry.get("fork"), entry.get("fresh")
        if a:
            result["notes"].append(
                f"N={n} (a): {a['answered_by_parents_worker']} of {a['ok']} correct answers came from the parent's "
                f"warm worker process (same pid, inherited by the fork); fork calls {a['fork_calls']}; "
                f"parent setup {a['setup']['upload_s']} s upload + {a['setup']['install_s']} s install/clone + "
                f"{a['setup']['warm_s']} s warm; kill of all {a['kill_s']} s")
        if b:
            result["notes"].append(f"N={n} (b): {b['concurrency']} fresh sandboxes at a time; median setup "
                                   f"{b['setup_s']} s per sandbox")
        for way, s in (("a", a), ("b", b)):
            if s and s.get("task_retries"):
                result["notes"].append(f"N={n} ({way}): {s['task_retries']} task retr(y/ies) after the data plane "
                                       "could not reach envd (SandboxUnreachableException; counted in the latency)")
            if s and s["errors"]:
                errs = sorted({str(r.get("error", ""))[:160] for r in s["rollouts"] if not r.get("ok")})
                result["notes"].append(f"N={n} ({way}): {s['errors']} failed rollout(s): {errs}")


if __name__ == "__main__":
    raise SystemExit(main())
