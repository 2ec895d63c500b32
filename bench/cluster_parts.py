"""The four measurements of bench/cluster.py, each against a stack or cluster the caller
started: capacity (idle sandboxes until admission refuses, and what each costs the host),
pause / resume with the guest RAM still in tmpfs vs already on disk, a burst of creates
from many concurrent clients, and resume on the sandbox's own node vs on another one
(moved through the S3 store). Each kills everything it made, also when it fails."""
from __future__ import annotations

import json
import os
import shutil
import statistics
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from bench import cluster_host as host
from bench.cluster_api import Api, create_burst
from bench.lifecycle_common import MIB, mem_available, percentile, run_cmd
from bench.templates_runs import db_json

ROOT = Path(__file__).resolve().parents[1]
TARGET_IDLE = 60  # issue 12: a default node here runs at least 60 idle sandboxes of the default template



@contextmanager
def started_cluster(nodes: int, keep_logs: str | None = None, **layout):
    """A one-machine cluster (``cluster/``) of ``nodes`` node workers, up; ``layout``: the rest of
    its ClusterLayout (name, networks, database, Redis db…; its state under var/bench-runs/cluster-<name>,
    fixed so that what a crashed run left is found and purged first). Purged again at the end;
    ``keep_logs``: its logs copied first to var/bench-runs/<keep_logs>-<time> (an unexpected
    error's trail: the purge removes the state dir)."""
    from cluster import Cluster, ClusterLayout  # noqa: PLC0415
    from harness.stack import free_port, shared_images_dir  # noqa: PLC0415

    layout = ClusterLayout(nodes=nodes, state_dir=ROOT / "var" / "bench-runs" / f"cluster-{layout['name']}",
                           images_dir=shared_images_dir(), api_port=free_port(), dataplane_port=free_port(), **layout)
    cluster = Cluster(layout, progress=lambda m: print(f"[cluster] {m}", flush=True))
    cluster.down(purge=True, node_timeout=60)  # what a crashed run may have left
    try:
        t0 = time.monotonic()
        cluster.up()
        print(f"[cluster] {nodes} node(s) up in {time.monotonic() - t0:.0f} s", flush=True)
        yield cluster
    finally:
        logs = layout.state_dir / "logs"
        if keep_logs is not None and logs.is_dir():
            shutil.copytree(logs, ROOT / "var" / "bench-runs" / f"{keep_logs}-{int(time.time())}", dirs_exist_ok=True)
        cluster.down(purge=True, node_timeout=120)


def dist(values: list[float]) -> dict:
    """p50 / p90 / p99 / max of latencies (ms), nearest rank like the other benchmarks."""
    if not values:
        return {}
    return {"p50": round(percentile(values, 50), 1), "p90": round(percentile(values, 90), 1),
            "p99": round(percentile(values, 99), 1), "min": round(min(values), 1), "max": round(max(values), 1),
            "mean": round(statistics.mean(values), 1), "n": len(values)}


def phase_medians(answers) -> dict:
    phases: dict[str, list[float]] = {}
    for a in answers:
        for k, v in a.phases.items():
            phases.setdefault(k, []).append(v)
    return {k: round(statistics.median(v), 1) for k, v in phases.items()}


