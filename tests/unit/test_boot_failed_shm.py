"""A boot whose guests died while the tmpfs of guest RAM had no room (the chaos bench filled
it: three creates at once passed admission, then died) answers HostMemoryFull (503), not a
plain VMError (500); with room, a failed boot stays a VMError."""
from vmm.driver import HostMemoryFull, VMError
from vmm.qemu.driver import QemuDriver
from vmm.qemu.process import BootAttemptFailed


def _driver(shm_dir, headroom_mb):
    driver = object.__new__(QemuDriver)  # only what _boot_failed reads: no images, no network
    driver.shm_dir, driver.shm_headroom_mb = shm_dir, headroom_mb
    return driver


def test_a_boot_that_died_without_tmpfs_room_is_host_memory_full(tmp_path):
    failures = [BootAttemptFailed("qemu died during boot", "")] * 2
    error = _driver(tmp_path, 1 << 30)._boot_failed("sbx", 512, failures)
    assert isinstance(error, HostMemoryFull) and "qemu died during boot" in str(error)


def test_a_boot_that_died_with_room_is_a_vm_error(tmp_path):
    error = _driver(tmp_path, 0)._boot_failed("sbx", 1, [BootAttemptFailed("qemu died during boot", "")])
    assert type(error) is VMError
