"""Real QEMU microVMs: a guest that floods its console, fills its disk, keeps its CPUs busy
with a fork bomb or allocates all its memory hurts only itself (the limits are enforced
outside the guest). One VM for the module (a booted template's restore, as the node makes
them) and a second one where another sandbox must stay usable. Figures are printed (-s).
"""

import os
import time
import uuid
from pathlib import Path

import pytest

from tests.vmm.test_lifecycle_vm import real_driver, sh, start_vm
from vmm.driver import BootSpec
from vmm.qemu import console
from vmm.qemu.iolimits import DiskLimits
from vmm.qemu.qmp import QMP
from vmm.qemu.state import VMState

pytestmark = pytest.mark.vm

MIB = 1 << 20
TICK = os.sysconf("SC_CLK_TCK")


def root(vm, cmd: str, timeout: float = 60) -> str:
    return sh(vm, cmd, user="root", timeout=timeout)


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    with real_driver(tmp_path_factory.mktemp("limits") / "home") as d:
        yield d


@pytest.fixture(scope="module")
def vm(driver):
    info = start_vm(driver, BootSpec("limits-1"))  # 2 vCPU, 512 MiB, 2 GiB disk: the template shape
    yield info
    driver.kill(info.sandbox_id)


def state_of(driver, info) -> VMState:
    return VMState.load(driver.sandboxes_dir / info.sandbox_id)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def test_console_flood_stays_within_its_cap(driver, vm):
    """The guest writes random bytes to its serial port as fast as it can; the node trims the
    console (what the collector does every round, here every 0.5 s): the file holds at most
    the cap on disk, its tail is the newest output, and the guest goes on running."""
    path = driver.console_path(vm.sandbox_id)
    cap = 64 << 10
    start_size = path.stat().st_size
    root(vm, "setsid nohup timeout 8 sh -c 'cat /dev/urandom > /dev/ttyS0' >/dev/null 2>&1 </dev/null &")
    t0, peak, trimmed = time.monotonic(), 0, []
    while time.monotonic() - t0 < 9:
        time.sleep(0.5)
        peak = max(peak, console.allocated(path))
        size_before = path.stat().st_size
        driver.trim_console(vm.sandbox_id, cap)
        held = console.allocated(path)
        # the guest goes on writing during the trim and the look after it: what it added since
        # the size above is not what the trim left (the trim keeps the newest ``cap`` bytes,
        # rounded to whole blocks at both ends)
        trimmed.append(held - (path.stat().st_size - size_before))
    written = path.stat().st_size - start_size
    rate = written / (time.monotonic() - t0)
    marker = f"console-end-{uuid.uuid4().hex}"
    root(vm, f"echo {marker} > /dev/ttyS0")
    driver.trim_console(vm.sandbox_id, cap)
    print(f"\nconsole flood: {written / MIB:.1f} MiB written in ~8 s ({rate / MIB:.2f} MiB/s); on disk at most "
          f"{peak / 1024:.0f} KiB before a trim, {max(trimmed) / 1024:.0f} KiB after, less what came meanwhile "
          f"(cap {cap >> 10} KiB)")
    assert written > 8 * cap, "the guest did not flood (the test would prove nothing)"
    assert max(trimmed) <= cap + 2 * console.BLOCK
    assert console.allocated(path) <= cap + 2 * console.BLOCK  # the flood is over: nothing adds to it
    assert marker in console.tail(path, lines=5)
    assert root(vm, "echo alive").strip() == "alive"


def test_disk_io_is_throttled_and_the_limits_survive_a_restore(driver, vm):
    """Every QEMU the driver starts (this one is a template restore) gets the default disk
    limits; a tighter limit slows a guest's direct writes down to it."""
    st = state_of(driver, vm)
    with QMP(Path(st.qmp)) as q:
        dev = next(d for d in q.execute("query-block") if d.get("qdev") == "vblk0")
        assert dev["inserted"]["bps"] == driver.disk_limits.bps and dev["inserted"]["iops"] == driver.disk_limits.iops
    dd = "dd if=/dev/zero of=/home/user/dd.bin bs=1M count=32 oflag=direct 2>&1 | tail -1; rm -f /home/user/dd.bin"
    t = time.monotonic()
    root(vm, dd)
    free_s = time.monotonic() - t
    with QMP(Path(st.qmp)) as q:
        DiskLimits(bps=8 * MIB, iops=0).apply(q)
    try:
        t = time.monotonic()
        root(vm, dd)
        slow_s = time.monotonic() - t
    finally:
        with QMP(Path(st.qmp)) as q:
            driver.disk_limits.apply(q)
    print(f"\n32 MiB of direct writes: {free_s:.2f} s at the default limits, {slow_s:.2f} s at 8 MiB/s")
    assert slow_s >= 32 / 8 * 0.8 > free_s


