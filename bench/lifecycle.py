"""Benchmark: sandbox lifecycle operations, raw driver times (QemuDriver in this process) and,
optionally, the same operations through the E2B API so the control-plane overhead shows.

Raw part (one guest shape, default 1 vCPU / 256 MiB; median of --runs):
  create from the template snapshot → envd answering, and a few cold boots for comparison;
  pause / resume in memory; pause to disk / resume; filesystem-only pause / cold resume;
  snapshot (pause window and total); fork ×4 and ×16 (parent pause window; time from the
  fork call until every child has answered a command); host memory per forked child.

API part (--api URL, or --api auto to start a stack of its own): pause (memory and
filesystem-only), connect (resumes: 201) and connect on a running sandbox (200), each timed
at the client and split with the API's Server-Timing header (node = raw driver time measured
in the same request; ratio = client / node). Create/snapshot/fork through the API are not
timed here yet.

Host memory per forked child: after every child has answered, /proc/<pid>/smaps_rollup of each
child QEMU. PSS divides each shared page (the fork capture's RAM file on tmpfs, QEMU's binary and
libraries) evenly among the processes mapping it, so the mean child PSS is a child's fair share;
Pss_Anon is what it owns alone (guest pages it changed, copy-on-write, plus QEMU's own heap and
TCG translation buffers). The MemAvailable drop per child is a second, noisier view (other load
on the host moves it; it also includes the capture file and page tables).

    .venv/bin/python bench/lifecycle.py [--runs 10] [--memory 256] [--cpu 1] [--ops create,fork4] [--api auto]
Writes the table to stdout and JSON + markdown to bench/results/lifecycle-<UTC stamp>.{json,md}.
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

from vmm import template_snapshots  # noqa: E402
from vmm.driver import BootSpec  # noqa: E402
from vmm.images import DEFAULT_IMAGES_DIR, ensure_image  # noqa: E402
from vmm.qemu import QemuDriver, envd_healthy  # noqa: E402

# Targets from the issue (QEMU TCG, 2 host cores, 256 MiB guest), ms unless noted.
TARGETS = {
    "pause": 15, "pause_to_disk": 40, "resume_from_disk": 350, "snapshot_pause_window": 100,
    "create_from_template": 400, "fork4_all_answering": 1000, "fork16_parent_pause": 100,
    "fork16_all_answering": 4000, "fork_child_host_mib": 60,
}
MIB = 1 << 20


def ms(t0: float, t1: float) -> float:
    return (t1 - t0) * 1e3


def run_cmd(url: str, cmd: str = "echo ok") -> str:
    """One command through envd with the official SDK (debug mode: straight to envd)."""
    from e2b import Sandbox  # noqa: PLC0415
    from e2b.connection_config import ConnectionConfig  # noqa: PLC0415
    from packaging.version import Version  # noqa: PLC0415

    cfg = ConnectionConfig(debug=True, sandbox_url=url,
                           extra_sandbox_headers={"E2b-Sandbox-Id": "bench", "E2b-Sandbox-Port": "49983"})
    sbx = Sandbox(sandbox_id="bench", sandbox_domain=None, envd_version=Version("0.6.4"),
                  envd_access_token=None, traffic_access_token=None, connection_config=cfg)
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


class Raw:
    """The driver half: every number is wall time around one driver call (plus what the call
    itself reports in its timings)."""

    def __init__(self, args):
        self.args = args
        self.images_dir = Path(args.images_dir).absolute()
        self.home = (ROOT / "var" / "bench-runs" / f"lifecycle-{uuid.uuid4().hex[:8]}").absolute()
        self.driver = QemuDriver(home=self.home, images_dir=self.images_dir, boot_timeout=120)
        self.samples: dict[str, list[float]] = {}
        self.extra: dict = {}
        self.n = 0

    def add(self, name: str, value: float) -> None:
        self.samples.setdefault(name, []).append(value)

    def sid(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}-{self.n}"

    def spec(self, sid: str) -> BootSpec:
        return BootSpec(sid, cpu_count=self.args.cpu, memory_mb=self.args.memory, disk_size_mb=self.args.disk)

    def run(self) -> None:
        a = self.args
        ensure_image(self.images_dir, "base", progress=lambda m: None)
        t0 = time.monotonic()
        template_snapshots.build(self.images_dir, "base", a.cpu, a.memory, a.disk, progress=print)
        self.extra["template_snapshot_ready_s"] = round(time.monotonic() - t0, 1)
        ops = set(a.ops.split(","))
        try:
            if "create" in ops:
                self.creates()
            if ops - {"create"}:
                parent = self.driver.boot(self.spec("parent"))
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
            info = self.driver.boot(self.spec(sid))
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
        cold = QemuDriver(home=self.home, images_dir=self.images_dir, boot_timeout=120, template_snapshots=False)
        for _ in range(self.args.cold_runs):
            sid = self.sid("cold")
            t0 = time.perf_counter()
            info = cold.boot(self.spec(sid))
            self.add("create_cold_boot", ms(t0, time.perf_counter()))
            assert info.timings.get("from_template_snapshot") == 0
            cold.kill(sid)

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
        for i in range(self.args.runs):
            dest = self.home / "snapshots" / f"s{i}"
            t0 = time.perf_counter()
            m = self.driver.snapshot(sid, dest)
            self.add("snapshot_total", ms(t0, time.perf_counter()))
            self.add("snapshot_pause_window", m.timings["pause_ms"])
            self.add("snapshot.memory_copy", m.timings["memory_copy_ms"])
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
        # Memory: PSS splits every shared page (the capture's RAM file in tmpfs, the QEMU binary
        # and libraries) evenly between the processes mapping it, so mean child PSS is each
        # child's fair share of host memory; Pss_Anon is what it owns alone (copy-on-write
        # guest pages + QEMU's own heap and TCG buffers). The MemAvailable drop per child is
        # a second, noisier view that also includes the capture file and page tables.
        time.sleep(1.0)
        rollups = [smaps_rollup(k.pid) for k in kids]
        avail1 = mem_available()
        self.add(f"fork{count}_child_pss_mib", statistics.mean(r.get("Pss", 0) for r in rollups) / 1024)
        self.add(f"fork{count}_child_rss_mib", statistics.mean(r.get("Rss", 0) for r in rollups) / 1024)
        self.add(f"fork{count}_child_pss_anon_mib", statistics.mean(r.get("Pss_Anon", 0) for r in rollups) / 1024)
        self.add(f"fork{count}_memavailable_drop_per_child_mib", (avail0 - avail1) / count / MIB)
        for k in kids:
            self.driver.kill(k.sandbox_id)
        assert envd_healthy("127.0.0.1", self.driver.info(sid).envd_port)


class Api:
    """The control-plane half: the same verbs through the E2B API, split by Server-Timing."""

    def __init__(self, api: str, key: str, runs: int):
        self.api, self.key, self.runs = api.rstrip("/"), key, runs
        self.samples: dict[str, list[float]] = {}

    def add(self, name: str, value: float) -> None:
        self.samples.setdefault(name, []).append(value)

    def timed(self, client, name: str, method: str, path: str, expect: int, **kw):
        from bench.create_kill import parse_server_timing  # noqa: PLC0415

        t0 = time.perf_counter()
        resp = client.request(method, f"{self.api}{path}", headers={"X-API-Key": self.key}, timeout=300, **kw)
        wall = ms(t0, time.perf_counter())
        if resp.status_code != expect:
            raise RuntimeError(f"{method} {path}: {resp.status_code} {resp.text[:300]}")
        phases = parse_server_timing(resp.headers.get("server-timing", ""))
        self.add(f"api.{name}", wall)
        if "node" in phases:
            self.add(f"api.{name}.node", phases["node"])
            self.add(f"api.{name}.overhead", wall - phases["node"])
            self.add(f"api.{name}.ratio", wall / phases["node"] if phases["node"] else 0.0)
        return resp

    def run(self) -> None:
        import httpx  # noqa: PLC0415

        with httpx.Client() as client:
            resp = client.post(f"{self.api}/v2/sandboxes", headers={"X-API-Key": self.key}, timeout=300,
                               json={"templateID": "base", "timeout": 3600, "metadata": {"bench": "lifecycle"}})
            resp.raise_for_status()
            sid = resp.json()["sandboxID"]
            try:
                for _ in range(self.runs):
                    self.timed(client, "pause", "POST", f"/sandboxes/{sid}/pause", 204, json={})
                    self.timed(client, "connect_resume", "POST", f"/sandboxes/{sid}/connect", 201,
                               json={"timeout": 3600})
                    self.timed(client, "connect_running", "POST", f"/sandboxes/{sid}/connect", 200,
                               json={"timeout": 3600})
                for _ in range(max(1, self.runs // 3)):
                    self.timed(client, "pause_fs_only", "POST", f"/sandboxes/{sid}/pause", 204,
                               json={"memory": False})
                    self.timed(client, "connect_resume_fs_only", "POST", f"/sandboxes/{sid}/connect", 201,
                               json={"timeout": 3600})
            finally:
                client.delete(f"{self.api}/sandboxes/{sid}", headers={"X-API-Key": self.key}, timeout=120)


def summarize(samples: dict[str, list[float]]) -> dict:
    return {k: {"median": round(statistics.median(v), 2), "min": round(min(v), 2), "max": round(max(v), 2),
                "n": len(v)} for k, v in samples.items()}


def table(summary: dict) -> list[str]:
    """Markdown table: one row per measured quantity, with the issue's target where it has one."""
    lines = ["| operation | median | min | max | n | unit | target |", "|---|---:|---:|---:|---:|---|---|"]
    for name, s in summary.items():
        target = TARGETS.get(name)
        verdict = "" if target is None else f"≤ {target} {'ok' if s['median'] <= target else '**missed**'}"
        unit = "MiB" if name.endswith("_mib") else ("×" if name.endswith(".ratio") else "ms")
        lines.append(f"| {name} | {s['median']:.1f} | {s['min']:.1f} | {s['max']:.1f} | {s['n']} | {unit} | {verdict} |")
    return lines


