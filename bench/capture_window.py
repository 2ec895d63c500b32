"""Benchmark: the parent's vCPU stop during a snapshot and a fork (issue 26), the old capture
(stop-and-copy: the RAM file copied with the vCPUs stopped) against the live ones
(vmm.qemu.live_capture: background-snapshot; pre-copy where the driver takes it), in one run, for a 256 MiB and a 2 GiB
guest.

Each guest is booted cold (1 vCPU), fills part of its memory (a file of a repeating
non-zero pattern in a tmpfs of its own: --fill-256 / --fill-2048 MiB) and runs two things while it is
captured: a memory writer (a 32 MiB buffer, one byte per page rewritten ~--dirty-mbps MiB/s)
and a ticker that writes one byte to its serial port every millisecond. The stop is measured
three ways:

- QEMU: from its STOP event to its RESUME event (timestamps in the events; ``pause_ms``),
- the driver's own clock around its stop and cont (``pause_wall_ms``),
- the guest: the longest time this host saw no new byte of the ticker in the console file,
  within the capture, against the same longest gap in an equally long stretch just before
  (``guest_gap_ms`` / ``guest_gap_baseline_ms``). Under TCG the guest's own clock stands
  still while it is stopped (its TSC is QEMU's virtual clock), so the guest cannot time the
  gap itself; the host times the ticker's output. Resolution ~1-2 ms plus the host's polling.

Besides: the whole call (snapshot: until the manifest; fork: until the child answered),
the RAM the parent's file holds before and after (a live capture reads every page, and on
tmpfs a read of a hole allocates it), and for the fork the child's restore.

    flock /tmp/aenv-vm.lock .venv/bin/python bench/capture_window.py [--sizes 256,2048]
        [--modes stop-copy,background] [--runs 3] [--runs-large N] [--quick] [--probe]

--probe only prints what this host's kernel and QEMU allow (vmm.qemu.uffd, QEMU's
background-snapshot capability with aenv's memory backend) and exits.
Writes the table to stdout and JSON + markdown to bench/results/capture_window-<UTC stamp>.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("AENV_NET_PREFIX", "aenvcw")  # a network instance of its own
os.environ.setdefault("AENV_NET_POOL", "10.15.64.0/20")

from vmm.driver import BootSpec, get_driver  # noqa: E402
from vmm.images import DEFAULT_IMAGES_DIR  # noqa: E402
from vmm.qemu import uffd  # noqa: E402
from vmm.qemu.qmp import QMP, QMPError  # noqa: E402

TICKER = """\
import os, time
fd = os.open('/dev/ttyS0', os.O_WRONLY | os.O_NOCTTY)
while True:
    os.write(fd, b'.')
    time.sleep(0.001)
"""

DIRTIER = """\
import sys, time
mbps = float(sys.argv[1])
buf = bytearray(32 << 20)
pages = len(buf) // 4096
i = n = 0
t0 = time.monotonic()
while True:
    buf[(i % pages) * 4096] = (n & 0xff) | 1
    i += 1
    if i % pages == 0:
        n += 1
    if mbps > 0 and i % 64 == 0:  # 64 pages = 256 KiB
        ahead = i * 4096 / (mbps * 2**20) - (time.monotonic() - t0)
        if ahead > 0:
            time.sleep(ahead)
"""


def sh(info, cmd: str, timeout: float = 600) -> str:
    """One command as root through the VM's envd (the official SDK in debug mode, straight to
    the VM's endpoint)."""
    from e2b import Sandbox
    from e2b.connection_config import ConnectionConfig
    from packaging.version import Version

    cfg = ConnectionConfig(debug=True, sandbox_url=f"http://{info.envd_host}:{info.envd_port}",
                           request_timeout=timeout)
    sbx = Sandbox(sandbox_id="bench", sandbox_domain=None, envd_version=Version("0.6.4"), envd_access_token=None,
                  traffic_access_token=None, connection_config=cfg)
    return sbx.commands.run(cmd, user="root", timeout=timeout).stdout


