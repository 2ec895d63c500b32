"""Benchmark: sandbox lifecycle operations, raw driver times (QemuDriver in this process) and
the same operations through the E2B API in the same run, so the control-plane overhead shows.

One guest shape (default 1 vCPU / 256 MiB); median of --runs. Its template snapshot is built
first if missing (vmm.templates.build, idempotent, in the shared images dir).

Networking (issue 10): every VM runs in a network slot of its own (vmm.net.netns, the QEMU
driver's default as root). The raw driver is a network instance of the benchmark's own
(--net-prefix / --net-pool, default aenvb / 10.15.0.0/20, set as AENV_NET_PREFIX / AENV_NET_POOL
before anything runs, the template build included), so neither a running node's slots nor a
test session's are touched; it is removed at the end of the raw part
(vmm.net.netns.remove_instance). The API part's stack is an instance inside it
(harness.stack: prefix aenvbs1, the next /20, 10.15.16.0/20), removed when the stack
stops.

Raw part: network slots (bench/net_slots.py in an instance of its own: making and destroying
one, a handover from a warm SlotPool; median and p90); create from the template snapshot →
envd answering on netns (and a few cold boots for comparison), with the network handover inside
it (NetnsBackend.attach, timed around the call: the driver's timings fold it into disk_ms); the
same creates on a restricted slirp driver (its own template snapshot: the fingerprint includes
the network backend) for the netns / slirp ratio; pause / resume in memory; pause to disk /
resume; filesystem-only pause / cold resume; snapshot (pause window and total) and a restore
from it; fork ×4 and ×16 (parent pause window; time from the fork call until every child, each
in its own slot, has answered a command at its slot address); host memory per forked child.

API part (--api auto starts a stack of its own with a Template row of the same shape; --api URL
uses a running one with --api-template): create from the template snapshot, pause (the API's
pause is to disk), connect (resumes: 201) and on a running sandbox (200), snapshot, create from
that snapshot id, fork ×4 / ×16 with every child answering a command through the data plane
(official SDK), host memory per forked child; a user port: a small HTTP server in the guest
(port 8080, HTTP/1.1 keep-alive, 3-byte answers), GETs through the data plane (E2b-Sandbox-Id /
E2b-Sandbox-Port headers) vs straight from this host to the sandbox's guest_host:8080 (the slot
address, from the stack's DB): latency p50 / p99 and requests/s, one client and
--http-clients at once (raw column = direct, API column = data plane). Each call is timed at the client and split with
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
(--quick: 2 repetitions, fewer slot runs, 1 HTTP run; written to var/bench-quick/ instead).
Needs root for the netns parts (without it the driver falls back to slirp and says so).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.lifecycle_common import OVERHEAD_TARGET, TARGETS, LoadMonitor, ensure_template_snapshot  # noqa: E402
from bench.lifecycle_report import ratios, summarize, summary_rows, write_results  # noqa: E402
from bench.lifecycle_api import Api  # noqa: E402
from bench.lifecycle_raw import NET_WARM, Raw  # noqa: E402
from vmm.images import DEFAULT_IMAGES_DIR  # noqa: E402

def start_stack(args):
    """A stack of its own (API, data plane, node worker, sweeper) with a Template row of the
    benchmark's shape; vCPU overcommit raised so fork ×16 (+ parent) fits a 2-core node
    (2 cores × 32 = 64 vCPUs of admission for 17 one-vCPU guests; memory: 17 × 256 MiB). Its
    network instance derives from this process's AENV_NET_PREFIX / AENV_NET_POOL (set in main):
    <prefix>s<N> on a /20 of the same /16 after the raw driver's, never a node's or a test's."""
    from harness.stack import Stack  # noqa: PLC0415

    stack = Stack(home=ROOT / "var" / "bench-runs" / uuid.uuid4().hex[:8],
                  extra_env={"AENV_NODE_VCPU_OVERCOMMIT": str(args.vcpu_overcommit),
                             "AENV_IMAGES_DIR": str(Path(args.images_dir).absolute())}).start()
    template = f"bench-c{args.cpu}m{args.memory}"
    stack.db("from sandboxes.models import Template\n"
             f"Template.objects.update_or_create(id={template!r}, defaults=dict(image={args.image!r}, "
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
    parser.add_argument("--slot-runs", type=int, default=50, help="network slots made / handed out")
    parser.add_argument("--http-requests", type=int, default=500, help="GETs per user-port run")
    parser.add_argument("--http-clients", type=int, default=8, help="concurrent clients of the user-port run")
    parser.add_argument("--http-runs", type=int, default=3, help="user-port runs (each: proxy and direct)")
    parser.add_argument("--net-prefix", default="aenvb", help="network instance of the raw driver")
    parser.add_argument("--net-pool", default="10.15.0.0/20",
                        help="its slot addresses (a /20; the API stack takes a later /20 of the same /16)")
    parser.add_argument("--ops", default="slots,create,slirp,pause,disk,fs,snapshot,fork4,fork16,userport",
                        help="operations to run (comma separated), raw and API alike (slots, slirp: raw only; "
                             "userport: API only)")
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
        if "raw_network" in result:  # today's row definitions and notes (older runs keep theirs: no slots yet)
            result["rows"] = summary_rows(result["summary"])
        print(write_results(result, result["when"], args.render.parent).with_suffix(".md").read_text())
        return 0
    if args.quick:
        args.runs, args.cold_runs, args.fs_runs, args.fork4_runs, args.fork16_runs = 2, 1, 1, 2, 1
        args.slot_runs, args.http_runs = 10, 1
    # Every driver this process makes (template builds included) is the bench's network
    # instance, never a running node's (its default prefix aenv) nor the tests' (aenvt).
    os.environ["AENV_NET_PREFIX"], os.environ["AENV_NET_POOL"] = args.net_prefix, args.net_pool

    t_start = time.monotonic()
    load0 = os.getloadavg()
    monitor = LoadMonitor().start()
    result: dict = {"benchmark": "lifecycle", "ops": args.ops, "quick": args.quick,
                    "shape": {"cpu": args.cpu, "memory_mb": args.memory, "disk_mb": args.disk},
                    "repetitions": {"runs": args.runs, "cold": args.cold_runs, "fs_only": args.fs_runs,
                                    "fork4": args.fork4_runs, "fork16": args.fork16_runs,
                                    "slots": args.slot_runs, "http_runs": args.http_runs,
                                    "http_requests": args.http_requests, "http_clients": args.http_clients},
                    "notes": []}
    result["template_snapshot_ready_s"] = ensure_template_snapshot(args)
    result["image"] = args.image
    samples: dict[str, list[float]] = {}
    if not args.no_raw:
        monitor.phase = "raw"
        raw = Raw(args)
        try:
            raw.run()
        finally:
            result["raw_network"] = raw.info
        samples.update(raw.samples)
        result["notes"] += raw.notes
        result["notes"].append(f"raw driver network: {raw.info['network']} (instance {args.net_prefix}, "
                               f"{args.net_pool}; {NET_WARM} warm slots like a node), removed at the end: "
                               f"{raw.info.get('removed_at_end')}")
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
                stack.shutdown()  # processes, VMs, its slots, nftables table and resolver
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
    result["ratios"] = ratios(summary)
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
