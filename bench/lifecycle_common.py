"""Shared pieces of the benchmarks (bench/lifecycle.py first): targets and why they were
missed, timing and memory helpers, the load monitor, how a run's result ends, the template
snapshot the runs restore from."""
from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import time
import uuid
from contextlib import contextmanager
from pathlib import Path


from vmm import templates
from vmm.images import ensure_image

ROOT = Path(__file__).resolve().parents[1]

# Targets from the issue (QEMU TCG, 2 host cores, 256 MiB guest), ms unless noted. They apply
# to the raw name and to its api.<name> twin.
TARGETS = {
    "pause": 15, "pause_to_disk": 40, "resume_from_disk": 350, "snapshot_pause_window": 100,
    "create_from_template": 400, "fork4_all_answering": 1000, "fork16_parent_pause": 100,
    "fork16_all_answering": 4000, "fork4_child_pss_mib": 60, "fork16_child_pss_mib": 60,
}
OVERHEAD_TARGET = 15  # ms of control plane per operation
MIB = 1 << 20
# the operations both halves (lifecycle_raw, lifecycle_api) run on one long-lived parent sandbox
PARENT_OPS = {"pause", "disk", "fs", "snapshot", "fork4", "fork16"}

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


def percentile(values, q: float) -> float:
    """The q-th percentile by nearest rank (an observed value: p99 of 500 is the 5th largest)."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))  # ceil(n * q / 100)
    return ordered[int(rank) - 1]


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


def finish_run(result: dict, load: dict, t_start: float, load0, **host_extra) -> None:
    """What every benchmark's result ends with: a note per phase on the host's load and on
    uncommitted files in the tree, the run's duration and the host (plus ``host_extra``)."""
    for phase, v in load.items():
        result["notes"].append(f"{phase} part: 1-min load average mean {v['load1_mean']}, max {v['load1_max']}; "
                               f"at most {v['other_qemu_max']} QEMU process(es) of other users running")
    if result["git"]["uncommitted"]:
        result["notes"].append("tracked files edited but not committed in the tree at the time (others' work in "
                               f"progress, run as is): {', '.join(result['git']['uncommitted'])}")
    result.update(duration_s=round(time.monotonic() - t_start),
                  host={"machine": platform.machine(), "cpus": os.cpu_count(), "kernel": platform.release(),
                        **host_extra, "loadavg_at_start": [round(x, 2) for x in load0],
                        "loadavg_at_end": [round(x, 2) for x in os.getloadavg()], "load_during": load})


@contextmanager
def own_stack(name: str, result: dict, **kwargs):
    """A started harness Stack (``kwargs`` go to it) under var/bench-runs/<name>-<id> for the
    block; after it a note in ``result`` if QEMU processes outlived the block's kills, then the
    stack stopped and its home removed."""
    from harness.stack import Stack  # noqa: PLC0415

    stack = Stack(home=ROOT / "var" / "bench-runs" / f"{name}-{uuid.uuid4().hex[:6]}", **kwargs)
    try:
        stack.start()
        yield stack
        left = stack.vm_leftovers()
        if left["processes"]:
            result["notes"].append(f"QEMU processes left after every sandbox was killed: {left}")
    finally:
        stack.shutdown()
        shutil.rmtree(stack.home, ignore_errors=True)


def parse_stack_args(parser, net_prefix: str, net_pool: str):
    """The parser's arguments plus what every benchmark with a stack of its own takes: its
    network instance (set in the environment, where the stack's processes read it; the stack
    takes the next /20 of the pool's /16) and where its results go."""
    parser.add_argument("--net-prefix", default=net_prefix)
    parser.add_argument("--net-pool", default=net_pool, help="the stack takes the next /20 of its /16")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    os.environ["AENV_NET_PREFIX"], os.environ["AENV_NET_POOL"] = args.net_prefix, args.net_pool
    return args


def write_results(out_dir: Path, name: str, result: dict, markdown: str) -> Path:
    """``<out_dir>/<name>-<result's when>.json`` and its ``.md``; the table printed too."""
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{name}-{result['when']}.json"
    out.write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(markdown)
    print(markdown)
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out} (+ .md)")
    return out


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
    """Builds the image and the template snapshot of the benchmark's shape if missing; seconds
    the snapshot took. Pins the image build for the whole run: ``args.image`` becomes the
    build's own directory name (``base-<recipe hash>``, which find_image takes like ``base``),
    so a ``base`` link moved meanwhile by another build in the shared images dir (someone
    editing the guest tools) does not turn the run's creates into cold boots."""
    images_dir = Path(args.images_dir).absolute()
    image = ensure_image(images_dir, "base", progress=lambda m: None)
    args.image = f"{image.name}-{image.recipe_hash}"
    t0 = time.monotonic()
    templates.build(images_dir, args.image, args.cpu, args.memory, args.disk, progress=print)
    return round(time.monotonic() - t0, 1)
