"""What the host pays for sandboxes, read from /proc and /dev/shm: CPU over a window (the
whole machine from /proc/stat, each QEMU from /proc/<pid>/stat), QEMU RSS / PSS
(smaps_rollup), guest RAM files in tmpfs, MemAvailable. bench/cluster.py's capacity part
turns these into per-idle-sandbox figures."""
from __future__ import annotations

import os
import shutil
import statistics
import time
from pathlib import Path

from bench.lifecycle_common import MIB, mem_available, smaps_rollup
from envd.usage import cpu_percent, read_cpu_times

SHM = Path("/dev/shm")
TICKS = os.sysconf("SC_CLK_TCK")


def qemu_pid(home: Path, sandbox_id: str) -> int | None:
    """The sandbox's QEMU (its pidfile in the node's state dir), if it runs."""
    try:
        pid = int((home / "sandboxes" / sandbox_id / "qemu.pid").read_text().split()[0])
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError, IndexError):
        return None
    return pid if b"qemu-system" in cmd.split(b"\0", 1)[0] else None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process and all its threads so far."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def cpu_window(seconds: float, pids: list[int]) -> dict:
    """Over ``seconds``: the machine's busy % (all cores, /proc/stat) and each process's
    CPU as % of one core."""
    host0, t0 = read_cpu_times(), time.monotonic()
    procs0 = {pid: cpu_seconds(pid) for pid in pids}
    time.sleep(seconds)
    host1, elapsed = read_cpu_times(), time.monotonic() - t0
    per = []
    for pid, before in procs0.items():
        after = cpu_seconds(pid)
        if before is not None and after is not None:
            per.append(100.0 * (after - before) / elapsed)
    return {"seconds": round(elapsed, 1), "host_busy_pct": cpu_percent(host0, host1), "per_process_pct_of_core": per}


def shm_used() -> int:
    return shutil.disk_usage(SHM).used


def ram_file_bytes(sandbox_id: str) -> int:
    """Allocated bytes of the sandbox's guest RAM file in tmpfs (sparse: what the guest touched)."""
    try:
        return (SHM / f"aenv-{sandbox_id}.ram").stat().st_blocks * 512
    except OSError:
        return 0


def stats(values: list[float], digits: int = 1) -> dict:
    if not values:
        return {}
    return {"mean": round(statistics.mean(values), digits), "median": round(statistics.median(values), digits),
            "min": round(min(values), digits), "max": round(max(values), digits), "n": len(values)}


def memory_of(pids: list[int]) -> dict:
    """Per QEMU (MiB): RSS, PSS, PSS of its anonymous memory and of its shared memory (the
    guest RAM file in tmpfs is shmem)."""
    rollups = []
    for pid in pids:
        try:
            rollups.append(smaps_rollup(pid))
        except OSError:
            continue
    return {key: stats([r.get(field, 0) / 1024 for r in rollups])
            for key, field in (("rss_mib", "Rss"), ("pss_mib", "Pss"), ("pss_anon_mib", "Pss_Anon"),
                               ("pss_shmem_mib", "Pss_Shmem"))}


def host_memory() -> dict:
    return {"mem_available_mib": round(mem_available() / MIB), "shm_used_mib": round(shm_used() / MIB)}
