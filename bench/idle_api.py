"""Benchmark: idle density through the API (issue 26's idle row as users reach it).

``bench/idle.py --density`` starts its sandboxes with the driver alone. Here a stack of this
script's own (API, data plane, one node worker with real VMs, sweeper; the node's metrics
sampler included) is told the overcommit a dense node needs, and ``--count`` sandboxes of
``base`` are created one after the other through ``POST /sandboxes``, as an SDK does, stopping
early when a create is refused or slower than ``--max-create`` s, or the host's MemAvailable
would fall under ``--min-free`` MiB. They settle, one window measures every guest's QEMU CPU
(all threads, ``/proc/<pid>/task/*/schedstat``) and the host's, then ``--creates`` more creates
(each killed again) are timed while they all idle: the target is ≥ 150 idle and a create
≤ 2 s p50 on a 2-core / 24 GiB node.

Results: a table and JSON in bench/results/ (``idle-api-<stamp>.{md,json}``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cluster_host import cpu_window  # noqa: E402
from bench.idle import MIB, process_memory, qemu_delta, summary, thread_times  # noqa: E402
from bench.lifecycle_common import (LoadMonitor, finish_run, mem_available, own_stack, parse_stack_args,  # noqa: E402
                                    percentile, write_results)
from bench.templates import git_state  # noqa: E402


class Api:
    """The few REST calls this needs, with the stack's key."""

    def __init__(self, stack, timeout: float):
        import httpx  # noqa: PLC0415

        self.stack = stack
        self.client = httpx.Client(base_url=stack.api_url, headers={"X-API-Key": stack.api_key}, timeout=timeout)

    def create(self, template: str) -> tuple[int, dict, float]:
        t0 = time.monotonic()
        resp = self.client.post("/sandboxes", json={"templateID": template, "timeout": 3600})
        ms = (time.monotonic() - t0) * 1e3
        body = resp.json() if resp.headers.get("content-type", "").startswith("application/json") else {}
        return resp.status_code, body, ms

    def kill(self, sandbox_id: str) -> None:
        self.client.delete(f"/sandboxes/{sandbox_id}")

    def pid_of(self, sandbox_id: str) -> int | None:
        pids = self.stack.qemu_pids(sandbox_id)
        return pids[0] if pids else None


def start_many(api: Api, args) -> tuple[list[tuple[str, int]], list[int], str]:
    """(sandbox id, QEMU pid) of each started, the creates' ms, and why it stopped."""
    started, create_ms = [], []
    for i in range(args.count):
        if mem_available() < args.min_free * MIB:
            return started, create_ms, f"MemAvailable under {args.min_free} MiB"
        status, body, ms = api.create(args.template)
        if status != 201:
            return started, create_ms, f"create {i}: {status} {json.dumps(body)[:200]}"
        pid = api.pid_of(body["sandboxID"])
        if pid is None:
            return started, create_ms, f"create {i}: no QEMU process found for {body['sandboxID']}"
        started.append((body["sandboxID"], pid))
        create_ms.append(round(ms))
        if i % 10 == 0:
            print(f"{len(started)} running, last create {ms:.0f} ms, load {os.getloadavg()[0]:.1f}, "
                  f"MemAvailable {mem_available() // MIB} MiB", flush=True)
        if ms > args.max_create * 1e3:
            return started, create_ms, f"a create took {ms / 1e3:.1f} s (> {args.max_create} s)"
    return started, create_ms, "the target"


