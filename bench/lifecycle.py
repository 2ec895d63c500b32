"""Benchmark: sandbox lifecycle operations, raw driver times (QemuDriver in this process) and
the same operations through the E2B API in the same run, so the control-plane overhead shows.

One guest shape (default 1 vCPU / 256 MiB); median of --runs. Its template snapshot is built
first if missing (vmm.templates.build, idempotent, in the shared images dir).

Raw part: create from the template snapshot → envd answering (and a few cold boots for
comparison); pause / resume in memory; pause to disk / resume; filesystem-only pause / cold
resume; snapshot (pause window and total) and a restore from it; fork ×4 and ×16 (parent pause
window; time from the fork call until every child has answered a command); host memory per
forked child.

API part (--api auto starts a stack of its own with a Template row of the same shape; --api URL
uses a running one with --api-template): create from the template snapshot, pause (the API's
pause is to disk), connect (resumes: 201) and on a running sandbox (200), snapshot, create from
that snapshot id, fork ×4 / ×16 with every child answering a command through the data plane
(official SDK), host memory per forked child. Each call is timed at the client and split with
the API's Server-Timing header: node = the time the node reported for the same request, so
overhead = client time − node time (HTTP, Django, DB transitions and events, Celery there and
back); ratio = API median / raw median. Parent pause windows through the API are the node's
capture timings, read from the SandboxEvents after the run.

Host memory per forked child: after every child has answered, /proc/<pid>/smaps_rollup of each
child QEMU. PSS divides each shared page (the fork capture's RAM file on tmpfs, QEMU's binary and
libraries) evenly among the processes mapping it, so the mean child PSS is a child's fair share;
Pss_Anon is what it owns alone (guest pages it changed, copy-on-write, plus QEMU's own heap and
TCG translation buffers). The MemAvailable drop per child is a second, noisier view (other load
on the host moves it; it also includes the capture file and page tables).

    .venv/bin/python bench/lifecycle.py [--runs 10] [--fork16-runs 5] [--api auto] [--quick]
Writes the tables to stdout and JSON + markdown to bench/results/lifecycle-<UTC stamp>.{json,md}
(--quick: 2 repetitions, written to var/bench-quick/ instead).
"""
from __future__ import annotations

import argparse
import concurrent.futures
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vmm import templates  # noqa: E402
from vmm.driver import BootSpec  # noqa: E402
from vmm.images import DEFAULT_IMAGES_DIR, ensure_image  # noqa: E402
from vmm.qemu import QemuDriver, envd_healthy  # noqa: E402

# Targets from the issue (QEMU TCG, 2 host cores, 256 MiB guest), ms unless noted. They apply
# to the raw name and to its api.<name> twin.
TARGETS = {
    "pause": 15, "pause_to_disk": 40, "resume_from_disk": 350, "snapshot_pause_window": 100,
    "create_from_template": 400, "fork4_all_answering": 1000, "fork16_parent_pause": 100,
    "fork16_all_answering": 4000, "fork4_child_pss_mib": 60, "fork16_child_pss_mib": 60,
}
OVERHEAD_TARGET = 15  # ms of control plane per operation
MIB = 1 << 20

# Why a target is missed on this machine (from the raw driver measurements and the node's
# timings): shown next to a miss in the summary table.
WHY_MISSED = {
    "fork4_all_answering": "CPU-bound TCG on 2 host cores: 4 children restore and answer their first command "
                           "at once (children_ready is most of it), plus the RAM copy in the capture",
    "fork16_all_answering": "CPU-bound TCG on 2 host cores: 16 guests resume and run their first command at once "
                            "on 2 cores (~8 vCPUs per core)",
    "fork16_parent_pause": "the capture copies the 256 MiB guest RAM into the fork's tmpfs file while the "
                           "parent's vCPUs are stopped (~70-90 ms of copy here), so host load tips it over 100 ms",
    "fork4_child_pss_mib": "each child QEMU owns ~80 MiB anonymous memory: TCG translation buffers and QEMU heap "
                           "per child, plus copy-on-write guest pages (shared RAM is only ~10 MiB of the PSS)",
    "fork16_child_pss_mib": "each child QEMU owns ~80 MiB anonymous memory: TCG translation buffers and QEMU heap "
                            "per child, plus copy-on-write guest pages",
    "pause_to_disk": "CPU-bound TCG on 2 cores: the device state + RAM save competes with the guests' vCPUs",
    "resume_from_disk": "CPU-bound TCG on 2 cores: incoming migration of 256 MiB, then envd must answer",
    "create_from_template": "CPU-bound TCG on 2 cores: RAM copy of the template snapshot, then envd /init",
    "snapshot_pause_window": "the capture copies the 256 MiB guest RAM while the vCPUs are stopped (~65-75 ms "
                             "of copy here), so host load tips it over 100 ms",
    "overhead": "control plane (see the dispatch column: the Celery round trip; the rest is HTTP, Django and "
                "the DB transitions + SandboxEvents), on 2 cores shared with the guests",
}


