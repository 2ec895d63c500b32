"""Host facts the VM command line depends on: TSC frequency and capacity.

Why: microvm has no HPET/PM timer, so the guest kernel must be told the TSC rate
(`tsc_early_khz`, `lpj`) or it can hang calibrating at boot (qemu-feasibility §9-1).
"""

from __future__ import annotations

import os
import re
import subprocess
from functools import lru_cache

GUEST_HZ = 250  # CONFIG_HZ of Debian's cloud kernel


def _tsc_from_dmesg() -> float | None:
    try:
        out = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for pattern in (r"tsc: Refined TSC clocksource calibration: ([\d.]+) MHz",
                    r"tsc: Detected ([\d.]+) MHz processor"):
        hits = re.findall(pattern, out)
        if hits:
            return float(hits[-1])
    return None


def _mhz_from_cpuinfo(text: str) -> float | None:
    m = re.search(r"^cpu MHz\s*:\s*([\d.]+)", text, re.M)
    return float(m.group(1)) if m else None


@lru_cache(maxsize=1)
def tsc_khz() -> int:
    """Host TSC frequency in kHz (dmesg calibration if readable, else /proc/cpuinfo)."""
    mhz = _tsc_from_dmesg()
    if mhz is None:
        with open("/proc/cpuinfo") as f:
            mhz = _mhz_from_cpuinfo(f.read())
    if not mhz:
        raise RuntimeError("cannot determine the host TSC frequency")
    return int(round(mhz * 1000))


def lpj(khz: int) -> int:
    """loops_per_jiffy matching the TSC rate, so the guest skips delay calibration."""
    return khz * 1000 // GUEST_HZ


def capacity() -> dict:
    """{"vcpus", "memory_mb"} of this host."""
    with open("/proc/meminfo") as f:
        total_kb = int(re.search(r"^MemTotal:\s+(\d+)", f.read(), re.M).group(1))
    return {"vcpus": os.cpu_count() or 1, "memory_mb": total_kb // 1024}


def kvm_openable(path: str = "/dev/kvm") -> bool:
    """/dev/kvm exists and this process may open it (whether guests really run on it is the
    driver's probe: see vmm.qemu.accel)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    os.close(fd)
    return True
