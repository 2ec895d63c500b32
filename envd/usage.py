"""Resource usage of the machine this runs on, read from /proc and statvfs: CPU busy share
between two readings, memory, a filesystem's size.

Why here: envd's ``GET /metrics`` (E2B's guest CPU %, memory and disk) needs it in the
guest, with the standard library only (envd is frozen and runs on any image), and the
node's heartbeat reports the same figures of its host; one reader of /proc serves both,
as ``envd.wire`` serves both sides of the framing.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

PROC_STAT = "/proc/stat"
PROC_MEMINFO = "/proc/meminfo"
PROC_MOUNTS = "/proc/self/mounts"


@dataclass(frozen=True)
class CpuTimes:
    """The aggregate ``cpu`` line of /proc/stat: busy and total jiffies since boot."""

    busy: int
    total: int


def parse_cpu_times(text: str) -> CpuTimes:
    """The first ``cpu `` line: idle = idle + iowait; guest time is already in user/nice,
    so guest and guest_nice (fields 9, 10) are left out of the total."""
    for line in text.splitlines():
        if line.startswith("cpu "):
            fields = [int(x) for x in line.split()[1:]]
            fields += [0] * (8 - len(fields))
            total = sum(fields[:8])
            idle = fields[3] + fields[4]
            return CpuTimes(busy=total - idle, total=total)
    raise ValueError("no aggregate cpu line in /proc/stat")


def read_cpu_times(path: str = PROC_STAT) -> CpuTimes:
    with open(path) as f:
        return parse_cpu_times(f.read())


def cpu_percent(before: CpuTimes, after: CpuTimes) -> float:
    """Share of all CPUs busy between two readings, 0..100 (0 when no time passed)."""
    total = after.total - before.total
    if total <= 0:
        return 0.0
    busy = min(max(after.busy - before.busy, 0), total)
    return round(100.0 * busy / total, 2)


@dataclass(frozen=True)
class Memory:
    """Bytes: total, used (total minus what the kernel says is available) and page cache."""

    total: int
    used: int
    cache: int


def parse_meminfo(text: str) -> Memory:
    kib = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            kib[name.strip()] = int(parts[0])
    total = kib.get("MemTotal", 0)
    available = kib.get("MemAvailable", kib.get("MemFree", 0) + kib.get("Cached", 0) + kib.get("Buffers", 0))
    return Memory(total=total * 1024, used=max(total - available, 0) * 1024, cache=kib.get("Cached", 0) * 1024)


def read_memory(path: str = PROC_MEMINFO) -> Memory:
    with open(path) as f:
        return parse_meminfo(f.read())


@dataclass(frozen=True)
class Disk:
    """One mounted filesystem: where, what, and its size in bytes (used as ``df`` counts it)."""

    mount_point: str
    device: str
    filesystem_type: str
    used: int
    total: int


def disk_usage(path: str) -> tuple[int, int]:
    """(used, total) bytes of the filesystem holding ``path``."""
    st = os.statvfs(path)
    total = st.f_blocks * st.f_frsize
    return total - st.f_bfree * st.f_frsize, total


def _unescape(field: str) -> str:
    """/proc/mounts writes spaces, tabs, newlines and backslashes as octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def parse_mounts(text: str) -> list[tuple[str, str, str]]:
    """(mount point, device, filesystem type) of each /proc/mounts line."""
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 3:
            out.append((_unescape(parts[1]), _unescape(parts[0]), parts[2]))
    return out


def mount_of(path: str, mounts: list[tuple[str, str, str]]) -> tuple[str, str, str] | None:
    """The mount that holds ``path``: the longest mount point above it (the last one
    mounted there wins, as in the kernel)."""
    path = os.path.realpath(path)
    best = None
    for entry in mounts:
        point = entry[0]
        if path == point or path.startswith(point.rstrip("/") + "/"):
            if best is None or len(point) >= len(best[0]):
                best = entry
    return best


def disks(paths: list[str], mounts_path: str = PROC_MOUNTS) -> list[Disk]:
    """The filesystems holding ``paths``, each once; paths that do not exist are skipped."""
    with open(mounts_path) as f:
        mounts = parse_mounts(f.read())
    seen, out = set(), []
    for path in paths:
        if not os.path.exists(path):
            continue
        entry = mount_of(path, mounts) or (path, "", "")
        if entry[0] in seen:
            continue
        seen.add(entry[0])
        used, total = disk_usage(entry[0] if os.path.exists(entry[0]) else path)
        out.append(Disk(mount_point=entry[0], device=entry[1], filesystem_type=entry[2], used=used, total=total))
    return out


class CpuMeter:
    """CPU busy % since the previous call. A first call, or one long after the previous
    (a guest restored from a snapshot taken minutes of guest time ago), measures over
    ``window`` seconds instead, so no answer averages over a stale baseline."""

    def __init__(self, window: float = 0.1, max_age: float = 30.0, read=read_cpu_times, clock=time.monotonic):
        self.window = window
        self.max_age = max_age
        self._read = read
        self._clock = clock
        self._lock = threading.Lock()
        self._last: tuple[float, CpuTimes] | None = None

    def needs_window(self) -> bool:
        """True when the next ``percent`` would measure over a fresh window."""
        last = self._last
        return last is None or self._clock() - last[0] > self.max_age

    def baseline(self) -> None:
        """Takes a reading to measure the next call against."""
        with self._lock:
            self._last = (self._clock(), self._read())

    def percent(self) -> float:
        """Busy % since the last reading (call ``baseline`` and wait ``window`` first
        when ``needs_window``); this reading becomes the next baseline."""
        now, times = self._clock(), self._read()
        with self._lock:
            before = self._last
            self._last = (now, times)
        return cpu_percent(before[1], times) if before is not None else 0.0
