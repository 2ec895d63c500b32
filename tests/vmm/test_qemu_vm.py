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


def run_in_guest(port: int, monkeypatch, cmd: str, user: str = "user") -> tuple[int, str]:
    from e2b import Sandbox

    monkeypatch.setenv("E2B_DEBUG", "true")
    monkeypatch.setenv("E2B_SANDBOX_URL", f"http://127.0.0.1:{port}")
    result = Sandbox.create().commands.run(cmd, user=user, timeout=60)
    return result.exit_code, result.stdout


def test_boot_exec_kill(driver, monkeypatch):
    from tests.vmm.test_lifecycle_vm import start_vm  # noqa: PLC0415 - that module imports this one

    info = start_vm(driver, BootSpec("vmtest-1", cpu_count=2, memory_mb=512))  # the template shape
    try:
        assert info.accel == driver.accel in ("tcg", "kvm")
        assert envd_healthy(info.envd_host, info.envd_port)
        assert info.timings["total_ms"] > 0 and info.pid > 0
        assert [v.sandbox_id for v in driver.list()] == ["vmtest-1"]
        # A worker restart: a fresh driver finds the VM from its state dir.
        again = get_driver("qemu", driver.home, IMAGES_DIR)
        assert again.info("vmtest-1").envd_port == info.envd_port
        code, out = run_in_guest(info.envd_port, monkeypatch, "uname -r")
        assert code == 0 and out.strip() and out.strip() != os.uname().release
        code, out = run_in_guest(info.envd_port, monkeypatch, "cat /etc/os-release")
        assert "bookworm" in out
        code, out = run_in_guest(info.envd_port, monkeypatch, "id user && whoami && sudo -n true && echo SUDO-OK")
        assert code == 0 and "uid=1000(user)" in out and "SUDO-OK" in out
    finally:
        assert driver.kill("vmtest-1") is True
    assert_gone(driver, info)
    assert driver.kill("vmtest-1") is False


def test_three_concurrent_boots(driver):
    ids = [f"vmconc-{i}" for i in range(3)]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        infos = list(pool.map(lambda sid: driver.boot(BootSpec(sid, cpu_count=1, memory_mb=256)), ids))
    try:
        assert len({i.envd_port for i in infos}) == 3
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
        "print(d.boot(BootSpec('vmorphan', cpu_count=1, memory_mb=256)).envd_port)"
    )
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run([os.sys.executable, "-c", script], cwd=repo, capture_output=True, text=True, timeout=200)
    assert out.returncode == 0, out.stderr
    port = int(out.stdout.strip().splitlines()[-1])
    time.sleep(0.5)
    try:
        assert envd_healthy("127.0.0.1", port)
        info = driver.info("vmorphan")
        assert info is not None and info.envd_port == port
    finally:
        assert driver.kill("vmorphan")
    assert_gone(driver, info)
