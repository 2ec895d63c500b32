"""Memory captures taken while the guest writes to its memory (issue 26): every capture way
(pre-copy, background-snapshot, stop-and-copy) must give a restore whose memory is the memory
of one instant.

Pre-copy is only taken where QEMU's dirty tracking is sound (KVM, or TCG from QEMU 9.0): under
TCG with this host's QEMU 7.2 these tests caught it restoring torn memory (QEMU commit
03bfc2188f), so the driver refuses it there (and the test checks that it does, taking the
next safe way).

The guest runs a self-checking sweeper: a 64 MiB buffer whose pages it rewrites in order, one
sweep after another, each page getting the sweep's number; before writing a page it checks
that the page still holds the previous sweep's number. A consistent capture restores pages
and the sweeper's own state (its position, its sweep number: guest RAM and vCPU state) from
the same instant, so the restored sweeper carries on without a complaint. A capture whose
pages come from different instants (copied while the guest ran, without tracking its writes)
leaves pages ahead of or behind the restored position, which the sweeper reports as CORRUPT
(or the guest does not come back at all). The last test makes exactly such a torn capture
and checks that it is caught, so these tests can fail.
"""

import subprocess
import time
from unittest import mock

import pytest

from tests.vmm.test_lifecycle_vm import real_driver, run_detached, sh
from tests.vmm.test_qemu_vm import endpoint
from vmm.driver import BootSpec
from vmm.qemu import live_capture, qemu_version, snapshots, uffd

pytestmark = pytest.mark.vm

SWEEPER = """\
import os, sys, time
PAGES, PAGE = 16384, 4096
buf = bytearray(PAGES * PAGE)
def report(s):
    with open('/dev/shm/sweep.tmp', 'w') as f:
        f.write(s)
    os.replace('/dev/shm/sweep.tmp', '/dev/shm/sweep')
n = 0
while True:
    n += 1
    prev, cur = (n - 1) & 0xff, n & 0xff
    for i in range(PAGES):
        off = i * PAGE
        if buf[off] != prev:
            report(f'{os.getpid()} CORRUPT {n} page {i} holds {buf[off]}, expected {prev}')
            sys.exit(1)
        buf[off] = cur
        if i % 512 == 511:
            time.sleep(0.0005)
    report(f'{os.getpid()} OK {n}')
"""


def sweep(vm) -> tuple[int, str, int]:
    """(pid, "OK" or "CORRUPT", sweep number) of the guest's sweeper."""
    out = sh(endpoint(vm), "cat /dev/shm/sweep 2>/dev/null || echo 0 NONE 0").split()
    return int(out[0]), out[1], int(out[2])


def assert_sweeps_on(vm, pid: int, since: int, sweeps: int = 2, timeout: float = 120.0) -> int:
    """The same sweeper process, never CORRUPT, and `sweeps` more whole sweeps (every page
    checked twice) after sweep number `since`."""
    deadline = time.monotonic() + timeout
    while True:
        got_pid, verdict, n = sweep(vm)
        assert verdict != "CORRUPT", sh(endpoint(vm), "cat /dev/shm/sweep")
        assert got_pid == pid, f"the sweeper restarted or vanished: pid {got_pid}, was {pid}"
        if n >= since + sweeps:
            return n
        assert time.monotonic() < deadline, f"the sweeper is stuck at sweep {n} (from {since})"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    with real_driver(tmp_path_factory.mktemp("capture") / "home") as d:
        yield d


@pytest.fixture(scope="module")
def parent(driver):
    info = driver.boot(BootSpec("cap-parent", cpu_count=1, memory_mb=256))
    ep = endpoint(info)
    run_detached(ep, "sweeper", SWEEPER)
    deadline = time.monotonic() + 60
    while sweep(info)[2] < 2:  # a first whole sweep done: every page written once
        assert time.monotonic() < deadline, "the sweeper did not start"
        time.sleep(0.5)
    yield info
    driver.kill(info.sandbox_id)


MODES = ["pre-copy", "background", "stop-copy"]


