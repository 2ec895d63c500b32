"""A memory capture while the guest runs, so a snapshot's or a fork's parent stops for its
device state and the disk switch instead of for a copy of all of its RAM.

Why this shape. The stop-and-copy capture (vmm.qemu.snapshots) keeps the vCPUs stopped while
the RAM file is copied (~1 ms per MiB the guest uses, on a busy 2-core host). With QEMU's
``background-snapshot`` QEMU stops the guest, saves the device state, write-protects guest
RAM (userfaultfd) and lets it run again; a page is copied into the migration stream before
the guest's first write to it. ``pre-copy`` copies RAM while the guest runs and stops it for
the last dirty pages (only where QEMU's dirty tracking is sound: ``precopy_safe``). Either
stream carries the RAM, but restores (fork children sharing one RAM file copy-on-write,
pause to disk) want the old capture format: a raw RAM file plus a device state without RAM.
Rather than parse QEMU's stream, a second QEMU (the "vessel": the parent's machine, its RAM
the capture file, share=on, its disks null devices, never run) loads the stream into that
file and then saves its device state with x-ignore-shared, exactly as a stopped parent would.

The disk: the capture's disk layer must be the disk at the very instant of the memory
capture. Background: the driver stops the guest itself, switches the disk top, then starts
the migration (whose own stop is then a no-op) and lets the guest run again once the
migration has write-protected RAM and saved the device state: the first RAM page in the
stream means that point has passed (QEMU holds its big lock from the stop until the
protection is on, and streams pages only after). Pre-copy: QEMU pauses before the
switch-over with the guest stopped, and the driver switches the disk top there.

What it costs here (QEMU 7.2): before write-protecting, QEMU reads every page of guest RAM
once ("populate", needed by kernels without UFFD_FEATURE_WP_UNPOPULATED), and on tmpfs a
read of a hole allocates it, so the parent's RAM file becomes fully allocated (its whole
memory size, not only what the guest used). The driver allocates the holes beforehand, while
the guest runs (read faults of its own mapping), so the populate inside the stop only maps
pages. A QEMU that asks for WP_UNPOPULATED could skip the populate (docs/benchmarks.md,
"The capture window").
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

from vmm.errors import VMError
from vmm.qemu.qmp import QMP, QMPError, migrate_to_file, prepare_migration, set_ignore_shared

log = logging.getLogger(__name__)

MODES = ("auto", "background", "pre-copy", "stop-copy")  # auto: pre-copy where safe, else background
PRECOPY_DOWNTIME_MS = 5  # pre-copy: QEMU stops the guest once the dirty rest fits this
PRECOPY_REST = 2 << 20  # ... or the driver does once no more than this is left after a first whole pass
PRECOPY_CONVERGE_S = 2.0  # ... or this long after that pass (a guest dirtying faster than the copy)
ARM_TIMEOUT = 30.0
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14


def precopy_safe(accel: str, qemu_version: str) -> bool:
    """Pre-copy trusts QEMU's dirty bitmap. Under TCG, QEMU before 9.0 loses guest writes made
    through TLB entries it had already marked dirty once the migration's bitmap sync cleared
    the bit (QEMU commit 03bfc2188f, "physmem: Fix migration dirty bitmap coherency with TCG
    memory access", 9.0): the capture comes out torn — restored guests crashed or their memory
    checker saw pages from two instants (tests/vmm/test_capture_vm.py). KVM's dirty log has no
    such gap."""
    if accel == "kvm":
        return True
    m = re.search(r"version (\d+)\.", qemu_version)
    return bool(m) and int(m.group(1)) >= 9


class CaptureRefused(VMError):
    """QEMU or the kernel refused the background capture before the guest was touched."""


def set_background(q: QMP, on: bool, ignore_shared: bool) -> None:
    """background-snapshot on (x-ignore-shared as given: off, so a share=on RAM block is in the
    stream) or back to the driver's normal capabilities. QEMU checks userfaultfd write-protect
    on every RAM block when the capability is set: a refusal raises CaptureRefused."""
    if on:
        set_ignore_shared(q, ignore_shared)
        try:
            q.execute("migrate-set-capabilities",
                      capabilities=[{"capability": "background-snapshot", "state": True}])
        except QMPError as e:
            set_ignore_shared(q, True)
            raise CaptureRefused(f"background-snapshot refused: {e}") from None
    else:
        q.execute("migrate-set-capabilities", capabilities=[{"capability": "background-snapshot", "state": False}])
        set_ignore_shared(q, True)


def set_precopy(q: QMP, on: bool, ignore_shared: bool = False) -> None:
    """Pre-copy: x-ignore-shared as given (off into the vessel: the share=on RAM in the
    stream), QEMU pausing before the switch-over (the driver switches the disk top there) and
    a short downtime."""
    if on:
        set_ignore_shared(q, ignore_shared)
        q.execute("migrate-set-capabilities",
                  capabilities=[{"capability": "pause-before-switchover", "state": True}])
        q.execute("migrate-set-parameters", **{"downtime-limit": PRECOPY_DOWNTIME_MS})
    else:
        q.execute("migrate-set-capabilities",
                  capabilities=[{"capability": "pause-before-switchover", "state": False}])
        q.execute("migrate-set-parameters", **{"downtime-limit": 300})
        set_ignore_shared(q, True)


def wait_switchover(q: QMP, rest_bytes: int = PRECOPY_REST, converge_s: float = PRECOPY_CONVERGE_S,
                    timeout: float = 600.0) -> tuple[str, int]:
    """Until the pre-copy has stopped the guest and waits before its last pass. QEMU stops it
    itself when the dirty rest fits its downtime limit (by its own estimate of the bandwidth);
    the driver stops it when, after a first whole pass, at most ``rest_bytes`` are left to
    send, or ``converge_s`` after that pass (a guest dirtying faster than the copy: what it
    dirtied since QEMU's last look then goes in the stop). Returns who stopped it ("qemu",
    "rest" or "timeout") and the bytes QEMU still had to send when the driver stopped it."""
    t0 = time.monotonic()
    t_pass = None  # when the first whole pass ended (QEMU synced the dirty bitmap again)
    who = "qemu"
    rest = 0
    while True:
        info = q.execute("query-migrate") or {}
        status = info.get("status")
        if status == "pre-switchover":
            return who, rest
        if status in ("failed", "cancelled", "completed"):
            raise VMError(f"pre-copy capture: migration {status}: {info.get('error-desc', '')}")
        ram = info.get("ram") or {}
        if who == "qemu" and status == "active" and ram.get("dirty-sync-count", 0) >= 2:
            t_pass = t_pass or time.monotonic()
            if ram.get("remaining", rest_bytes + 1) <= rest_bytes:
                who = "rest"
            elif time.monotonic() - t_pass > converge_s:
                who = "timeout"
            if who != "qemu":
                rest = ram.get("remaining", 0)
                q.execute("stop")
        if time.monotonic() - t0 > timeout:
            raise VMError(f"pre-copy capture: still {status} after {timeout}s")
        # near the end the guest may already be stopped and waiting for this loop to notice
        time.sleep(0.0005 if t_pass is not None else 0.002)


def stopped_ms(events: list[dict]) -> float | None:
    """The vCPUs' stop as QEMU itself reports it: from its last STOP event to the RESUME after
    it (their timestamps), or None."""
    stop = resume = None
    for ev in events:
        ts = ev.get("timestamp") or {}
        t = ts.get("seconds", 0) + ts.get("microseconds", 0) / 1e6
        if ev.get("event") == "STOP":
            stop, resume = t, None
        elif ev.get("event") == "RESUME" and stop is not None:
            resume = t
    return (resume - stop) * 1e3 if stop is not None and resume is not None else None


def prefill(ram: Path) -> int:
    """Allocates every hole of the RAM file while the guest runs, by read faults through a
    mapping of this process (what QEMU's populate would do inside the stop: on tmpfs a read
    fault on a hole allocates a zeroed page and marks it up to date; data already there is
    untouched). Up-to-date pages let QEMU's own read faults inside the stop map 16 pages each
    (fault-around); ``fallocate`` would leave them not up to date, one fault per page (~0.8 s
    for 600 MiB here). Returns the bytes it added."""
    before = os.stat(ram).st_blocks * 512
    fd = os.open(ram, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        try:
            m.madvise(MADV_POPULATE_READ)
        finally:
            m.close()
        return os.fstat(fd).st_blocks * 512 - before
    finally:
        os.close(fd)


def wait_armed(q: QMP, timeout: float = ARM_TIMEOUT) -> dict:
    """Until the background migration has stopped the VM, saved its device state and
    write-protected RAM: the first page in the stream (or the end). Returns query-migrate."""
    deadline = time.monotonic() + timeout
    while True:
        info = q.execute("query-migrate") or {}
        status = info.get("status")
        ram = info.get("ram") or {}
        if status == "completed" or ram.get("normal", 0) + ram.get("duplicate", 0) > 0:
            return info
        if status in ("failed", "cancelled"):
            raise VMError(f"background capture: migration {status}: {info.get('error-desc', '')}")
        if time.monotonic() > deadline:
            raise VMError(f"background capture: not armed after {timeout}s (status {status})")
        time.sleep(0.0005)


def wait_completed(q: QMP, timeout: float = 600.0, poll: float = 0.005) -> dict:
    """Until the migration completed (``poll``: short where the guest waits for it)."""
    deadline = time.monotonic() + timeout
    while True:
        info = q.execute("query-migrate") or {}
        status = info.get("status")
        if status == "completed":
            return info
        if status in ("failed", "cancelled"):
            raise VMError(f"live capture: migration {status}: {info.get('error-desc', '')}")
        if time.monotonic() > deadline:
            raise VMError(f"live capture: still {status} after {timeout}s")
        time.sleep(poll)


def vessel_argv(argv: list[str], *, ram: Path, qmp: Path, console: Path, disk_bytes: int,
                tools_bytes: int) -> list[str]:
    """The parent's own command line (the destination form, ``-incoming defer``) turned into
    the vessel's: its RAM is ``ram`` (share=on), its QMP socket and console its own, not
    daemonized, null disks of the same sizes (the guest never runs in it: nothing reads them,
    and the parent keeps its disk files to itself), and a slirp network without forwards (a
    tap keeps its device, made anew in a network namespace of the vessel's own by the caller)."""
    out: list[str] = []
    skip = 0
    for i, arg in enumerate(argv):
        if skip:
            skip -= 1
            continue
        prev = argv[i - 1] if i else ""
        if arg == "-daemonize":
            continue
        if arg == "-pidfile":
            skip = 1
            continue
        if prev == "-object" and arg.startswith("memory-backend-file,"):
            parts = [p for p in arg.split(",") if not p.startswith(("mem-path=", "share="))]
            arg = ",".join(parts + [f"mem-path={ram}", "share=on"])
        elif prev == "-qmp":
            arg = f"unix:{qmp},server=on,wait=off"
        elif prev == "-serial":
            arg = f"file:{console}"
        elif prev == "-name":
            arg = f"{arg}-capture"
        elif prev == "-blockdev" and "node-name=rootfile" in arg:
            arg = f"driver=null-co,node-name=rootfile,size={disk_bytes}"
        elif prev == "-blockdev" and "node-name=root," in arg:
            arg = "driver=raw,node-name=root,file=rootfile"
        elif prev == "-blockdev" and "node-name=toolsfile" in arg:
            arg = f"driver=null-co,node-name=toolsfile,size={tools_bytes},read-only=on"
        elif prev == "-netdev" and arg.startswith("user,"):
            arg = "user,id=net0,restrict=on"
        out.append(arg)
    return out


class Vessel:
    """The capture's second QEMU: receives the parent's background migration into the
    capture RAM file, then writes the device state without RAM. Its own files live in
    ``work`` (removed by close())."""

    def __init__(self, argv: list[str], work: Path, netns: bool):
        self.work = work
        self.qmp_path = work / "qmp.sock"
        self.sock = work / "mig.sock"
        prefix = ["unshare", "--net"] if netns else []
        self.log = open(work / "qemu.log", "wb")
        self.proc = subprocess.Popen(prefix + argv, stdin=subprocess.DEVNULL, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.q: QMP | None = None

    def start_incoming(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise VMError(f"capture vessel exited {self.proc.returncode}: {self._log_tail()}")
            if self.qmp_path.exists():
                try:
                    self.q = QMP(self.qmp_path, timeout=60.0)
                    break
                except QMPError:
                    pass
            if time.monotonic() > deadline:
                raise VMError(f"capture vessel: no QMP after {timeout}s: {self._log_tail()}")
            time.sleep(0.005)
        prepare_migration(self.q)
        set_ignore_shared(self.q, False)  # must match the stream's (validated by the loader)
        self.q.execute("migrate-incoming", uri=f"unix:{self.sock}")
        while not self.sock.exists():  # listening once the socket exists
            if time.monotonic() > deadline:
                raise VMError("capture vessel: its migration socket did not appear")
            time.sleep(0.001)

    def wait_loaded(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            status = self.q.execute("query-status").get("status")
            mig = (self.q.execute("query-migrate") or {}).get("status")
            if mig == "completed" and status in ("paused", "prelaunch", "postmigrate"):
                return
            if mig in ("failed", "cancelled") or self.proc.poll() is not None:
                raise VMError(f"capture vessel: loading failed ({mig}, VM {status}): {self._log_tail()}")
            if time.monotonic() > deadline:
                raise VMError(f"capture vessel: still loading after {timeout}s")
            time.sleep(0.002)

    def save_device_state(self, path: Path) -> None:
        set_ignore_shared(self.q, True)
        migrate_to_file(self.q, path)

    def _log_tail(self) -> str:
        try:
            return (self.work / "qemu.log").read_text(errors="replace")[-500:].strip()
        except OSError:
            return ""

    def close(self) -> None:
        if self.q is not None:
            try:
                self.q.execute("quit")
            except (QMPError, OSError):
                pass
            self.q.close()
        try:
            self.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.work, ignore_errors=True)
