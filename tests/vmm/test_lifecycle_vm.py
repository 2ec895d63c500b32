"""Real QEMU microVMs: pause/resume (in memory and to disk), snapshot/restore and fork.

One parent VM per module (a TCG boot is ~10 s) runs a background Python counter that rewrites
/home/user/counter.txt ("<pid> <n>", harness/guest_counter.py) every 0.2 s. Every check reads that counter: the same pid with a
count that keeps growing from the old value proves the process (guest RAM + CPU state) survived;
a restarted guest would show another pid or no file. Timings are printed (run with -s).

A VM's envd is reached at its endpoint (envd_host, envd_port): under the netns backend the slot
address and envd's fixed port (a pause to disk gives the slot back, the resume takes a fresh
one), under the slirp fallback 127.0.0.1 and a forwarded port of its own. The helpers take an
endpoint or a VMInfo; after a pause to disk the parent's is read again from the driver.
"""

import contextlib
import os
import shutil
import time
from pathlib import Path

import pytest

from harness.guest_counter import COUNTER, COUNTER_FILE
from harness.polling import until
from tests.vmm.test_qemu_vm import (IMAGES_DIR, Endpoint, assert_no_slot, endpoint, fresh_sdk_connections,
                                    live_qemu_processes, start_vm, url)
from vmm.driver import BootSpec, SnapshotManifest, get_driver
from vmm.images import ensure_image
from vmm.qemu import envd_healthy

pytestmark = pytest.mark.vm

def sh(vm: Endpoint | object, cmd: str, user: str = "user", timeout: float = 60) -> str:
    """Runs cmd as `user` through the envd at vm's endpoint (a (host, port) pair or a VMInfo;
    e2b SDK in debug mode) and returns stdout."""
    from e2b import Sandbox

    keys = ("E2B_DEBUG", "E2B_SANDBOX_URL")
    old = {k: os.environ.get(k) for k in keys}
    os.environ.update(E2B_DEBUG="true", E2B_SANDBOX_URL=url(vm))
    fresh_sdk_connections()  # never a connection pooled for another VM at this endpoint
    try:
        return Sandbox.create().commands.run(cmd, user=user, timeout=timeout).stdout
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def counter(vm) -> tuple[int, int]:
    pid, n = sh(vm, f"cat {COUNTER_FILE}").split()
    return int(pid), int(n)


def exists(vm, path: str) -> bool:
    return sh(vm, f"test -e {path} && echo yes || echo no").strip() == "yes"


def run_detached(vm, name: str, script: str) -> None:
    """``script`` written to /home/user/<name>.py in the guest at vm's endpoint and started there
    detached from envd (it outlives the command that started it)."""
    sh(vm, f"cat > /home/user/{name}.py <<'EOF'\n{script}EOF")
    sh(vm, f"setsid nohup python3 /home/user/{name}.py >/dev/null 2>&1 </dev/null &")


def start_counting(vm) -> None:
    """The guest counter (COUNTER) started at vm's endpoint; returns once it has counted."""
    run_detached(vm, "counter", COUNTER)
    until(lambda: exists(vm, COUNTER_FILE), "the guest's counter to start", 30, tolerate=())


def assert_continues(vm, before: tuple[int, int]) -> tuple[int, int]:
    """Same process, count not reset, and still counting (read through vm's endpoint)."""
    now = counter(vm)
    assert now[0] == before[0], f"counter process restarted: {before} -> {now}"
    assert now[1] >= before[1], f"counter went back: {before} -> {now}"
    deadline = time.monotonic() + 10
    while True:
        later = counter(vm)
        if later[1] > now[1]:
            assert later[0] == before[0]
            return later
        assert time.monotonic() < deadline, f"counter stopped at {later}"
        time.sleep(0.3)


def assert_gone(driver, info):
    assert not info.state_dir.exists()
    assert not Path(f"/dev/shm/aenv-{info.sandbox_id}.ram").exists()
    assert live_qemu_processes(str(info.state_dir)) == []
    assert driver.info(info.sandbox_id) is None
    assert_no_slot(driver, info)


def current(driver, info) -> Endpoint:
    """The endpoint the driver reports for the VM now (a resume from disk may have moved it)."""
    now = driver.info(info.sandbox_id)
    assert now is not None and now.status == "running", now
    return endpoint(now)


@contextlib.contextmanager
def real_driver(home: Path):
    """A QEMU driver on the shared images with the real envd (skips where QEMU or the real
    envd is missing); every VM it still has is killed afterwards."""
    if not Path("/usr/bin/qemu-system-x86_64").exists():
        pytest.skip("qemu-system-x86_64 not installed")
    ensure_image(IMAGES_DIR, "base")
    d = get_driver("qemu", home, IMAGES_DIR)
    try:
        yield d
    finally:
        for vm in d.list():
            d.kill(vm.sandbox_id)


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    with real_driver(tmp_path_factory.mktemp("lifecycle") / "home") as d:
        yield d


