"""Per-sandbox disk I/O limits: QEMU throttles each guest's root disk (block_set_io_throttle
on its virtio-blk device), so one guest writing flat out cannot take the node's whole disk
from the other sandboxes and the node itself.

Why over QMP and not on the command line: the limits are no part of the device set a saved
device state must match (snapshots taken before and after a change of the limits still
restore), and every QEMU the driver starts (boot, resume, restore, fork) gets them the same
way, right after it starts. A guest over its limit sees its I/O slowed, never failed.
"""

from __future__ import annotations

from dataclasses import dataclass

from vmm.qemu.qmp import QMP

# The guest's root disk (cmdline: -device virtio-blk-device,drive=root,id=vblk0).
ROOT_DEVICE = "vblk0"
DEFAULT_BPS = 200 << 20  # bytes/s, reads and writes together
DEFAULT_IOPS = 4000  # requests/s, reads and writes together


@dataclass(frozen=True)
class DiskLimits:
    """bps / iops: totals per sandbox (0: unlimited)."""

    bps: int = DEFAULT_BPS
    iops: int = DEFAULT_IOPS

    def __post_init__(self):
        if self.bps < 0 or self.iops < 0:
            raise ValueError(f"disk limits must be >= 0 (0: unlimited), not {self}")

    def apply(self, q: QMP, device: str = ROOT_DEVICE) -> None:
        """Sets the limits on a running QEMU (every field of the command is required)."""
        q.execute("block_set_io_throttle", id=device, bps=self.bps, bps_rd=0, bps_wr=0,
                  iops=self.iops, iops_rd=0, iops_wr=0)
