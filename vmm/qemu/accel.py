"""Chooses the QEMU accelerator: KVM only if /dev/kvm really runs our guest kernel, else TCG.

Why a probe boot: on some hosts /dev/kvm exists but cannot run stock guests (e.g. a PVM-only
module), and QEMU then aborts or hangs. The result is cached in images_dir/accel.json, keyed by
guest kernel and host, so detection happens once per host and kernel.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import time
from pathlib import Path

from vmm.hostinfo import kvm_openable, lpj, tsc_khz
from vmm.qemu.cmdline import QEMU

PROBE_MARKER = "AENV-PROBE-OK"


def cache_key(kernel: Path) -> str:
    st = kernel.stat()
    host = f"{platform.node()}|{platform.release()}|{st.st_size}|{int(st.st_mtime)}|{kernel.resolve()}"
    return hashlib.sha256(host.encode()).hexdigest()[:16]


def probe_kvm(kernel: Path, initrd: Path, timeout: float = 8.0, qemu: str = QEMU) -> tuple[bool, str]:
    """Boots the mini initramfs under KVM in probe mode; True if it reaches init in time."""
    khz = tsc_khz()
    cmd = [qemu, "-M", "microvm", "-accel", "kvm", "-cpu", "host", "-m", "128M", "-smp", "1",
           "-nodefaults", "-no-user-config", "-no-reboot", "-display", "none", "-serial", "stdio",
           "-kernel", str(kernel), "-initrd", str(initrd),
           "-append", f"console=ttyS0 panic=-1 quiet aenv.probe=1 tsc_early_khz={khz} lpj={lpj(khz)}"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        out = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return PROBE_MARKER in out, "timeout; " + out[-300:]
    return PROBE_MARKER in out, out[-300:]


def detect_accel(images_dir: Path, kernel: Path, initrd: Path, progress=lambda m: None) -> str:
    """'kvm' or 'tcg', cached per host and guest kernel in images_dir/accel.json."""
    cache = Path(images_dir) / "accel.json"
    key = cache_key(kernel)
    try:
        data = json.loads(cache.read_text())
    except (OSError, ValueError):
        data = {}
    if key in data:
        return data[key]["accel"]
    if not kvm_openable():
        accel, reason = "tcg", "/dev/kvm missing or not accessible"
    else:
        t0 = time.monotonic()
        ok, out = probe_kvm(kernel, initrd)
        accel = "kvm" if ok else "tcg"
        reason = f"KVM probe boot {'reached init' if ok else 'failed'} in {time.monotonic() - t0:.1f}s: {out.strip()[-200:]}"
    progress(f"accelerator: {accel} ({reason})")
    data[key] = {"accel": accel, "reason": reason, "detected_at": time.time()}
    tmp = cache.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, cache)
    return accel