def write_results(result: dict, stamp: str) -> Path:
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"lifecycle-{stamp}.json"
    out.write_text(json.dumps(result, indent=2))
    head = (f"# lifecycle benchmark {stamp}\n\nshape {result.get('shape')}, ops {result.get('ops')}, "
            f"host {result.get('host')}\n\n")
    out.with_suffix(".md").write_text(head + "\n".join(table(result["summary"])) + "\n")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--cold-runs", type=int, default=3, help="cold boots for comparison (slow)")
    parser.add_argument("--fs-runs", type=int, default=3, help="filesystem-only pause + cold-boot resume (slow)")
    parser.add_argument("--fork4-runs", type=int, default=10)
    parser.add_argument("--fork16-runs", type=int, default=10)
    parser.add_argument("--cpu", type=int, default=1)
    parser.add_argument("--memory", type=int, default=256)
    parser.add_argument("--disk", type=int, default=2048)
    parser.add_argument("--images-dir", default=os.environ.get("AENV_IMAGES_DIR", str(DEFAULT_IMAGES_DIR)))
    parser.add_argument("--ops", default="create,pause,disk,fs,snapshot,fork4,fork16",
                        help="raw operations to run (comma separated)")
    parser.add_argument("--no-raw", action="store_true", help="only the API part")
    parser.add_argument("--api", default="", help="API base URL, or 'auto' to start a stack of its own")
    parser.add_argument("--api-key", default=os.environ.get("E2B_API_KEY", ""))
    parser.add_argument("--render", type=Path, help="only re-render an earlier JSON result as markdown")
    args = parser.parse_args()
    if args.render:
        result = json.loads(args.render.read_text())
        print(write_results(result, result["when"]).with_suffix(".md").read_text())
        return 0

    result: dict = {"benchmark": "lifecycle", "ops": args.ops, "shape": {"cpu": args.cpu, "memory_mb": args.memory,
                                                        "disk_mb": args.disk}}
    samples: dict[str, list[float]] = {}
    if not args.no_raw:
        raw = Raw(args)
        raw.run()
        samples.update(raw.samples)
        result["raw_extra"] = raw.extra
    if args.api:
        stack = None
        api, key = args.api, args.api_key
        if api == "auto":
            from tests.integration.stack import Stack  # noqa: PLC0415

            stack = Stack(home=ROOT / "var" / "bench-runs" / uuid.uuid4().hex[:8]).start()
            api, key = stack.api_url, stack.api_key
        try:
            a = Api(api, key, args.runs)
            a.run()
            samples.update(a.samples)
        finally:
            if stack:
                stack.stop()
                stack.kill_vm_leftovers()
                shutil.rmtree(stack.home, ignore_errors=True)
        result["api_note"] = ("API sandboxes use the 'base' template's shape (2 vCPU, 512 MiB), not --cpu/--memory. "
                              "pause_fs_only sends memory:false; until nodes.tasks.pause_sandbox takes `memory`, "
                              "the lifecycle service pauses with memory instead (recorded in the pause event).")
    summary = summarize(samples)
    print("\n".join(table(summary)))
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    result.update({"when": stamp, "summary": summary, "samples": samples, "targets": TARGETS,
                   "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "kernel": platform.release(),
                            "loadavg_at_end": os.getloadavg()}})
    out = write_results(result, stamp)
    print(f"wrote {out.relative_to(ROOT)} (+ .md)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