def nodes_view(api: Api) -> list[dict]:
    """GET /nodes, reduced to what placement decided with."""
    resp = api.client.get(f"{api.url}/nodes", headers=api.admin_headers, timeout=30)
    if resp.status_code != 200:
        return []
    return [{"id": n["id"], "status": n["status"], "sandboxes": n["sandboxCount"],
             "allocated_vcpus": n["metrics"]["allocatedCPU"],
             "allocated_memory_mib": n["metrics"]["allocatedMemoryBytes"] // MIB,
             "capacity_vcpus": n["capacity"]["cpu"], "capacity_memory_mib": n["capacity"]["memoryBytes"] // MIB}
            for n in resp.json()]


# -- 1. capacity ---------------------------------------------------------------------------------


class Capacity:
    """``base`` sandboxes created on one node (``parallel`` at a time, then one at a time
    once the first refusal came, so the count is exact) until the API refuses one; then,
    all of them idle, what the host pays per sandbox. Stops early (and says so) at
    ``limit`` sandboxes or when MemAvailable would fall under ``floor_mib``."""

    def __init__(self, api: Api, home: Path, *, parallel: int, limit: int, idle_s: float, floor_mib: int):
        self.api, self.home = api, home
        self.parallel, self.limit, self.idle_s, self.floor_mib = parallel, limit, idle_s, floor_mib
        self.created: list[dict] = []  # {"sandbox_id", "ms", "live_before"}
        self.refusals: list[dict] = []  # non-201 answers: status, message
        self.stopped_by = ""
        self._lock = threading.Lock()
        self._in_flight = 0

    def _one(self) -> bool:
        """One create; False when the filling should stop."""
        with self._lock:
            live = len(self.created)
            if self.stopped_by:
                return False
            if self.limit and live + self._in_flight >= self.limit:
                if not self._in_flight:
                    self.stopped_by = f"the benchmark's limit of {self.limit} sandboxes (--capacity-max)"
                return False
            if mem_available() / MIB < self.floor_mib:
                self.stopped_by = f"MemAvailable under the benchmark's floor of {self.floor_mib} MiB"
                return False
            self._in_flight += 1
        try:
            a = self.api.create(tag="capacity")
        finally:
            with self._lock:
                self._in_flight -= 1
        with self._lock:
            if a.status == 201:
                self.created.append({"sandbox_id": a.sandbox_id, "ms": round(a.ms, 1), "live_before": live})
                return True
            self.refusals.append({"status": a.status, "message": a.error, "live": len(self.created)})
        return False

    def fill(self) -> None:
        def worker() -> None:
            while self._one():
                pass

        with ThreadPoolExecutor(self.parallel) as pool:
            for f in [pool.submit(worker) for _ in range(self.parallel)]:
                f.result()
        while not self.stopped_by and self._one():  # exact: one at a time until refused
            pass
        if not self.stopped_by and self.refusals:
            last = self.refusals[-1]
            self.stopped_by = f"the API answered {last['status']}"

    def run(self) -> dict:
        baseline = host.cpu_window(min(10.0, self.idle_s), [])
        before = host.host_memory()
        t0 = time.monotonic()
        self.fill()
        fill_s = time.monotonic() - t0
        n = len(self.created)
        out = {"created": n, "stopped_by": self.stopped_by, "refusals": self.refusals, "fill_s": round(fill_s, 1),
               "target": TARGET_IDLE,
               "met": n >= TARGET_IDLE if self.stopped_by.startswith("the API answered") else None,
               "parallel": self.parallel, "host_before": before, "host_cpu_baseline_pct": baseline["host_busy_pct"],
               "create_ms": dist([c["ms"] for c in self.created]),
               "create_ms_by_live": [[c["live_before"], c["ms"]] for c in self.created],
               "nodes": nodes_view(self.api)}
        if not n:
            return out
        ids = [c["sandbox_id"] for c in self.created]
        time.sleep(5)  # the last creates' envd /init and first metrics sample are done
        pids = [p for p in (host.qemu_pid(self.home, sid) for sid in ids) if p]
        window = host.cpu_window(self.idle_s, pids)
        after = host.host_memory()
        per_core = window["per_process_pct_of_core"]
        cores = os.cpu_count() or 1
        out.update({
            "qemu_processes": len(pids),
            "idle": {"seconds": window["seconds"], "host_busy_pct": window["host_busy_pct"],
                     "host_busy_pct_per_sandbox_of_core": round(
                         (window["host_busy_pct"] - baseline["host_busy_pct"]) * cores / n, 2),
                     "qemu_pct_of_core": host.stats(per_core, 2)},
            "host_after": after,
            "mem_available_drop_per_sandbox_mib": round((before["mem_available_mib"] - after["mem_available_mib"]) / n,
                                                        1),
            "shm_used_per_sandbox_mib": round((after["shm_used_mib"] - before["shm_used_mib"]) / n, 1),
            "ram_file_mib": host.stats([host.ram_file_bytes(sid) / MIB for sid in ids]),
            "qemu_memory": host.memory_of(pids),
            "nodes": nodes_view(self.api),
        })
        return out


# -- 2. a burst of creates -----------------------------------------------------------------------


PLACED = """
import json
from sandboxes.models import Sandbox
print("BENCH_JSON " + json.dumps({{s.id: s.node_id for s in Sandbox.objects.filter(pk__in={ids!r})}}))
"""


def creates(api: Api, db, *, creates: int, clients: int) -> dict:
    """One warm-up create, then ``creates`` creates from ``clients`` concurrent clients;
    statuses, latencies (the successes' and the refusals' apart), creates/s, where they
    went; then every sandbox killed (timed). ``db`` runs ORM code in the cluster's database."""
    warm = api.create(tag="warm-up")
    if warm.status == 201:
        api.kill(warm.sandbox_id)
    before = host.host_memory()
    burst = create_burst(api.url, api.headers["X-API-Key"], creates, clients)
    answers = burst["answers"]
    ok = [a for a in answers if a.status == 201]
    api.adopt(a.sandbox_id for a in ok)
    peak = host.host_memory()
    statuses = Counter(str(a.status) for a in answers)
    messages: dict[str, Counter] = {}
    for a in answers:
        if a.status != 201:
            messages.setdefault(str(a.status), Counter())[a.error] += 1
    placed = db_json(db, PLACED.format(ids=[a.sandbox_id for a in ok])) if ok else {}
    nodes_full = nodes_view(api)
    t0 = time.monotonic()
    failures = api.kill_all(workers=8)
    kill_s = time.monotonic() - t0
    return {
        "creates": creates, "clients": min(clients, creates), "statuses": dict(statuses),
        "messages": {k: dict(v.most_common(3)) for k, v in messages.items()},
        "created": len(ok), "wall_s": round(burst["wall_s"], 2), "last_created_s": round(burst["last_created_s"], 2),
        "creates_per_s": round(len(ok) / burst["last_created_s"], 2) if ok and burst["last_created_s"] else 0.0,
        "latency_ms_created": dist([a.ms for a in ok]),
        "latency_ms_refused": dist([a.ms for a in answers if a.status != 201]),
        "phases_ms_created": phase_medians(ok), "per_node": dict(Counter(placed.values())),
        "nodes_at_peak": nodes_full, "host_before": before, "host_at_peak": peak,
        "kill_all_s": round(kill_s, 1), "kill_failures": failures, "warm_up_status": warm.status,
        "nodes_after_kills": nodes_view(api),
    }


# -- 3. pause / resume: memory in tmpfs vs on disk ---------------------------------------------


RESUME_EVENTS = """
import json
from sandboxes.models import SandboxEvent as E
out = []
for e in E.objects.filter(sandbox_id={sid!r}, operation__in=["pause", "resume"], outcome="ok").order_by("id"):
    out.append({{"op": e.operation, "ms": e.duration_ms, "timings": (e.details or {{}}).get("timings") or {{}}}})
print("BENCH_JSON " + json.dumps(out))
"""


def _wait_on_disk(home: Path, sid: str, timeout: float = 120) -> float:
    """Until the paused VM's RAM is on disk (memory.ram, the tmpfs file gone); seconds waited."""
    t0 = time.monotonic()
    on_disk, in_tmpfs = home / "sandboxes" / sid / "memory.ram", host.SHM / f"aenv-{sid}.ram"
    while not on_disk.exists() or in_tmpfs.exists():
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"sandbox {sid}: its RAM was not on disk {timeout:.0f} s after the pause")
        time.sleep(0.01)
    return time.monotonic() - t0