@pytest.fixture(scope="module")
def parent(driver):
    info = driver.boot(BootSpec("lc-parent", cpu_count=1, memory_mb=256))
    ep = endpoint(info)
    sh(ep, "echo parent-data > /home/user/data.txt")
    start_counting(ep)
    yield info
    driver.kill(info.sandbox_id)


def test_pause_resume_in_memory(driver, parent):
    ep = current(driver, parent)
    pid = driver.info(parent.sandbox_id).pid
    before = counter(ep)
    t = driver.pause(parent.sandbox_id)
    print(f"\npause: {t}")
    paused = driver.info(parent.sandbox_id)
    assert paused.status == "paused" and endpoint(paused) == ep  # an in-memory pause keeps its network
    assert not envd_healthy(*ep, timeout=0.5)  # vCPUs really stopped
    time.sleep(0.5)
    info = driver.resume(parent.sandbox_id)
    print(f"resume (in memory): {info.timings}")
    assert info.status == "running" and endpoint(info) == ep and info.pid == pid  # same process, same endpoint
    assert_continues(ep, before)
    assert sh(ep, "cat /home/user/data.txt").strip() == "parent-data"


def test_pause_to_disk_resume(driver, parent):
    running = driver.info(parent.sandbox_id)
    ep, pid = current(driver, parent), running.pid
    before = counter(ep)
    t = driver.pause_to_disk(parent.sandbox_id)
    print(f"\npause_to_disk: {t}")
    assert driver.settle(30)  # its memory moves to disk after the pause has answered
    paused = driver.info(parent.sandbox_id)
    assert paused.status == "saved" and paused.pid == 0
    if driver.net.name == "netns":  # the slot was given back: no endpoint while saved
        assert paused.envd_host == ""
        assert_no_slot(driver, running)
    assert driver.inspect(parent.sandbox_id).memory is True
    assert [v.sandbox_id for v in driver.list()] == [parent.sandbox_id]
    assert live_qemu_processes(str(parent.state_dir)) == []  # QEMU really exited
    # the memory snapshot waits on disk, not in tmpfs: a paused VM holds no host memory and survives a reboot
    assert not Path(f"/dev/shm/aenv-{parent.sandbox_id}.ram").exists()
    assert (parent.state_dir / "memory.ram").is_file()
    assert driver.inspect(parent.sandbox_id).memory is True and t["total_ms"] < 200
    assert (parent.state_dir / "device.state").exists()
    assert not envd_healthy(*ep, timeout=0.5)  # nothing answers where it was
    info = driver.resume(parent.sandbox_id)
    print(f"resume (from disk): {info.timings}, envd {endpoint(info)} (was {ep})")
    assert info.status == "running" and info.pid != pid
    # The endpoint may have moved (netns: a fresh slot); the driver and the resume agree on it.
    assert current(driver, info) == endpoint(info) and envd_healthy(*endpoint(info))
    assert not (parent.state_dir / "device.state").exists()
    assert Path(f"/dev/shm/aenv-{parent.sandbox_id}.ram").exists() and not (parent.state_dir / "memory.ram").exists()
    assert info.timings["ram_from_disk_ms"] > 0
    assert_continues(info, before)
    assert sh(info, "cat /home/user/data.txt").strip() == "parent-data"


def test_snapshot_restore_two(driver, parent, tmp_path):
    ep = current(driver, parent)  # moved by the pause to disk above, maybe
    sh(ep, "echo snap-marker > /home/user/snap.txt")
    before = counter(ep)
    manifest = driver.snapshot(parent.sandbox_id, tmp_path / "snap")
    print(f"\nsnapshot: {manifest.timings}")
    assert manifest.timings["pause_ms"] < 5000
    assert SnapshotManifest.load(tmp_path / "snap").layers == manifest.layers
    assert len(manifest.layers) >= 2 and all(Path(p).exists() for p in manifest.layers)
    assert Path(manifest.memory_file).exists() and Path(manifest.device_state_file).exists()
    parent_counter = assert_continues(ep, before)  # the source keeps running
    assert current(driver, parent) == ep  # where it was
    kids = []
    try:
        for sid in ("lc-r1", "lc-r2"):
            kids.append(driver.restore(manifest, BootSpec(sid)))
            print(f"restore {sid}: {kids[-1].timings}")
        r1, r2 = kids
        assert len({endpoint(r1), endpoint(r2), ep}) == 3  # each restore has an endpoint of its own
        for kid in kids:
            assert current(driver, kid) == endpoint(kid)
            assert sh(kid, "cat /home/user/snap.txt").strip() == "snap-marker"
            assert_continues(kid, before)
        sh(r1, "echo r1 > /home/user/only-r1.txt")
        assert exists(r1, "/home/user/only-r1.txt")
        assert not exists(r2, "/home/user/only-r1.txt")
        assert not exists(ep, "/home/user/only-r1.txt")
        sh(ep, "echo p > /home/user/only-parent.txt")
        assert not exists(r2, "/home/user/only-parent.txt")
        assert_continues(ep, parent_counter)
    finally:
        for kid in kids:
            assert driver.kill(kid.sandbox_id)
    for kid in kids:
        assert_gone(driver, kid)
    assert Path(manifest.memory_file).exists()  # the caller owns the snapshot dir
    shutil.rmtree(tmp_path / "snap")


