"""Process plumbing shared by the QEMU driver's verbs: envd health probes, QEMU's version and
the command-line builder's digest (the driver fingerprint), qemu-img calls, boot attempts.

Why a module of its own: the boot, lifecycle and snapshot halves of the driver all spawn and
watch QEMU processes the same way; nothing here holds state.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

from envd_client import EnvdClient
from vmm.driver import BootTimeout, VMError
from vmm.qemu import cmdline, console
from vmm.qemu.cmdline import QEMU

DEFAULT_BOOT_TIMEOUT = 60.0
GUEST_SYNC_TIMEOUT = 120.0


def envd_healthy(host: str, port: int, timeout: float = 1.0) -> bool:
    """True when envd answers GET /health with 204 (slirp accepts then drops until the guest listens)."""
    with EnvdClient.at(host, port) as envd:
        return envd.health(timeout)


_VERSIONS: dict[tuple, str] = {}


def qemu_version(qemu: str = QEMU) -> str:
    """The first line of ``qemu --version`` (snapshot fingerprints, capture choices, release
    checks), asked once per binary and again only when the binary file changes (a package
    upgrade under a running node). Raises OSError or SubprocessError."""
    path = shutil.which(qemu) or qemu
    info = os.stat(path)
    key = (os.path.realpath(path), info.st_ino, info.st_mtime_ns, info.st_size)
    if key not in _VERSIONS:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, check=True).stdout
        _VERSIONS[key] = out.splitlines()[0].strip()
    return _VERSIONS[key]


def qemu_release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a ``qemu_version`` line ("QEMU emulator version 10.0.2 (Debian ...)"),
    None if it names none. A device state loads only into the QEMU release that saved it: the
    microvm machine has no versioned machine types, so QEMU promises no migration between
    releases (7.2's does not load in 10.0). Stable and distribution updates of one release
    (7.2.x, Debian's +debNuM) keep the device state format."""
    m = re.search(r"version (\d+)\.(\d+)", version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def release_mismatch(saved_by: str, here: str) -> str:
    """Why a device state saved by QEMU ``saved_by`` does not load here (``here``), or ""
    (same release, or either unknown: an old record without the version is tried)."""
    a, b = qemu_release(saved_by), qemu_release(here)
    if a is None or b is None or a == b:
        return ""
    return (f"its device state was saved by {saved_by.split(' (')[0]} and this node runs "
            f"{here.split(' (')[0]}: QEMU loads a device state only from its own release")


def cmdline_digest() -> str:
    """The command-line builder's source: a changed device or kernel argument no longer
    matches a saved device state."""
    return hashlib.sha256(Path(cmdline.__file__).read_bytes()).hexdigest()[:16]


def console_tail(path: Path, lines: int = 40) -> str:
    """The console's last lines for a failure message (read from its end: see vmm.qemu.console)."""
    return console.tail(path, lines)



def attempts_error(sandbox_id: str, failures: list) -> VMError:
    last = failures[-1]
    msg = f"sandbox {sandbox_id}: envd not healthy after {len(failures)} attempts ({'; '.join(map(str, failures))})"
    if last.timed_out:
        return BootTimeout(msg, last.console)
    return VMError(msg + (f"\n--- console tail ---\n{last.console}" if last.console else ""))


class BootAttemptFailed(Exception):
    def __init__(self, message: str, console: str, timed_out: bool = False):
        super().__init__(message)
        self.console = console
        self.timed_out = timed_out


def run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise VMError(f"{' '.join(cmd)}: {proc.stderr.strip()}")
    return proc.stdout


_size_cache: dict[tuple[str, float], int] = {}


def virtual_size_mb(qcow2: Path) -> int:
    """Virtual size of the template base (cached per file+mtime)."""
    key = (str(qcow2), qcow2.stat().st_mtime)
    if key not in _size_cache:
        info = json.loads(run(["qemu-img", "info", "-U", "--output=json", str(qcow2)]))
        _size_cache[key] = int(info["virtual-size"]) >> 20
    return _size_cache[key]