def run(args, stack, monitor: LoadMonitor) -> dict:
    api = Api(stack, timeout=max(60.0, args.max_create * 4))
    # The first creates warm what the node keeps ready (the template's snapshot, a ready-made RAM copy): not counted.
    monitor.phase = "warm-up"
    for _ in range(2):
        status, body, ms = api.create(args.template)
        if status != 201:
            raise RuntimeError(f"warm-up create: {status} {body}")
        print(f"warm-up create {ms:.0f} ms", flush=True)
        api.kill(body["sandboxID"])
        time.sleep(2.0)
    avail0 = mem_available()
    monitor.phase = "start"
    started, start_ms, stopped_by = start_many(api, args)
    avail1 = mem_available()
    monitor.phase = "settle"
    time.sleep(args.settle)
    alive = [(sid, pid) for sid, pid in started if Path(f"/proc/{pid}").exists()]
    memory = [process_memory(pid) for _, pid in alive]
    avail_settled = mem_available()
    monitor.phase = "window"
    before = {pid: thread_times(pid) for _, pid in alive}
    t0 = time.monotonic()
    host = cpu_window(args.window, [])
    seconds = time.monotonic() - t0
    per = [qemu_delta(before[pid], thread_times(pid), seconds, pid)["cpu_pct"] for _, pid in alive]
    monitor.phase = "creates"
    creates, refused = [], []
    for _ in range(args.creates):
        status, body, ms = api.create(args.template)
        if status == 201:
            creates.append(round(ms))
            api.kill(body["sandboxID"])
        else:
            refused.append(f"{status} {json.dumps(body)[:160]}")
        time.sleep(1.0)
    load1 = round(os.getloadavg()[0], 2)
    monitor.phase = "kill"
    for sid, _ in started:
        api.kill(sid)
    return {"requested": args.count, "running": len(started), "alive_in_window": len(alive),
            "stopped_by": stopped_by, "start_create_ms": start_ms,
            "start_create_p50_ms": round(statistics.median(start_ms)) if start_ms else None,
            "memavailable_drop_per_sandbox_mib": round((avail0 - avail1) / max(1, len(started)) / MIB, 1),
            "memavailable_drop_per_sandbox_settled_mib":
                round((avail0 - avail_settled) / max(1, len(started)) / MIB, 1),
            "memavailable_left_mib": round(avail_settled / MIB),
            "qemu_memory_mib": {k: summary([m[k] for m in memory if k in m])
                                for k in ("rss_mib", "pss_mib", "anon_mib", "pss_shmem_mib")},
            "window_s": round(seconds, 1), "host_busy_pct": host["host_busy_pct"],
            "per_sandbox_cpu_pct": summary(per), "cpu_pct_all_sandboxes": round(sum(per), 1),
            "creates_while_idle_ms": creates, "creates_refused": refused, "load1_after_creates": load1,
            "creates_p50_ms": round(statistics.median(creates)) if creates else None,
            "creates_p90_ms": round(percentile(creates, 90)) if creates else None}


def markdown(result: dict) -> str:
    d, s = result["density"], result["settings"]
    cpu = d["per_sandbox_cpu_pct"]
    mem = d["qemu_memory_mib"]
    return "\n".join([
        f"# idle density through the API {result['when']}", "",
        f"settings: {', '.join(f'{k}={v}' for k, v in s.items())}", "",
        "| running (stopped by) | CPU per sandbox median / all, % of a core | host busy % | QEMU RSS / PSS p50, MiB "
        "| MemAvailable drop per sandbox, MiB (settled) | left, MiB | create p50 while starting, ms "
        "| create p50 / p90 while they idle, ms | refused |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {d['running']} ({d['stopped_by']}) | {cpu.get('median')} / {d['cpu_pct_all_sandboxes']} | "
        f"{d['host_busy_pct']} | {mem['rss_mib'].get('median')} / {mem['pss_mib'].get('median')} | "
        f"{d['memavailable_drop_per_sandbox_mib']} ({d['memavailable_drop_per_sandbox_settled_mib']}) | "
        f"{d['memavailable_left_mib']} | {d['start_create_p50_ms']} | {d['creates_p50_ms']} / {d['creates_p90_ms']} | "
        f"{len(d['creates_refused'])} |", "",
        *[f"- {n}" for n in result["notes"]], ""])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--count", type=int, default=150, help="idle sandboxes to start through the API")
    p.add_argument("--template", default="base")
    p.add_argument("--template-ram", choices=("copy", "shared"), default="shared",
                   help="the node's AENV_TEMPLATE_RAM")
    p.add_argument("--vcpu-overcommit", type=float, default=150, help="the node's AENV_NODE_VCPU_OVERCOMMIT")
    p.add_argument("--memory-overcommit", type=float, default=3.2, help="the node's AENV_NODE_MEMORY_OVERCOMMIT")
    p.add_argument("--settle", type=float, default=40.0)
    p.add_argument("--window", type=float, default=60.0)
    p.add_argument("--creates", type=int, default=5)
    p.add_argument("--max-create", type=float, default=30.0)
    p.add_argument("--min-free", type=int, default=2048, help="MiB of MemAvailable to leave")
    args = parse_stack_args(p, "aenvd", "10.29.0.0/20")

    settings = {"AENV_TEMPLATE_RAM": args.template_ram,
                "AENV_NODE_VCPU_OVERCOMMIT": f"{args.vcpu_overcommit:g}",
                "AENV_NODE_MEMORY_OVERCOMMIT": f"{args.memory_overcommit:g}"}
    t_start, load0 = time.monotonic(), os.getloadavg()
    monitor = LoadMonitor().start()
    result = {"benchmark": "idle-api", "git": git_state(), "settings": settings, "notes": []}
    with own_stack("idle-api", result, extra_env=settings) as stack:
        result["density"] = run(args, stack, monitor)
    result["when"] = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    result["notes"].append("the node's metrics sampler runs (as on any node); sandboxes of the template's shape "
                           "(base: 2 vCPU / 512 MiB), created one after the other")
    finish_run(result, monitor.stop(), t_start, load0)
    write_results(args.out, "idle-api", result, markdown(result))
    d = result["density"]
    return 0 if d["running"] >= args.count and d["creates_p50_ms"] is not None else 1


if __name__ == "__main__":
    raise SystemExit(main())