def ms(t0: float, t1: float) -> float:
    return (t1 - t0) * 1e3


def run_cmd(url: str, cmd: str = "echo ok", *, sandbox_id: str = "bench", token: str | None = None,
            envd_version: str = "0.6.4") -> str:
    """One command through envd with the official SDK. ``url`` is either a VM's envd (raw part)
    or the data plane, which routes by the E2b-Sandbox-Id header (API part)."""
    from e2b import Sandbox  # noqa: PLC0415
    from e2b.connection_config import ConnectionConfig  # noqa: PLC0415
    from packaging.version import Version  # noqa: PLC0415

    headers = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": "49983"}
    if token:  # the SDK sends envd's token as a header of the connection, like Sandbox.create does
        headers["X-Access-Token"] = token
    cfg = ConnectionConfig(debug=True, sandbox_url=url, extra_sandbox_headers=headers)
    sbx = Sandbox(sandbox_id=sandbox_id, sandbox_domain=None, envd_version=Version(envd_version),
                  envd_access_token=token, traffic_access_token=None, connection_config=cfg)
    return sbx.commands.run(cmd, user="root", timeout=120).stdout


def smaps_rollup(pid: int) -> dict[str, int]:
    """kB fields of /proc/<pid>/smaps_rollup (Rss, Pss, Pss_Anon, Pss_File, Pss_Shmem...)."""
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key] = int(parts[0])
    return out


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def add_memory(add, prefix: str, pids: list[int], avail0: int) -> None:
    """Per-child host memory of forked children (see the module docstring)."""
    time.sleep(1.0)
    rollups = [smaps_rollup(pid) for pid in pids]
    avail1 = mem_available()
    add(f"{prefix}_child_pss_mib", statistics.mean(r.get("Pss", 0) for r in rollups) / 1024)
    add(f"{prefix}_child_rss_mib", statistics.mean(r.get("Rss", 0) for r in rollups) / 1024)
    add(f"{prefix}_child_pss_anon_mib", statistics.mean(r.get("Pss_Anon", 0) for r in rollups) / 1024)
    add(f"{prefix}_memavailable_drop_per_child_mib", (avail0 - avail1) / len(pids) / MIB)