class ConsoleWatch:
    """Polls a console file's size in a thread; the times its size grew, for gap queries."""

    def __init__(self, path: Path, period: float = 0.0002):
        self.path, self.period = path, period
        self.times: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = -1
        while not self._stop.is_set():
            try:
                size = os.stat(self.path).st_size
            except OSError:
                size = last
            if size != last:
                self.times.append(time.monotonic())
                last = size
            time.sleep(self.period)

    def max_gap(self, t0: float, t1: float) -> float:
        """Longest stretch in [t0, t1] without growth (ms), the edges counted from t0 / to t1."""
        pts = [t0] + [t for t in self.times if t0 <= t <= t1] + [t1]
        return max(b - a for a, b in zip(pts, pts[1:])) * 1e3

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def probe(shm_dir: Path = Path("/dev/shm")) -> dict:
    """The kernel's userfaultfd (per backend) and QEMU's answer to background-snapshot on a
    machine with aenv's memory backend (a share=on file in shm_dir), with x-ignore-shared on
    (aenv's normal setting: the RAM block is skipped, so nothing would be captured) and off."""
    out = uffd.probe_all(shm_dir)
    qemu = {"version": subprocess.run(["qemu-system-x86_64", "--version"], capture_output=True,
                                      text=True).stdout.splitlines()[0]}
    work = Path(tempfile.mkdtemp(prefix="aenv-cw-probe-"))
    ram = shm_dir / f"aenv-cw-probe-{os.getpid()}.ram"
    sock = work / "qmp.sock"
    proc = subprocess.Popen(["qemu-system-x86_64", "-M", "microvm,memory-backend=ram0", "-accel", "tcg",
                             "-m", "64M", "-object", f"memory-backend-file,id=ram0,size=64M,mem-path={ram},share=on",
                             "-nodefaults", "-display", "none", "-qmp", f"unix:{sock},server=on,wait=off", "-S"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 10
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        with QMP(sock) as q:
            for ignore in (True, False):
                q.execute("migrate-set-capabilities", capabilities=[{"capability": "x-ignore-shared", "state": ignore}])
                key = f"background_snapshot_x_ignore_shared_{'on' if ignore else 'off'}"
                try:
                    q.execute("migrate-set-capabilities",
                              capabilities=[{"capability": "background-snapshot", "state": True}])
                    qemu[key] = "accepted"
                    q.execute("migrate-set-capabilities",
                              capabilities=[{"capability": "background-snapshot", "state": False}])
                except QMPError as e:
                    qemu[key] = f"refused: {e}"
            q.execute("quit")
    finally:
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
        ram.unlink(missing_ok=True)
        shutil.rmtree(work, ignore_errors=True)
    out["qemu"] = qemu
    return out


def allocated_mb(path: str) -> float:
    try:
        return os.stat(path).st_blocks * 512 / 2**20
    except OSError:
        return float("nan")


class Bench:
    def __init__(self, args):
        self.args = args
        self.home = Path(tempfile.mkdtemp(prefix="aenv-capture-window-", dir=args.home_dir))
        self.driver = get_driver("qemu", self.home / "home", Path(args.images_dir))
        self.rows: list[dict] = []

    def guest(self, size: int):
        sid = f"cw{size}-{os.getpid() % 10000}"
        t0 = time.monotonic()
        info = self.driver.boot(BootSpec(sid, cpu_count=1, memory_mb=size))
        fill = self.args.fill_256 if size <= 256 else self.args.fill_2048
        sh(info, f"cat > /root/tick.py <<'EOF'\n{TICKER}EOF\ncat > /root/dirty.py <<'EOF'\n{DIRTIER}EOF\n"
                 f"mkdir -p /mnt/cw && mount -t tmpfs -o size={fill + 16}M cw /mnt/cw && "
                 f"yes 0123456789abcdef | head -c {fill}M > /mnt/cw/fill")
        sh(info, "setsid nohup python3 /root/tick.py >/dev/null 2>&1 </dev/null &")
        sh(info, f"setsid nohup python3 /root/dirty.py {self.args.dirty_mbps} >/dev/null 2>&1 </dev/null &")
        deadline = time.monotonic() + 30
        console = self.driver.console_path(sid)
        size0 = console.stat().st_size
        while console.stat().st_size == size0:  # the ticker runs
            if time.monotonic() > deadline:
                raise RuntimeError("the guest's ticker writes nothing to its console")
            time.sleep(0.1)
        print(f"guest {size} MiB up and filled ({fill} MiB) in {time.monotonic() - t0:.1f} s", flush=True)
        return sid, info

    def capture(self, sid: str, size: int, mode: str, verb: str, run: int) -> dict:
        d = self.driver
        d.capture_mode = mode
        state_ram = d._load(sid).ram
        console = d.console_path(sid)
        watch = ConsoleWatch(console)
        try:
            time.sleep(1.0)  # the baseline stretch
            t_base = time.monotonic()
            time.sleep(1.0)
            alloc_before = allocated_mb(state_ram)
            t0 = time.monotonic()
            child = None
            if verb == "snapshot":
                m = d.snapshot(sid, self.home / "snaps" / f"{size}-{mode}-{run}")
                timings = dict(m.timings)
                t1 = time.monotonic()
                shutil.rmtree(m.dir, ignore_errors=True)
            else:
                res = d.fork(sid, 1)
                t1 = time.monotonic()
                child = res[0]
                if isinstance(child, Exception):
                    raise child
                timings = {k[len("capture."):]: v for k, v in child.timings.items() if k.startswith("capture.")}
                timings["child_restore_ms"] = child.timings.get("total_ms", float("nan"))
                timings["fork_capture_ms"] = child.timings.get("fork_capture_ms", float("nan"))
            t_after = time.monotonic()
            time.sleep(0.3)
            gap = watch.max_gap(t0, t1)
            base = watch.max_gap(t_base, t0)
        finally:
            watch.close()
        if child is not None:
            sh(child, "cat /mnt/cw/fill | md5sum >/dev/null && echo ok")  # the child answers
            d.kill(child.sandbox_id)
        row = {"size_mb": size, "mode": mode, "verb": verb, "run": run,
               "pause_ms": round(timings.get("pause_ms", float("nan")), 2),
               "pause_wall_ms": round(timings.get("pause_wall_ms", float("nan")), 2),
               "guest_gap_ms": round(gap, 2), "guest_gap_baseline_ms": round(base, 2),
               "call_ms": round((t_after - t0) * 1e3, 1),
               "parent_ram_mb_before": round(alloc_before, 1), "parent_ram_mb_after": round(allocated_mb(state_ram), 1),
               "timings": {k: round(v, 2) for k, v in timings.items()}}
        print(f"{size:>5} MiB {verb:8} {mode:10} run {run}: vCPUs stopped {row['pause_ms']:7.1f} ms "
              f"(driver {row['pause_wall_ms']:.1f}, guest gap {gap:.1f} vs {base:.1f} before), "
              f"call {row['call_ms']:.0f} ms, parent RAM {row['parent_ram_mb_before']:.0f} -> "
              f"{row['parent_ram_mb_after']:.0f} MiB", flush=True)
        return row

    def run(self) -> None:
        for size in self.args.sizes:
            sid, info = self.guest(size)
            try:
                for run in range(self.args.runs if size <= 256 else self.args.runs_large):
                    for verb in ("snapshot", "fork"):
                        for mode in self.args.modes:  # in turns: the host's load moves all alike
                            self.rows.append(self.capture(sid, size, mode, verb, run))
            finally:
                self.driver.kill(sid)

    def close(self) -> None:
        for vm in self.driver.list():
            self.driver.kill(vm.sandbox_id)
        if self.driver.net.name == "netns":
            from vmm.net.netns import remove_instance

            remove_instance(os.environ["AENV_NET_PREFIX"], os.environ["AENV_NET_POOL"], self.home)
        shutil.rmtree(self.home, ignore_errors=True)


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    keys = sorted({(r["size_mb"], r["verb"], r["mode"]) for r in rows},
                  key=lambda k: (k[0], k[1], ("stop-copy", "pre-copy", "background").index(k[2])
                                 if k[2] in ("stop-copy", "pre-copy", "background") else 9))
    for size, verb, mode in keys:
        rs = [r for r in rows if (r["size_mb"], r["verb"], r["mode"]) == (size, verb, mode)]

        def med(k, sub=False):
            vals = [(r["timings"] if sub else r).get(k) for r in rs]
            vals = [v for v in vals if isinstance(v, (int, float)) and v == v]
            return round(statistics.median(vals), 1) if vals else None

        out.append({"size_mb": size, "verb": verb, "mode": mode, "n": len(rs),
                    "pause_ms": med("pause_ms"), "pause_max_ms": max(r["pause_ms"] for r in rs),
                    "pause_wall_ms": med("pause_wall_ms"), "guest_gap_ms": med("guest_gap_ms"),
                    "guest_gap_baseline_ms": med("guest_gap_baseline_ms"), "call_ms": med("call_ms"),
                    "parent_ram_mb_before": med("parent_ram_mb_before"),
                    "parent_ram_mb_after": med("parent_ram_mb_after"),
                    "disk_ms": med("disk_ms", True), "device_ms": med("device_ms", True),
                    "memory_copy_ms": med("memory_copy_ms", True), "precopy_ms": med("precopy_ms", True),
                    "child_restore_ms": med("child_restore_ms", True)})
    return out


def table(summary: list[dict]) -> list[str]:
    lines = ["| guest | verb | capture | vCPUs stopped (QEMU events), median / max | driver's clock | guest: longest gap (before) | whole call | parent RAM file before → after |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for s in summary:
        lines.append(f"| {s['size_mb']} MiB | {s['verb']} | {s['mode']} | {s['pause_ms']} / {s['pause_max_ms']} ms | "
                     f"{s['pause_wall_ms']} ms | {s['guest_gap_ms']} ({s['guest_gap_baseline_ms']}) ms | "
                     f"{s['call_ms']} ms | {s['parent_ram_mb_before']} → {s['parent_ram_mb_after']} MiB |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="256,2048")
    ap.add_argument("--modes", default="stop-copy,background",
                    help="pre-copy only where the driver takes it (KVM, or TCG from QEMU 9.0)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--runs-large", type=int, default=None, help="runs for guests over 256 MiB (default: --runs)")
    ap.add_argument("--fill-256", type=int, default=150, help="MiB the 256 MiB guest writes into its tmpfs")
    ap.add_argument("--fill-2048", type=int, default=1200, help="MiB the 2 GiB guest writes into its tmpfs")
    ap.add_argument("--dirty-mbps", type=float, default=4.0, help="the guest's memory writer, MiB/s")
    ap.add_argument("--images-dir", default=os.environ.get("AENV_IMAGES_DIR", str(DEFAULT_IMAGES_DIR)))
    ap.add_argument("--home-dir", default=None, help="where the benchmark's driver home goes (default: /tmp)")
    ap.add_argument("--quick", action="store_true", help="1 run, 256 MiB only")
    ap.add_argument("--probe", action="store_true", help="only print what the kernel and QEMU allow")
    args = ap.parse_args()
    found = probe()
    print(json.dumps(found, indent=1))
    if args.probe:
        return
    args.sizes = [256] if args.quick else [int(x) for x in args.sizes.split(",")]
    args.modes = args.modes.split(",")
    args.runs = 1 if args.quick else args.runs
    args.runs_large = args.runs if args.runs_large is None else args.runs_large
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    t0 = time.monotonic()
    load0 = os.getloadavg()
    b = Bench(args)
    try:
        b.run()
    finally:
        b.close()
    summary = summarize(b.rows)
    result = {"stamp": stamp, "host": {"kernel": platform.release(), "cpus": os.cpu_count(),
                                       "loadavg_at_start": [round(x, 2) for x in load0],
                                       "loadavg_at_end": [round(x, 2) for x in os.getloadavg()]},
              "probe": found, "args": {k: v for k, v in vars(args).items()}, "duration_s": round(time.monotonic() - t0),
              "summary": summary, "rows": b.rows}
    lines = table(summary)
    print("\n".join(lines))
    out_dir = ROOT / ("var/bench-quick" if args.quick else "bench/results")
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"capture_window-{stamp}.json"
    out.write_text(json.dumps(result, indent=2))
    head = [f"# capture window benchmark {stamp}", "",
            f"kernel {result['host']['kernel']}, {result['host']['cpus']} cores, load average at start "
            f"{result['host']['loadavg_at_start']}, at end {result['host']['loadavg_at_end']}, "
            f"{args.runs} runs ({args.runs_large} for the larger guests), guest memory writer {args.dirty_mbps} MiB/s, run took {result['duration_s']} s", ""]
    out.with_suffix(".md").write_text("\n".join(head + lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