def test_restores_get_distinct_entropy(driver, parent, tmp_path):
    """Two restores of one snapshot, each /init'ed with its own entropySeed: envd credits it to
    the kernel pool (console says so) and the children's /dev/urandom streams differ."""
    import base64

    import httpx

    manifest = driver.snapshot(parent.sandbox_id, tmp_path / "snap")
    kids = []
    try:
        for sid in ("lc-e1", "lc-e2"):
            kid = driver.restore(manifest, BootSpec(sid))
            kids.append(kid)
            seed = base64.b64encode(os.urandom(64)).decode()
            r = httpx.post(f"{kid.envd_url}/init", json={"entropySeed": seed}, timeout=30)
            assert r.status_code == 204, r.text
            r = httpx.post(f"{kid.envd_url}/init", json={"entropySeed": "not base64"}, timeout=30)
            assert r.status_code == 400
        assert len({endpoint(k) for k in kids} | {current(driver, parent)}) == 3
        outs = [sh(k, "head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'").strip() for k in kids]
        assert len(outs[0]) == 64 and outs[0] != outs[1]
        for kid in kids:
            console = (kid.state_dir / "console.log").read_text(errors="replace")
            assert "entropy: credited 512 bits" in console
    finally:
        for kid in kids:
            driver.kill(kid.sandbox_id)
    shutil.rmtree(tmp_path / "snap")


def test_fork_two(driver, parent):
    ep = current(driver, parent)
    sh(ep, "echo fork-marker > /home/user/fork.txt")
    before = counter(ep)
    results = driver.fork(parent.sandbox_id, 2)
    kids = [r for r in results if not isinstance(r, Exception)]
    try:
        assert len(kids) == 2, results
        for kid in kids:
            print(f"\nfork child {kid.sandbox_id}: {kid.timings}")
        a, b = kids
        capture_ram = list(Path("/dev/shm").glob(f"aenv-fork-{parent.sandbox_id}-*.ram"))
        assert len(capture_ram) == 1  # the capture's RAM copy is on tmpfs, mapped by both children
        assert current(driver, parent) == ep  # the parent keeps its endpoint
        assert envd_healthy(*ep)
        assert len({endpoint(a), endpoint(b), ep}) == 3  # each child has an endpoint of its own
        for kid in kids:
            assert sh(kid, "cat /home/user/fork.txt").strip() == "fork-marker"
            assert_continues(kid, before)
        sh(a, "echo a > /home/user/only-a.txt")
        assert not exists(b, "/home/user/only-a.txt")
        assert not exists(ep, "/home/user/only-a.txt")
        assert_continues(ep, before)
    finally:
        for kid in kids:
            assert driver.kill(kid.sandbox_id)
    for kid in kids:
        assert_gone(driver, kid)
    forks = driver.home / "forks"
    assert not forks.exists() or list(forks.iterdir()) == []  # capture freed with its last child
    assert not capture_ram[0].exists()


def test_restored_vm_pause_to_disk_converts_to_own_ram(driver, parent, tmp_path):
    """A copy-on-write VM's first pause_to_disk carries its RAM in the stream; the resume puts
    it on a RAM file of its own (zero pages punched out), so the next pause saves ~100 KiB."""
    manifest = driver.snapshot(parent.sandbox_id, tmp_path / "snap")
    kid = driver.restore(manifest, BootSpec("lc-cow"))
    try:
        before = counter(kid)
        t1 = driver.pause_to_disk(kid.sandbox_id)
        full = (kid.state_dir / "device.state").stat().st_size
        info = driver.resume(kid.sandbox_id)
        print(f"\ncow pause_to_disk {t1}, state {full >> 20} MiB; resume {info.timings}")
        assert info.status == "running" and current(driver, kid) == endpoint(info)
        assert info.timings["ram_converted"] == 1
        own = Path(f"/dev/shm/aenv-{kid.sandbox_id}.ram")
        assert own.exists() and own.stat().st_blocks * 512 < 200 << 20  # not all 256 MiB
        before = assert_continues(info, before)
        t2 = driver.pause_to_disk(kid.sandbox_id)
        small = (kid.state_dir / "device.state").stat().st_size
        print(f"own-RAM pause_to_disk {t2}, state {small >> 10} KiB")
        assert small < 1 << 20 < full
        info = driver.resume(kid.sandbox_id)
        assert info.status == "running" and current(driver, kid) == endpoint(info)
        assert_continues(info, before)
    finally:
        assert driver.kill(kid.sandbox_id)
    assert_gone(driver, kid)
    assert Path(manifest.memory_file).exists()  # the snapshot's RAM was never the kid's to delete
    shutil.rmtree(tmp_path / "snap")


def test_kill_paused_to_disk_parent(driver, parent):
    driver.pause_to_disk(parent.sandbox_id)
    assert driver.kill(parent.sandbox_id)
    assert_gone(driver, parent)
    assert driver.list() == []