class LoadMonitor:
    """Samples the 1-minute load average and the QEMU processes that are not this benchmark's
    (other users of the host) every few seconds, so a result says how quiet the host was. Our own
    guests (fork ×16 runs 17 TCG guests on 2 cores) push the load up by themselves."""

    def __init__(self, every: float = 5.0):
        import threading  # noqa: PLC0415

        self.every, self.phase, self.samples = every, "setup", []
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    @staticmethod
    def foreign_qemus() -> int:
        mine = str(ROOT / "var" / "bench-runs")
        n = 0
        for pid_dir in Path("/proc").iterdir():
            if not pid_dir.name.isdigit():
                continue
            try:
                cmd = (pid_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if "qemu-system" in cmd.split(" ", 1)[0] and mine not in cmd and ".tmp-template-vm-" not in cmd:
                n += 1
        return n

    def _loop(self) -> None:
        while not self.stop_event.wait(self.every):
            self.samples.append((self.phase, os.getloadavg()[0], self.foreign_qemus()))

    def start(self) -> "LoadMonitor":
        self.thread.start()
        return self

    def stop(self) -> dict:
        self.stop_event.set()
        self.thread.join(timeout=self.every + 1)
        out = {}
        for phase in dict.fromkeys(p for p, _, _ in self.samples):
            loads = [x for p, x, _ in self.samples if p == phase]
            others = [q for p, _, q in self.samples if p == phase]
            out[phase] = {"load1_mean": round(statistics.mean(loads), 2), "load1_max": round(max(loads), 2),
                          "other_qemu_max": max(others), "samples": len(loads)}
        return out


def ensure_template_snapshot(args) -> float:
    """Builds the template snapshot of the benchmark's shape if missing; seconds it took."""
    images_dir = Path(args.images_dir).absolute()
    ensure_image(images_dir, "base", progress=lambda m: None)
    t0 = time.monotonic()
    templates.build(images_dir, "base", args.cpu, args.memory, args.disk, progress=print)
    return round(time.monotonic() - t0, 1)


class Raw:
    """The driver half: every number is wall time around one driver call (plus what the call
    itself reports in its timings)."""

    def __init__(self, args):
        self.args = args
        self.images_dir = Path(args.images_dir).absolute()
        self.home = (ROOT / "var" / "bench-runs" / f"lifecycle-{uuid.uuid4().hex[:8]}").absolute()
        self.driver = QemuDriver(home=self.home, images_dir=self.images_dir, boot_timeout=120)
        self.templates = templates.TemplateCache(self.images_dir)
        self.samples: dict[str, list[float]] = {}
        self.n = 0

    def add(self, name: str, value: float) -> None:
        self.samples.setdefault(name, []).append(value)

    def sid(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}-{self.n}"

    def spec(self, sid: str) -> BootSpec:
        return BootSpec(sid, cpu_count=self.args.cpu, memory_mb=self.args.memory, disk_size_mb=self.args.disk)

    def start(self, spec: BootSpec):
        """Like the node's create: a restore of the booted template (built first), else a cold boot."""
        template = self.templates.find(self.driver, spec)
        if template is None:
            info = self.driver.boot(spec)
            info.timings["from_template_snapshot"] = 0
        else:
            info = self.driver.restore(template, spec, template=True)
            info.timings["from_template_snapshot"] = 1
        return info

    def run(self) -> None:
        a = self.args
        ops = set(a.ops.split(","))
        try:
            if "create" in ops:
                self.creates()
            if ops - {"create"}:
                parent = self.start(self.spec("parent"))
                run_cmd(parent.envd_url, "echo bench > /root/state.txt && python3 -c 'print(1)'")
                sid = parent.sandbox_id
                for op, fn in (("pause", self.pause_resume), ("disk", self.pause_to_disk), ("fs", self.fs_pause),
                               ("snapshot", self.snapshots)):
                    if op in ops:
                        fn(sid)
                for count, runs in ((4, a.fork4_runs), (16, a.fork16_runs)):
                    if f"fork{count}" in ops:
                        for _ in range(runs):
                            self.fork(sid, count)
                self.driver.kill(sid)
        finally:
            for vm in self.driver.list():
                self.driver.kill(vm.sandbox_id)
            shutil.rmtree(self.home, ignore_errors=True)

    def creates(self) -> None:
        for _ in range(self.args.runs):
            sid = self.sid("create")
            t0 = time.perf_counter()
            info = self.start(self.spec(sid))
            t1 = time.perf_counter()
            assert info.timings.get("from_template_snapshot") == 1, info.timings
            run_cmd(info.envd_url)
            t2 = time.perf_counter()
            self.add("create_from_template", ms(t0, t1))
            self.add("create_from_template_first_command", ms(t0, t2))
            self.add("create.ram_copy", info.timings.get("ram_copy_ms", 0))
            t0 = time.perf_counter()
            self.driver.kill(sid)
            self.add("kill", ms(t0, time.perf_counter()))
        for _ in range(self.args.cold_runs):
            sid = self.sid("cold")
            t0 = time.perf_counter()
            self.driver.boot(self.spec(sid))  # boot() never restores a template
            self.add("create_cold_boot", ms(t0, time.perf_counter()))
            self.driver.kill(sid)

    def pause_resume(self, sid: str) -> None:
        for _ in range(self.args.runs):
            t0 = time.perf_counter()
            t = self.driver.pause(sid)
            self.add("pause", ms(t0, time.perf_counter()))
            self.add("pause.qmp_stop", t["pause_ms"])
            t0 = time.perf_counter()
            self.driver.resume(sid)
            self.add("resume_in_memory", ms(t0, time.perf_counter()))

    def pause_to_disk(self, sid: str) -> None:
        for _ in range(self.args.runs):
            t0 = time.perf_counter()
            t = self.driver.pause_to_disk(sid)
            self.add("pause_to_disk", ms(t0, time.perf_counter()))
            self.add("pause_to_disk.saved", t["pause_to_disk_ms"])
            t0 = time.perf_counter()
            self.driver.resume(sid)
            self.add("resume_from_disk", ms(t0, time.perf_counter()))

    def fs_pause(self, sid: str) -> None:
        for _ in range(self.args.fs_runs):
            t0 = time.perf_counter()
            self.driver.pause_to_disk(sid, memory=False)
            self.add("pause_fs_only", ms(t0, time.perf_counter()))
            t0 = time.perf_counter()
            info = self.driver.resume(sid)
            self.add("resume_fs_only_cold_boot", ms(t0, time.perf_counter()))
            assert info.timings.get("cold_boot") == 1

    def snapshots(self, sid: str) -> None:
        """Snapshot (pause window and total), then one restore from it (→ envd, → first command)."""
        for i in range(self.args.runs):
            dest = self.home / "snapshots" / f"s{i}"
            t0 = time.perf_counter()
            m = self.driver.snapshot(sid, dest)
            self.add("snapshot_total", ms(t0, time.perf_counter()))
            self.add("snapshot_pause_window", m.timings["pause_ms"])
            self.add("snapshot.memory_copy", m.timings["memory_copy_ms"])
            child = self.sid("restored")
            t0 = time.perf_counter()
            info = self.driver.restore(m, self.spec(child))
            t1 = time.perf_counter()
            run_cmd(info.envd_url)
            self.add("create_from_snapshot", ms(t0, t1))
            self.add("create_from_snapshot_first_command", ms(t0, time.perf_counter()))
            self.driver.kill(child)
            shutil.rmtree(dest)

    def fork(self, sid: str, count: int) -> None:
        avail0 = mem_available()
        t0 = time.perf_counter()
        results = self.driver.fork(sid, count)
        kids = [r for r in results if not isinstance(r, Exception)]
        if len(kids) != count:
            raise RuntimeError(f"fork x{count}: {[r for r in results if isinstance(r, Exception)]}")
        with concurrent.futures.ThreadPoolExecutor(count) as pool:
            outs = list(pool.map(lambda k: run_cmd(k.envd_url), kids))
        t_all = time.perf_counter()
        assert all(o.strip() == "ok" for o in outs), outs
        self.add(f"fork{count}_parent_pause", kids[0].timings["capture.pause_ms"])
        self.add(f"fork{count}_children_ready", kids[0].timings["fork_all_ready_ms"])
        self.add(f"fork{count}_all_answering", ms(t0, t_all))
        add_memory(self.add, f"fork{count}", [k.pid for k in kids], avail0)
        for k in kids:
            self.driver.kill(k.sandbox_id)
        assert envd_healthy("127.0.0.1", self.driver.info(sid).envd_port)


class Api:
    """The control-plane half: the same verbs through the E2B API, split by Server-Timing.
    Every sample is named ``api.<raw name>`` so it lines up with the raw one."""

    def __init__(self, args, api: str, sandbox_url: str, key: str, template: str, stack=None):
        self.args, self.api, self.sandbox_url, self.key = args, api.rstrip("/"), sandbox_url.rstrip("/"), key
        self.template, self.stack = template, stack
        self.samples: dict[str, list[float]] = {}
        self.notes: list[str] = []
        self.live: set[str] = set()  # sandboxes this run started and has not killed yet
        self.started: set[str] = set()  # every one, for the RAM-file sweep after the stack stops

    def add(self, name: str, value: float) -> None:
        self.samples.setdefault(name, []).append(value)

    @property
    def headers(self) -> dict:
        return {"X-API-Key": self.key}

    def timed(self, client, name: str, method: str, path: str, expect: int, *, node_of=None, **kw):
        """One API call; adds api.<name> (client ms), .node, .overhead; returns (response, ms)."""
        from bench.create_kill import parse_server_timing  # noqa: PLC0415

        t0 = time.perf_counter()
        resp = client.request(method, f"{self.api}{path}", headers=self.headers, timeout=600, **kw)
        wall = ms(t0, time.perf_counter())
        if resp.status_code != expect:
            raise RuntimeError(f"{method} {path}: {resp.status_code} {resp.text[:300]}")
        phases = parse_server_timing(resp.headers.get("server-timing", ""))
        node = node_of(phases) if node_of else phases.get("node")
        self.add(f"api.{name}", wall)
        if node is not None:
            self.add(f"api.{name}.node", node)
            self.add(f"api.{name}.overhead", wall - node)
            if "dispatch" in phases:  # the Celery round trip without the node's work
                self.add(f"api.{name}.dispatch", phases["dispatch"])
        return resp, wall

    @staticmethod
    def create_node_ms(phases: dict) -> float | None:
        """A create's node time: its total minus placement (schedule) and the Celery round
        trip without the node's work (dispatch); see sandboxes.lifecycle.create.create_phases."""
        if "total" not in phases:
            return None
        return phases["total"] - phases.get("schedule", 0.0) - phases.get("dispatch", 0.0)

    def command(self, sbx: dict, cmd: str = "echo ok") -> str:
        """A command in an API sandbox through the data plane (official SDK, its own token)."""
        return run_cmd(self.sandbox_url, cmd, sandbox_id=sbx["sandboxID"], token=sbx.get("envdAccessToken"),
                       envd_version=sbx.get("envdVersion") or "0.6.4")

    def kill(self, client, sid: str) -> None:
        resp = client.delete(f"{self.api}/sandboxes/{sid}", headers=self.headers, timeout=120)
        if resp.status_code not in (204, 404):
            raise RuntimeError(f"kill {sid}: {resp.status_code} {resp.text[:300]}")
        self.live.discard(sid)

    def track(self, *ids: str) -> None:
        self.live.update(ids)
        self.started.update(ids)

    def kill_all(self, client) -> None:
        """After a failure: kill what is still alive through the API, so the node removes
        its VMs and RAM files the normal way (a SIGKILL would leave them in /dev/shm)."""
        for sid in list(self.live):
            try:
                self.kill(client, sid)
            except Exception as exc:  # noqa: BLE001 - best effort, the stack teardown follows
                print(f"cleanup: kill {sid} failed: {exc}", file=sys.stderr)

    def create(self, client, name: str, template: str) -> dict:
        """A create through the API → envd answering (the API answers after envd /init) →
        the first command through the data plane."""
        t0 = time.perf_counter()
        resp, _ = self.timed(client, name, "POST", "/v2/sandboxes", 201, node_of=self.create_node_ms,
                             json={"templateID": template, "timeout": 3600, "metadata": {"bench": "lifecycle"}})
        sbx = resp.json()
        self.track(sbx["sandboxID"])
        if self.command(sbx).strip() != "ok":
            raise RuntimeError(f"{name}: first command did not answer ok")
        self.add(f"api.{name}_first_command", ms(t0, time.perf_counter()))
        return sbx

    def run(self) -> None:
        import httpx  # noqa: PLC0415

        a, ops = self.args, set(self.args.ops.split(","))
        with httpx.Client() as client:
            try:
                self._run(client, a, ops)
            except BaseException:
                self.kill_all(client)
                raise

    def _run(self, client, a, ops) -> None:
        if "create" in ops:
            for _ in range(a.runs):
                self.kill(client, self.create(client, "create_from_template", self.template)["sandboxID"])
        if not ops - {"create"}:
            return
        parent = self.create(client, "parent_create", self.template)
        sid = parent["sandboxID"]
        self.command(parent, "echo bench > /root/state.txt")
        if "disk" in ops or "pause" in ops:
            for _ in range(a.runs):
                self.timed(client, "pause_to_disk", "POST", f"/sandboxes/{sid}/pause", 204, json={})
                self.timed(client, "resume_from_disk", "POST", f"/sandboxes/{sid}/connect", 201,
                           json={"timeout": 3600})
                # nothing for the node to do: the whole call is control plane
                self.timed(client, "connect_running", "POST", f"/sandboxes/{sid}/connect", 200,
                           node_of=lambda p: 0.0, json={"timeout": 3600})
        if "fs" in ops:
            # a cold-boot resume loses the processes, not the files; the parent goes on as is
            for _ in range(a.fs_runs):
                self.timed(client, "pause_fs_only", "POST", f"/sandboxes/{sid}/pause", 204, json={"memory": False})
                self.timed(client, "resume_fs_only_cold_boot", "POST", f"/sandboxes/{sid}/connect", 201,
                           json={"timeout": 3600})
        if "snapshot" in ops:
            self.snapshots(client, sid)
        for count, runs in ((4, a.fork4_runs), (16, a.fork16_runs)):
            if f"fork{count}" in ops:
                for _ in range(runs):
                    self.fork(client, sid, count)
        self.pause_windows(sid)
        self.kill(client, sid)

    def snapshots(self, client, sid: str) -> None:
        for _ in range(self.args.runs):
            resp, _ = self.timed(client, "snapshot_total", "POST", f"/sandboxes/{sid}/snapshots", 201, json={})
            snap = resp.json()["snapshotID"]
            child = self.create(client, "create_from_snapshot", snap)
            self.kill(client, child["sandboxID"])
            gone = client.delete(f"{self.api}/templates/{snap}", headers=self.headers, timeout=120)
            if gone.status_code != 204:
                raise RuntimeError(f"delete snapshot {snap}: {gone.status_code} {gone.text[:300]}")

    def fork(self, client, sid: str, count: int) -> None:
        avail0 = mem_available()
        t0 = time.perf_counter()
        resp, _ = self.timed(client, f"fork{count}", "POST", f"/sandboxes/{sid}/fork", 201,
                             json={"count": count, "timeout": 600})
        entries = resp.json()
        kids = [e["sandbox"] for e in entries if "sandbox" in e]
        self.track(*(k["sandboxID"] for k in kids))
        try:
            if len(kids) != count:
                raise RuntimeError(f"API fork x{count}: {[e['error'] for e in entries if 'error' in e]}")
            with concurrent.futures.ThreadPoolExecutor(count) as pool:
                outs = list(pool.map(self.command, kids))
            t_all = time.perf_counter()
            assert all(o.strip() == "ok" for o in outs), outs
            self.add(f"api.fork{count}_all_answering", ms(t0, t_all))
            if self.stack is not None:
                pids = [p for k in kids for p in self.stack.qemu_pids(k["sandboxID"])]
                if len(pids) == count:
                    add_memory(self.add, f"api.fork{count}", pids, avail0)
        finally:
            with concurrent.futures.ThreadPoolExecutor(min(len(kids), 8) or 1) as pool:
                list(pool.map(lambda k: self.kill(client, k["sandboxID"]), kids))

    def pause_windows(self, sid: str) -> None:
        """The node's capture timings of this parent's snapshots and forks, from the
        SandboxEvents the control plane wrote (only with a stack of our own: needs its DB)."""
        if self.stack is None:
            self.notes.append("API parent pause windows need --api auto (read from the stack's SandboxEvents)")
            return
        code = f"""
import json
from sandboxes.models import SandboxEvent as E
ev = E.objects.filter(sandbox_id={sid!r}, outcome="ok").order_by("id")
snaps = [(e.details.get("timings") or {{}}).get("pause_ms") for e in ev.filter(operation="snapshot")]
forks = []
for e in ev.filter(operation="fork"):
    kids = e.details.get("children") or []
    t = {{}}
    for c in E.objects.filter(sandbox_id__in=kids, operation="create", outcome="ok"):
        t = (c.details or {{}}).get("timings") or {{}}
        if "capture.pause_ms" in t:
            break
    forks.append({{"count": len(kids), "pause_ms": t.get("capture.pause_ms"),
                  "ready_ms": t.get("fork_all_ready_ms")}})
print("BENCH_JSON " + json.dumps({{"snapshots": snaps, "forks": forks}}))
"""
        out = self.stack.db(code)
        data = json.loads(out.split("BENCH_JSON ", 1)[1])
        for v in data["snapshots"]:
            if v is not None:
                self.add("api.snapshot_pause_window", v)
        for f in data["forks"]:
            if f["pause_ms"] is not None:
                self.add(f"api.fork{f['count']}_parent_pause", f["pause_ms"])
                self.add(f"api.fork{f['count']}_children_ready", f["ready_ms"])


def summarize(samples: dict[str, list[float]]) -> dict:
    return {k: {"median": round(statistics.median(v), 2), "min": round(min(v), 2), "max": round(max(v), 2),
                "n": len(v)} for k, v in samples.items() if v}


def target_of(name: str):
    """(target, unit) of a sample name, raw or api.<name>; overheads have the 15 ms one."""
    if name.endswith(".overhead"):
        return OVERHEAD_TARGET, "ms"
    base = name[4:] if name.startswith("api.") else name
    return TARGETS.get(base), ("MiB" if name.endswith("_mib") else "ms")


def table(summary: dict) -> list[str]:
    """Markdown table: one row per measured quantity, with the issue's target where it has one."""
    lines = ["| operation | median | min | max | n | unit | target | met? |",
             "|---|---:|---:|---:|---:|---|---|---|"]
    for name, s in summary.items():
        target, unit = target_of(name)
        tgt = "" if target is None else f"≤ {target}"
        met = "" if target is None else ("yes" if s["median"] <= target else "**no**")
        lines.append(f"| {name} | {s['median']:.1f} | {s['min']:.1f} | {s['max']:.1f} | {s['n']} | {unit} "
                     f"| {tgt} | {met} |")
    return lines


# The summary: one row per operation of the list. (label, raw key, API key, API call
# whose Server-Timing gives the overhead, target key or None)
ROWS = [
    ("create from template snapshot → envd answering", "create_from_template", "api.create_from_template",
     "api.create_from_template", "create_from_template"),
    ("create from template → first command", "create_from_template_first_command",
     "api.create_from_template_first_command", "api.create_from_template", None),
    ("pause (in memory; the API has no in-memory pause)", "pause", None, None, "pause"),
    ("pause to disk (the API's pause)", "pause_to_disk", "api.pause_to_disk", "api.pause_to_disk",
     "pause_to_disk"),
    ("resume from disk → envd answering (API: connect, 201)", "resume_from_disk", "api.resume_from_disk",
     "api.resume_from_disk", "resume_from_disk"),
    ("connect to a running sandbox (200; raw: nothing to do)", None, "api.connect_running", "api.connect_running",
     None),
    ("snapshot: parent pause window", "snapshot_pause_window", "api.snapshot_pause_window", "api.snapshot_total",
     "snapshot_pause_window"),
    ("snapshot: total", "snapshot_total", "api.snapshot_total", "api.snapshot_total", None),
    ("create from that snapshot → envd answering", "create_from_snapshot", "api.create_from_snapshot",
     "api.create_from_snapshot", None),
    ("fork ×4: parent pause window", "fork4_parent_pause", "api.fork4_parent_pause", "api.fork4", None),
    ("fork ×4: until all 4 answer a command", "fork4_all_answering", "api.fork4_all_answering", "api.fork4",
     "fork4_all_answering"),
    ("fork ×16: parent pause window", "fork16_parent_pause", "api.fork16_parent_pause", "api.fork16",
     "fork16_parent_pause"),
    ("fork ×16: until all 16 answer a command", "fork16_all_answering", "api.fork16_all_answering", "api.fork16",
     "fork16_all_answering"),
    ("host memory per forked child (×4, PSS)", "fork4_child_pss_mib", "api.fork4_child_pss_mib", None,
     "fork4_child_pss_mib"),
    ("host memory per forked child (×16, PSS)", "fork16_child_pss_mib", "api.fork16_child_pss_mib", None,
     "fork16_child_pss_mib"),
]


def summary_rows(summary: dict) -> list[dict]:
    """The operation table as data: raw and API medians, node time, overhead, ratio, verdicts."""
    out = []
    for label, raw_key, api_key, call, target_key in ROWS:
        raw, api = summary.get(raw_key or ""), summary.get(api_key or "")
        node, over = summary.get(f"{call}.node"), summary.get(f"{call}.overhead")
        dispatch = summary.get(f"{call}.dispatch")
        if raw is None and api is None:
            continue
        target = TARGETS.get(target_key) if target_key else None
        unit = "MiB" if (raw_key or api_key).endswith("_mib") else "ms"
        row = {"operation": label, "unit": unit, "raw": raw and raw["median"], "raw_n": raw and raw["n"],
               "api": api and api["median"], "api_n": api and api["n"], "api_call": call,
               "node": node and node["median"], "overhead": over and over["median"],
               "dispatch": dispatch and dispatch["median"],
               "ratio": round(api["median"] / raw["median"], 2) if raw and api and raw["median"] else None,
               "target": target, "overhead_target": OVERHEAD_TARGET if over else None}
        row["met_raw"] = None if target is None or raw is None else raw["median"] <= target
        row["met_api"] = None if target is None or api is None else api["median"] <= target
        row["met_overhead"] = None if over is None else over["median"] <= OVERHEAD_TARGET
        why = []
        if row["met_raw"] is False or row["met_api"] is False:
            why.append(WHY_MISSED.get(target_key, ""))
        if row["met_overhead"] is False:
            why.append("overhead: " + WHY_MISSED["overhead"] if not why else "overhead: control plane")
        row["why_missed"] = "; ".join(w for w in why if w)
        out.append(row)
    return out


def summary_table(rows: list[dict]) -> list[str]:
    def f(v, unit=""):
        return "–" if v is None else f"{v:.1f}{unit}"

    def yn(v):
        return "" if v is None else ("yes" if v else "**no**")

    lines = ["| operation | raw | API | n raw/API | node (Server-Timing) | overhead (API − node) "
             "| of which dispatch | API/raw | target | met? raw / API | overhead ≤ 15 ms? | why missed |",
             "|---|---:|---:|---|---:|---:|---:|---:|---|---|---|---|"]
    for r in rows:
        u = " MiB" if r["unit"] == "MiB" else ""
        target = "" if r["target"] is None else f"≤ {r['target']}{u or ' ms'}"
        met = "" if r["target"] is None else f"{yn(r['met_raw']) or '–'} / {yn(r['met_api']) or '–'}"
        n = f"{r['raw_n'] or '–'}/{r['api_n'] or '–'}"
        ratio = "–" if r["ratio"] is None else f"{r['ratio']:.2f}×"
        lines.append(f"| {r['operation']} | {f(r['raw'], u)} | {f(r['api'], u)} | {n} | {f(r['node'])} "
                     f"| {f(r['overhead'])} | {f(r.get('dispatch'))} | {ratio} | {target} "
                     f"| {met} | {yn(r['met_overhead'])} | {r['why_missed']} |")
    return lines


def write_results(result: dict, stamp: str, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"lifecycle-{stamp}.json"
    out.write_text(json.dumps(result, indent=2))
    host = result.get("host", {})
    head = [f"# lifecycle benchmark {stamp}", "",
            f"shape {result.get('shape')}, ops {result.get('ops')}, repetitions {result.get('repetitions')}, "
            f"host {host.get('machine')} × {host.get('cpus')} cores, kernel {host.get('kernel')}, "
            f"load average at start {host.get('loadavg_at_start')}, at end {host.get('loadavg_at_end')}, "
            f"run took {result.get('duration_s')} s", ""]
    head += [f"- {n}" for n in result.get("notes", [])] + [""]
    body = []
    if result.get("rows"):
        body = ["## Operations: raw driver vs API (medians)", "", *summary_table(result["rows"]), "",
                "node = the node's own time for the request (Server-Timing); overhead = API client time − node "
                "(of which dispatch = the Celery round trip without the node's work, from Server-Timing; the "
                "rest is HTTP, Django, the DB transitions and SandboxEvents); API/raw = API median / raw driver "
                "median (the API's creates, resumes and forks also include envd /init, which the raw driver "
                "call does not). Parent pause windows via the API are the node's capture timings "
                "(SandboxEvents), so their overhead column is the whole call's.", "",
                "## Every measured quantity", ""]
    out.with_suffix(".md").write_text("\n".join(head + body + table(result["summary"])) + "\n")
    return out


def start_stack(args):
    """A stack of its own (API, data plane, node worker, sweeper) with a Template row of the
    benchmark's shape; vCPU overcommit raised so fork ×16 (+ parent) fits a 2-core node."""
    from tests.integration.stack import Stack  # noqa: PLC0415

    stack = Stack(home=ROOT / "var" / "bench-runs" / uuid.uuid4().hex[:8],
                  extra_env={"AENV_NODE_VCPU_OVERCOMMIT": str(args.vcpu_overcommit),
                             "AENV_IMAGES_DIR": str(Path(args.images_dir).absolute())}).start()
    template = f"bench-c{args.cpu}m{args.memory}"
    stack.db("from sandboxes.models import Template\n"
             f"Template.objects.update_or_create(id={template!r}, defaults=dict(image='base', "
             f"cpu_count={args.cpu}, memory_mb={args.memory}, disk_size_mb={args.disk}, public=True))")
    return stack, template


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--cold-runs", type=int, default=3, help="cold boots for comparison (slow)")
    parser.add_argument("--fs-runs", type=int, default=3, help="filesystem-only pause + cold-boot resume (slow)")
    parser.add_argument("--fork4-runs", type=int, default=10)
    parser.add_argument("--fork16-runs", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="2 repetitions (1 for the slow ones), results to var/")
    parser.add_argument("--cpu", type=int, default=1)
    parser.add_argument("--memory", type=int, default=256)
    parser.add_argument("--disk", type=int, default=2048)
    parser.add_argument("--images-dir", default=os.environ.get("AENV_IMAGES_DIR", str(DEFAULT_IMAGES_DIR)))
    parser.add_argument("--ops", default="create,pause,disk,fs,snapshot,fork4,fork16",
                        help="operations to run (comma separated), raw and API alike")
    parser.add_argument("--no-raw", action="store_true", help="only the API part")
    parser.add_argument("--api", default="auto", help="API base URL, 'auto' to start a stack of its own, "
                                                      "'' for the raw part only")
    parser.add_argument("--sandbox-url", default=os.environ.get("E2B_SANDBOX_URL", ""),
                        help="data plane URL with --api URL")
    parser.add_argument("--api-key", default=os.environ.get("E2B_API_KEY", ""))
    parser.add_argument("--api-template", default="base", help="template id with --api URL (its shape should match)")
    parser.add_argument("--vcpu-overcommit", type=float, default=32.0,
                        help="AENV_NODE_VCPU_OVERCOMMIT of the auto stack")
    parser.add_argument("--render", type=Path, help="only re-render an earlier JSON result as markdown")
    args = parser.parse_args()
    if args.render:
        result = json.loads(args.render.read_text())
        result["rows"] = summary_rows(result["summary"])  # today's row definitions and notes
        print(write_results(result, result["when"], args.render.parent).with_suffix(".md").read_text())
        return 0
    if args.quick:
        args.runs, args.cold_runs, args.fs_runs, args.fork4_runs, args.fork16_runs = 2, 1, 1, 2, 1

    t_start = time.monotonic()
    load0 = os.getloadavg()
    monitor = LoadMonitor().start()
    result: dict = {"benchmark": "lifecycle", "ops": args.ops, "quick": args.quick,
                    "shape": {"cpu": args.cpu, "memory_mb": args.memory, "disk_mb": args.disk},
                    "repetitions": {"runs": args.runs, "cold": args.cold_runs, "fs_only": args.fs_runs,
                                    "fork4": args.fork4_runs, "fork16": args.fork16_runs},
                    "notes": []}
    result["template_snapshot_ready_s"] = ensure_template_snapshot(args)
    samples: dict[str, list[float]] = {}
    if not args.no_raw:
        monitor.phase = "raw"
        raw = Raw(args)
        raw.run()
        samples.update(raw.samples)
    if args.api:
        stack = None
        api, sandbox_url, key, template = args.api, args.sandbox_url, args.api_key, args.api_template
        a = None
        if api == "auto":
            stack, template = start_stack(args)
            api, sandbox_url, key = stack.api_url, stack.sandbox_url, stack.api_key
        try:
            monitor.phase = "api"
            a = Api(args, api, sandbox_url, key, template, stack)
            a.run()
            samples.update(a.samples)
            result["notes"] += a.notes
        finally:
            if stack:
                stack.stop()
                stack.kill_vm_leftovers()
                shutil.rmtree(stack.home, ignore_errors=True)
                # RAM files of VMs that only a SIGKILL above ended (none after a clean run)
                for sid in a.started if a is not None else ():
                    shm = Path("/dev/shm")
                    for f in [*shm.glob(f"aenv-{sid}.ram"), *shm.glob(f"aenv-fork-{sid}-*.ram")]:
                        f.unlink(missing_ok=True)
        result["api_template"] = template
    if "fork16" in args.ops.split(",") and args.fork16_runs < args.runs:
        result["notes"].append(f"fork ×16 repeated {args.fork16_runs}× (not {args.runs}): each repetition starts "
                               "16 guests on 2 cores and takes ~10-20 s per side")
    load = monitor.stop()
    for phase, v in load.items():
        result["notes"].append(f"{phase} part: 1-min load average mean {v['load1_mean']}, max {v['load1_max']}; "
                               f"at most {v['other_qemu_max']} QEMU process(es) of other users running")
    summary = summarize(samples)
    rows = summary_rows(summary)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    result.update({"when": stamp, "summary": summary, "rows": rows, "samples": samples, "targets": TARGETS,
                   "overhead_target_ms": OVERHEAD_TARGET, "duration_s": round(time.monotonic() - t_start),
                   "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "kernel": platform.release(),
                            "loadavg_at_start": [round(x, 2) for x in load0],
                            "loadavg_at_end": [round(x, 2) for x in os.getloadavg()], "load_during": load}})
    out = write_results(result, stamp, ROOT / "var" / "bench-quick" if args.quick else ROOT / "bench" / "results")
    print(out.with_suffix(".md").read_text())
    print(f"wrote {out.relative_to(ROOT)} (+ .md)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