@pytest.mark.parametrize("mode", MODES)
def test_snapshot_while_writing_restores_one_instant(driver, parent, tmp_path, mode):
    background = uffd.tmpfs_write_protect(driver.shm_dir)
    usable = {"background": background, "stop-copy": True,
              "pre-copy": live_capture.precopy_safe(driver.accel, qemu_version())}
    if not usable[mode]:  # the driver must refuse it here and take the next safe way instead
        fallback = "background" if mode == "pre-copy" and background else "stop-copy"
        driver.capture_mode = mode
        try:
            assert driver._capture_how(driver._load(parent.sandbox_id)) == fallback
        finally:
            driver.capture_mode = "auto"
        return  # that way's own capture is the test of its row
    pid, verdict, before = sweep(parent)
    assert verdict == "OK"
    driver.capture_mode = mode
    try:
        m = driver.snapshot(parent.sandbox_id, tmp_path / "snap")
    finally:
        driver.capture_mode = "auto"
    assert m.timings["capture_precopy"] == (1.0 if mode == "pre-copy" else 0.0)
    assert m.timings["capture_background"] == (1.0 if mode == "background" else 0.0)
    child = driver.restore(m, BootSpec(f"cap-{mode}"))
    try:
        _, _, at_restore = sweep(child)
        assert at_restore >= before, "the restore went back before the capture"
        assert_sweeps_on(child, pid, at_restore)
    finally:
        driver.kill(child.sandbox_id)
    assert_sweeps_on(parent, pid, before)  # the parent's own memory came through the capture


def test_fork_while_writing(driver, parent):
    """A fork's live capture (asked for: "auto" captures forks stopped) while the guest
    writes: the child sweeps on."""
    pid, _, before = sweep(parent)
    driver.capture_mode = "background"
    try:
        (child,) = driver.fork(parent.sandbox_id, 1)
    finally:
        driver.capture_mode = "auto"
    assert not isinstance(child, Exception), child
    try:
        if uffd.tmpfs_write_protect(driver.shm_dir):
            assert child.timings["capture.capture_background"] == 1.0
        assert_sweeps_on(child, pid, before)
    finally:
        driver.kill(child.sandbox_id)
    assert_sweeps_on(parent, pid, before)


def test_a_torn_capture_is_caught(driver, parent, tmp_path):
    """The control: the RAM file copied while the guest runs, the device state (vCPUs) a
    moment later. The sweeper (or the guest) must notice; if it did not, the tests above
    would prove nothing."""
    orig = snapshots.SnapshotMixin._capture_stopped
    real_run = snapshots.run

    def torn(self, q, state, paths, was_running, ram_copy, device_state, memory):
        subprocess.run(["cp", "--sparse=always", state.ram, str(ram_copy)], check=True)  # the guest runs
        time.sleep(1.0)  # several sweeps later
        no_cp = lambda argv: None if argv[0] == "cp" else real_run(argv)  # noqa: E731
        with mock.patch.object(snapshots, "run", no_cp):  # no copy in the stop
            return orig(self, q, state, paths, was_running, ram_copy, device_state, memory)

    driver.capture_mode = "stop-copy"
    old_timeout = driver.boot_timeout
    try:
        with mock.patch.object(snapshots.SnapshotMixin, "_capture_stopped", torn):
            m = driver.snapshot(parent.sandbox_id, tmp_path / "torn")
        driver.boot_timeout = 30.0
        try:
            child = driver.restore(m, BootSpec("cap-torn"))
        except Exception:  # noqa: BLE001 - the guest did not come back: caught
            return
    finally:
        driver.capture_mode = "auto"
        driver.boot_timeout = old_timeout
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                _, verdict, _ = sweep(child)
            except Exception:  # noqa: BLE001 - envd gone: the guest broke, caught
                return
            if verdict == "CORRUPT":
                return
            time.sleep(0.5)
        pytest.fail("a torn capture restored without the sweeper noticing")
    finally:
        driver.kill(child.sandbox_id)