@pytest.mark.slow  # a measurement: on a loaded 2-core host the bomb may not load the guest enough to prove it
def test_a_fork_bomb_uses_at_most_its_vcpus_and_another_sandbox_still_answers(driver, vm):
    other = start_vm(driver, BootSpec("limits-2"))
    try:
        pid = state_of(driver, vm).pid
        # As `user`, with a process limit so the guest stays reachable to stop it afterwards.
        sh(vm, "setsid nohup bash -c 'ulimit -u 300; b(){ b|b& }; b' >/dev/null 2>&1 </dev/null &")
        time.sleep(1.0)
        c0, t0 = cpu_seconds(pid), time.monotonic()
        latencies = []
        for _ in range(3):
            t = time.monotonic()
            assert sh(other, "echo pong").strip() == "pong"
            latencies.append(time.monotonic() - t)
            time.sleep(0.5)
        time.sleep(max(0.0, 4.0 - (time.monotonic() - t0)))
        used = (cpu_seconds(pid) - c0) / (time.monotonic() - t0)
        for _ in range(3):
            root(vm, "pkill -KILL -u user; true", timeout=60)
        print(f"\nfork bomb in a 2-vCPU guest: its QEMU used {used * 100:.0f}% CPU; the other sandbox answered in "
              f"{', '.join(f'{x:.2f}' for x in latencies)} s")
        assert used <= 2 * 1.1 + 0.1, f"QEMU of a 2-vCPU guest used {used * 100:.0f}% CPU"
        assert used > 0.5, "the bomb did not load the guest (the test would prove nothing)"
        assert max(latencies) < 10
        assert root(vm, "echo alive").strip() == "alive"
    finally:
        driver.kill(other.sandbox_id)


def test_a_guest_using_all_its_memory_stays_within_it(driver, vm):
    """An allocation past the guest's RAM ends in the guest's OOM killer (its process only):
    the host holds at most the guest's RAM file plus QEMU's own overhead."""
    st = state_of(driver, vm)
    hog = ("echo 1000 > /proc/self/oom_score_adj; "
           "python3 -c \"x = []\nwhile True: x.append(b'x' * (1 << 20))\"; echo exit=$?")
    out = sh(vm, hog, timeout=120)
    ram = Path(st.ram)
    status = dict(line.split(":", 1) for line in Path(f"/proc/{st.pid}/status").read_text().splitlines() if ":" in line)
    rss_mb = int(status["VmRSS"].split()[0]) >> 10
    hwm_mb = int(status["VmHWM"].split()[0]) >> 10
    ram_mb = ram.stat().st_blocks * 512 / MIB
    print(f"\nmemory hog in a {st.memory_mb} MiB guest: {out.strip()}; RAM file {ram_mb:.0f} MiB, "
          f"QEMU RSS {rss_mb} MiB (peak {hwm_mb} MiB)")
    assert "exit=137" in out or "MemoryError" in out or "exit=1" in out, out
    assert ram.stat().st_size == st.memory_mb * MIB and ram_mb <= st.memory_mb
    assert hwm_mb <= st.memory_mb + 256, "QEMU grew past the guest's RAM plus its own overhead"
    assert root(vm, "echo alive").strip() == "alive"  # only the guest's process died


@pytest.mark.slow  # ~40 s: a GiB of writes under TCG (AENV_TEST_SLOW=1 runs it)
def test_a_full_disk_is_enospc_in_the_guest_and_bounded_on_the_host(driver, vm):
    """The guest fills its root filesystem: writes end in ENOSPC inside the guest, and the
    sandbox's disk file on the host stays within the disk's virtual size (+ qcow2 metadata)."""
    st = state_of(driver, vm)
    with QMP(Path(st.qmp)) as q:  # no throttling for this one: seconds, not a minute
        DiskLimits(bps=0, iops=0).apply(q)
    try:
        out = root(vm, "dd if=/dev/zero of=/fill bs=4M 2>&1 | grep -E 'error|copied'; sync; df -m / | tail -1; "
                   "rm -f /fill; sync",
                   timeout=180)
    finally:
        with QMP(Path(st.qmp)) as q:
            driver.disk_limits.apply(q)
    top = Path(st.top)
    on_host = top.stat().st_blocks * 512
    bound = st.disk_size_mb * MIB + st.disk_size_mb * MIB // 8192 + 16 * MIB  # data + L2 tables (64 KiB clusters) + slack
    print(f"\nguest disk filled: {out.strip()}\nhost top {top.stat().st_size / MIB:.0f} MiB "
          f"({on_host / MIB:.0f} MiB on disk), virtual size {st.disk_size_mb} MiB")
    assert "No space left on device" in out, out
    assert top.stat().st_size <= bound and on_host <= bound
    assert root(vm, "echo alive").strip() == "alive"