def vm_timings(home: Path, sid: str) -> dict:
    try:
        return json.loads((home / "sandboxes" / sid / "vm.json").read_text()).get("timings") or {}
    except (OSError, ValueError):
        return {}


def memory_tmpfs_vs_disk(api: Api, stack, *, runs: int) -> dict:
    """One sandbox; a warm-up pause → connect (its first pause: a sandbox restored from the
    template saves its RAM differently, see the note), then ``runs`` × (pause → connect at
    once, before the RAM has left tmpfs) and (pause → wait until its RAM is on disk →
    connect). Where each resume really found the RAM is read from its resume event (the
    driver's ram_from_disk_* timings), not assumed."""
    home = stack.home
    a = api.create(tag="memory")
    if a.status != 201:
        raise RuntimeError(f"create: {a.status} {a.error}")
    sid = a.sandbox_id
    warm_pause = api.pause(sid)
    warm_spilled = True
    try:
        _wait_on_disk(home, sid, timeout=15)
    except RuntimeError:
        warm_spilled = False
    api.connect(sid)
    rows = []
    for _ in range(runs):
        p = api.pause(sid)
        on_disk_at_connect = (home / "sandboxes" / sid / "memory.ram").exists()
        r = api.connect(sid)
        rows.append({"case": "tmpfs", "pause_ms": p.ms, "resume_ms": r.ms, "ram_on_disk_when_sent": on_disk_at_connect})
        p = api.pause(sid)
        waited = _wait_on_disk(home, sid)
        spill = vm_timings(home, sid)
        r = api.connect(sid)
        rows.append({"case": "disk", "pause_ms": p.ms, "resume_ms": r.ms, "spill_seen_after_s": round(waited, 3),
                     "ram_to_disk_ms": spill.get("ram_to_disk_ms"), "ram_to_disk_mib": spill.get("ram_to_disk_mb")})
    events = db_json(stack, RESUME_EVENTS.format(sid=sid))
    resumes = [e for e in events if e["op"] == "resume"][1:]  # the warm-up's first
    for row, ev in zip(rows, resumes):
        t = ev["timings"]
        row["resume_node_ms"] = t.get("total_ms")
        row["ram_from_disk"] = "ram_from_disk_ms" in t
        row["ram_from_disk_ms"] = t.get("ram_from_disk_ms")
        row["ram_from_disk_wait_ms"] = t.get("ram_from_disk_wait_ms")
    api.kill(sid)
    out = {"runs": runs, "warm_up": {"pause_ms": round(warm_pause.ms, 1), "ram_went_to_disk": warm_spilled},
           "rows": rows}
    for case in ("tmpfs", "disk"):
        mine = [r for r in rows if r["case"] == case]
        out[case] = {"pause_ms": dist([r["pause_ms"] for r in mine]), "resume_ms": dist([r["resume_ms"] for r in mine]),
                     "resume_node_ms": dist([r["resume_node_ms"] for r in mine if r.get("resume_node_ms") is not None]),
                     "ram_found_on_disk": sum(1 for r in mine if r.get("ram_from_disk"))}
    disk_rows = [r for r in rows if r["case"] == "disk"]
    out["disk"]["ram_to_disk_ms"] = dist([r["ram_to_disk_ms"] for r in disk_rows if r.get("ram_to_disk_ms")])
    out["disk"]["ram_to_disk_mib"] = host.stats([r["ram_to_disk_mib"] for r in disk_rows if r.get("ram_to_disk_mib")])
    out["disk"]["ram_from_disk_ms"] = dist([r["ram_from_disk_ms"] for r in disk_rows if r.get("ram_from_disk_ms")])
    return out


