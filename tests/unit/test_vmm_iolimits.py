"""Per-sandbox disk I/O limits (vmm.qemu.iolimits): what QEMU is told, and what is refused."""
import pytest

from vmm.qemu.iolimits import DiskLimits


class FakeQMP:
    def __init__(self):
        self.calls = []

    def execute(self, command, **arguments):
        self.calls.append((command, arguments))


def test_limits_are_set_on_the_root_disk_as_totals():
    q = FakeQMP()
    DiskLimits(bps=50 << 20, iops=1000).apply(q)
    assert q.calls == [("block_set_io_throttle", {"id": "vblk0", "bps": 50 << 20, "bps_rd": 0, "bps_wr": 0,
                                                  "iops": 1000, "iops_rd": 0, "iops_wr": 0})]


def test_defaults_limit_and_zero_means_unlimited():
    assert DiskLimits().bps > 0 and DiskLimits().iops > 0
    q = FakeQMP()
    DiskLimits(0, 0).apply(q)
    assert q.calls[0][1]["bps"] == 0 and q.calls[0][1]["iops"] == 0


def test_negative_limits_are_refused():
    with pytest.raises(ValueError):
        DiskLimits(bps=-1)
