"""A guest whose tmpfs (guest RAM files) fills up dies, so the QEMU driver starts a VM only
while the tmpfs has room for all of its memory plus the headroom kept for the running
guests: otherwise HostMemoryFull, before anything starts (no state dir, no slot, no process)."""
import pytest

from vmm.driver import BootSpec, HostMemoryFull, get_driver
from tests.vmm.test_qemu_vm import IMAGES_DIR


@pytest.fixture()
def image():
    from vmm.images import ImageNotFound, find_image  # noqa: PLC0415

    try:
        return find_image(IMAGES_DIR, "base")
    except ImageNotFound as exc:
        pytest.skip(str(exc))


def test_a_boot_without_tmpfs_room_is_refused_before_it_starts(image, tmp_path):
    import shutil  # noqa: PLC0415

    # The tmpfs's whole size, not what is free now: other processes (a node, other sessions' guests)
    # free and fill /dev/shm meanwhile, and no guest fits in more than all of it.
    whole_mb = shutil.disk_usage("/dev/shm").total >> 20
    full = get_driver("qemu", tmp_path / "home", IMAGES_DIR, shm_headroom_mb=whole_mb)  # any guest is too big
    with pytest.raises(HostMemoryFull, match="plus the .* MiB kept for the running guests"):
        full.boot(BootSpec("shm-full", cpu_count=1, memory_mb=256))
    assert full.inspect("shm-full").status.value == "unknown" and full.sandbox_ids() == set()
    roomy = get_driver("qemu", tmp_path / "home2", IMAGES_DIR, shm_headroom_mb=0)
    roomy._check_shm(256, "fits")  # no error while it fits