# -- 4. resume on the same node vs on another one ----------------------------------------------


EXPORTED = """
import json, time
from sandboxes.models import Sandbox
ids, deadline = {ids!r}, time.monotonic() + 100
while True:
    rows = dict(Sandbox.objects.filter(pk__in=ids).values_list("id", "pause_image_at"))
    if all(rows.get(i) for i in ids) or time.monotonic() > deadline:
        break
    time.sleep(0.2)
print("BENCH_JSON " + json.dumps({{i: rows[i].timestamp() if rows.get(i) else None for i in ids}}))
"""

WHERE = """
import json
from sandboxes.models import Sandbox
print("BENCH_JSON " + json.dumps(dict(Sandbox.objects.filter(pk__in={ids!r}).values_list("id", "node_id"))))
"""


def drain(stack, node_id: str, on: bool) -> None:
    stack.db(f"from nodes.models import Node; Node.objects.filter(pk={node_id!r}).update(draining={on})")


def _marked(api: Api, stack, sbx: dict, text: str | None = None) -> str:
    """Writes (``text``) or reads a file in the guest through the data plane: the moved
    sandbox must still be the same machine."""
    cmd = f"echo {text} > /root/bench-mark; sync" if text else "cat /root/bench-mark"
    return run_cmd(stack.sandbox_url, cmd, sandbox_id=sbx["sandboxID"], token=sbx.get("envdAccessToken"),
                   envd_version=sbx.get("envdVersion") or "0.6.4").strip()


