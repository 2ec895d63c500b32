"""Real QEMU microVMs: build/ensure the base image, boot, talk to envd, kill, leave nothing behind.

Slow under TCG (~10 s per boot); selected with `-m vm` or `-k vmm`. The image cache is shared
(AENV_IMAGES_DIR, default var/images), so only the first run pays for debootstrap.
"""

import concurrent.futures
import os
import subprocess
import time
from pathlib import Path

import pytest

from vmm.driver import BootSpec, get_driver
from vmm.images import DEFAULT_IMAGES_DIR, ensure_image
from vmm.net import slots
from vmm.qemu import envd_healthy

pytestmark = pytest.mark.vm

IMAGES_DIR = Path(os.environ.get("AENV_IMAGES_DIR", DEFAULT_IMAGES_DIR))


@pytest.fixture(scope="module")
def image():
    if not Path("/usr/bin/qemu-system-x86_64").exists():
        pytest.skip("qemu-system-x86_64 not installed")
    return ensure_image(IMAGES_DIR, "base")


@pytest.fixture()
def driver(image, tmp_path):
    d = get_driver("qemu", tmp_path / "home", IMAGES_DIR)
    yield d
    for vm in d.list():
        d.kill(vm.sandbox_id)


Endpoint = tuple[str, int]


def endpoint(vm) -> Endpoint:
    """Where a VM's envd answers: (envd_host, envd_port) of a VMInfo, or such a pair as is.
    netns backend: the VM's slot address and envd's own port (the same for every VM);
    slirp fallback: 127.0.0.1 and a forwarded port of its own. A VM saved to disk has none."""
    host, port = vm if isinstance(vm, tuple) else (vm.envd_host, vm.envd_port)
    assert host and port, f"no envd endpoint: {vm}"
    return host, port


def url(vm) -> str:
    host, port = endpoint(vm)
    return f"http://{host}:{port}"


def fresh_sdk_connections() -> None:
    """Drops the e2b SDK's pooled connections (one process-wide keep-alive pool per transport
    kind, kept 300 s) so that the next SDK call connects anew. An endpoint does not name one
    guest for good: a slot address goes to the next VM once its VM is killed or paused to
    disk, and a cold-booted resume is a new guest at it; a connection pooled before would
    carry the request to a guest that never had it (reset by peer). The data plane keeps its
    upstream pools per sandbox and VM generation for the same reason (dataplane.pools).
    Private SDK state: if it moves, this fails loudly (AttributeError) rather than silently."""
    from e2b.api import client_sync  # noqa: PLC0415

    with client_sync._transport_lock:
        client_sync._transports.clear()
        client_sync._pools.clear()
        client_sync._httpx_transports.clear()


def live_qemu_processes(marker: str) -> list[str]:
    """Non-zombie processes whose command line mentions marker."""
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (p / "stat").read_text().rsplit(")", 1)[-1].split()[0]
        except OSError:
            continue
        if marker in cmd and state not in ("Z", "X"):
            out.append(f"{p.name}: {cmd}")
    return out


def assert_gone(driver, info):
    assert not info.state_dir.exists()
    assert not Path(f"/dev/shm/aenv-{info.sandbox_id}.ram").exists()
    assert live_qemu_processes(str(info.state_dir)) == []
    assert driver.info(info.sandbox_id) is None
    assert_no_slot(driver, info)


def assert_no_slot(driver, info):
    """netns: no slot of the driver's instance has the address the VM had (slot given back)."""
    if info.guest_host and driver.net.name == "netns":
        held = {s.address: s.netns for s in slots.list_slots(driver.net.prefix, driver.net.pool_cidr)}
        assert info.guest_host not in held, f"slot {held.get(info.guest_host)} of {info.sandbox_id} left behind"


def run_in_guest(vm, monkeypatch, cmd: str, user: str = "user") -> tuple[int, str]:
    from e2b import Sandbox

    monkeypatch.setenv("E2B_DEBUG", "true")
    monkeypatch.setenv("E2B_SANDBOX_URL", url(vm))
    fresh_sdk_connections()
    result = Sandbox.create().commands.run(cmd, user=user, timeout=60)
    return result.exit_code, result.stdout


