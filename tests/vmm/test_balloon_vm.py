"""Real QEMU microVM: memory the guest frees goes back to the host (virtio-balloon free-page
reporting; the guest's RAM is a share=on /dev/shm file, so QEMU punches holes into it)."""

import time
from pathlib import Path

import pytest

from tests.vmm.test_lifecycle_vm import assert_gone, real_driver, sh, start_vm
from vmm.driver import BootSpec

pytestmark = pytest.mark.vm

MIB = 1 << 20


def allocated(path: Path) -> int:
    """Bytes of host memory the guest RAM file really holds (tmpfs blocks, holes excluded)."""
    return path.stat().st_blocks * 512


@pytest.fixture()
def driver(tmp_path):
    with real_driver(tmp_path / "home") as d:
        yield d


def test_freed_guest_memory_returns_to_the_host(driver):
    info = start_vm(driver, BootSpec("balloon-1"))  # 2 vCPU, 512 MiB: a template restore when one exists
    ram = Path(f"/dev/shm/aenv-{info.sandbox_id}.ram")
    ep = (info.envd_host, info.envd_port)  # where its envd answers (slot address or 127.0.0.1 + port)
    # The guest driver is bound and negotiated VIRTIO_BALLOON_F_REPORTING (feature bit 5).
    features = sh(ep, "cat /sys/bus/virtio/drivers/virtio_balloon/virtio*/features").strip()
    assert len(features) > 5 and features[5] == "1", features
    before = allocated(ram)
    # Touch 200 MiB (a bytes object of 'x', not lazily-zero pages), keep it briefly, then free it by exiting.
    out = sh(ep, "python3 -c \"import time; b = b'x' * (200 << 20); print(len(b)); time.sleep(1)\"")
    assert out.strip() == str(200 * MIB)
    peak = allocated(ram)
    print(f"\nguest RAM file: before {before / MIB:.0f} MiB, after alloc+free {peak / MIB:.0f} MiB")
    assert peak - before > 150 * MIB, "the allocation did not reach host memory (test would prove nothing)"
    deadline = time.monotonic() + 60
    while allocated(ram) > peak - 120 * MIB:
        assert time.monotonic() < deadline, f"still {allocated(ram) / MIB:.0f} MiB after 60 s (peak {peak / MIB:.0f})"
        time.sleep(0.5)
    print(f"returned to the host: now {allocated(ram) / MIB:.0f} MiB "
          f"({(peak - allocated(ram)) / MIB:.0f} MiB freed, {60 - (deadline - time.monotonic()):.1f} s)")
    assert sh(ep, "echo alive").strip() == "alive"
    assert driver.kill(info.sandbox_id)
    assert_gone(driver, info)