def resume_same_vs_other_node(api: Api, stack, node_b: str, *, runs: int, image_bytes=None) -> dict:
    """Per run: two ``base`` sandboxes on node A (B drained meanwhile), a file written in
    each, both paused, until both pauses are exported to the store; then one connects at
    home (A) and, with A drained, the other connects and is restored on B. Both are checked
    to still have their file, then killed. ``image_bytes(sandbox_id)``: the size of its
    pause image in the store."""
    node_a = stack.node_id
    rows = []
    for i in range(runs):
        drain(stack, node_b, True)
        made = []
        try:
            for _ in range(2):
                a = api.create(tag="moves")
                if a.status != 201:
                    raise RuntimeError(f"create: {a.status} {a.error}")
                made.append(a.body)
        finally:
            drain(stack, node_b, False)
        same, moved = made
        for j, sbx in enumerate(made):
            _marked(api, stack, sbx, f"run{i}-{j}")
        paused_at = {}
        for sbx in made:
            api.pause(sbx["sandboxID"])
            paused_at[sbx["sandboxID"]] = time.time()
        exported = db_json(stack, EXPORTED.format(ids=list(paused_at)))
        if not all(exported.values()):
            raise RuntimeError(f"pauses not exported to the store within 100 s: {exported}")
        images = [image_bytes(s) for s in paused_at] if image_bytes else []
        r_same = api.connect(same["sandboxID"])
        drain(stack, node_a, True)
        try:
            r_moved = api.connect(moved["sandboxID"])
        finally:
            drain(stack, node_a, False)
        where = db_json(stack, WHERE.format(ids=list(paused_at)))
        intact = [_marked(api, stack, sbx) == f"run{i}-{j}" for j, sbx in enumerate(made)]
        rows.append({"same_node_ms": round(r_same.ms, 1), "other_node_ms": round(r_moved.ms, 1),
                     "same_node_phases": r_same.phases, "other_node_phases": r_moved.phases,
                     "same_on": where.get(same["sandboxID"]), "moved_to": where.get(moved["sandboxID"]),
                     "export_s": [round(exported[s] - paused_at[s], 2) for s in paused_at],
                     "image_mib": [round(sum(f.values()) / MIB, 1) for f in images],
                     "image_files_mib": [{k: round(v / MIB, 1) for k, v in f.items()} for f in images],
                     "files_intact": all(intact)})
        for sbx in made:
            api.kill(sbx["sandboxID"])
    wrong = [r for r in rows if r["same_on"] != node_a or r["moved_to"] != node_b]
    same_ms, other_ms = [r["same_node_ms"] for r in rows], [r["other_node_ms"] for r in rows]
    return {"runs": runs, "node_a": node_a, "node_b": node_b, "rows": rows,
            "same_node_ms": dist(same_ms), "other_node_ms": dist(other_ms),
            "other_over_same_p50": round(statistics.median(other_ms) / statistics.median(same_ms), 2),
            "export_s": dist([s for r in rows for s in r["export_s"]]),
            "image_mib": host.stats([x for r in rows for x in r["image_mib"]]),
            "other_node_dispatch_ms": dist([r["other_node_phases"]["dispatch"] for r in rows
                                            if "dispatch" in r["other_node_phases"]]),
            "other_node_node_ms": dist([r["other_node_phases"]["node"] for r in rows if "node" in r["other_node_phases"]]),
            "misplaced_runs": len(wrong), "all_files_intact": all(r["files_intact"] for r in rows)}