def start_vm(driver, spec: BootSpec):
    """What the node's create does (agent.tasks._start_vm) with the shared images' booted
    templates: a restore of the template of this shape if there is one, else a cold boot."""
    from unittest import mock

    from agent import tasks
    from vmm.templates import TemplateCache

    with mock.patch.object(tasks, "get_templates", lambda: TemplateCache(IMAGES_DIR)):
        return tasks._start_vm(driver, spec)


def test_boot_exec_kill(driver, monkeypatch):
    info = start_vm(driver, BootSpec("vmtest-1", cpu_count=2, memory_mb=512))  # the template shape
    try:
        assert info.accel == driver.accel in ("tcg", "kvm")
        assert envd_healthy(info.envd_host, info.envd_port)
        assert info.timings["total_ms"] > 0 and info.pid > 0
        assert [v.sandbox_id for v in driver.list()] == ["vmtest-1"]
        # A worker restart: a fresh driver finds the VM from its state dir.
        again = get_driver("qemu", driver.home, IMAGES_DIR)
        assert endpoint(again.info("vmtest-1")) == endpoint(info)
        code, out = run_in_guest(info, monkeypatch, "uname -r")
        assert code == 0 and out.strip() and out.strip() != os.uname().release
        code, out = run_in_guest(info, monkeypatch, "cat /etc/os-release")
        assert "bookworm" in out
        code, out = run_in_guest(info, monkeypatch, "id user && whoami && sudo -n true && echo SUDO-OK")
        assert code == 0 and "uid=1000(user)" in out and "SUDO-OK" in out
    finally:
        assert driver.kill("vmtest-1") is True
    assert_gone(driver, info)
    assert driver.kill("vmtest-1") is False


def test_a_2048_mib_guest_boots_with_its_disks_and_cpus(driver, monkeypatch):
    """QEMU 10's microvm loaded a 2048 MiB guest's initrd over its ACPI page (the guest came up
    without /proc or its disks): the image's kernel caps where the initrd may go
    (vmm.rootfs.cap_initrd_addr_max). A cold boot (no template of this shape)."""
    info = start_vm(driver, BootSpec("vm2g", cpu_count=2, memory_mb=2048))
    try:
        code, out = run_in_guest(info, monkeypatch, "nproc; awk '/MemTotal/ {print $2}' /proc/meminfo; "
                                                    "findfs LABEL=aenv-root", user="root")
        cpus, mem_kib, root = out.split()
        assert code == 0 and cpus == "2" and root.startswith("/dev/vd")
        assert 1900 * 1024 < int(mem_kib) <= 2048 * 1024
    finally:
        driver.kill("vm2g")
    assert_gone(driver, info)


def test_three_concurrent_boots(driver):
    ids = [f"vmconc-{i}" for i in range(3)]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        infos = list(pool.map(lambda sid: driver.boot(BootSpec(sid, cpu_count=1, memory_mb=256)), ids))
    try:
        assert len({endpoint(i) for i in infos}) == 3
        assert all(envd_healthy(i.envd_host, i.envd_port) for i in infos)
        assert sorted(v.sandbox_id for v in driver.list()) == ids
    finally:
        for sid in ids:
            driver.kill(sid)
    for info in infos:
        assert_gone(driver, info)


def test_vm_outlives_its_starter(driver, tmp_path):
    """Booted from a child Python process that then exits: the VM keeps running and is killable."""
    script = (
        "import sys; from pathlib import Path; from vmm.driver import get_driver, BootSpec;"
        f"d = get_driver('qemu', Path({str(driver.home)!r}), Path({str(IMAGES_DIR)!r}));"
        "i = d.boot(BootSpec('vmorphan', cpu_count=1, memory_mb=256)); print(i.envd_host, i.envd_port)"
    )
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run([os.sys.executable, "-c", script], cwd=repo, capture_output=True, text=True, timeout=200)
    assert out.returncode == 0, out.stderr
    host, port = out.stdout.strip().splitlines()[-1].split()
    ep = (host, int(port))
    time.sleep(0.5)
    try:
        assert envd_healthy(*ep)
        info = driver.info("vmorphan")
        assert info is not None and endpoint(info) == ep
    finally:
        assert driver.kill("vmorphan")
    assert_gone(driver, info)
