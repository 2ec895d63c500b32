"""A VM's serial console file: kept to its newest bytes, and read from its end.

Why holes: QEMU writes the guest's serial port (``-serial file:``) at its own file offset, and
a guest can write there without end (``cat /dev/urandom > /dev/ttyS0``). The node bounds the
file by punching a hole over everything but the newest bytes (``trim``, each console
collector round): the disk blocks go back to the filesystem while every byte keeps its
offset, so QEMU goes on writing where it was (no reopen, no change to the command line that
snapshots depend on), the collector's stored offsets stay valid, and a crashed guest's last
lines are still there after QEMU is gone. The apparent size keeps growing (a sparse file),
so nothing reads it whole: ``tail`` reads its end and ``first_data`` skips the hole.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from vmm.qemu.ramfile import punch_hole

BLOCK = 4096  # holes are punched in whole filesystem blocks
TAIL_BYTES = 64 << 10  # what a failure message reads of the console at most


def trim(path: Path | str, max_bytes: int) -> int:
    """Deallocates everything before the newest ``max_bytes`` of the console (rounded to
    whole blocks, so up to one block more stays); returns the bytes newly given back.
    A missing file is nothing to trim."""
    try:
        fd = os.open(path, os.O_WRONLY)
    except FileNotFoundError:
        return 0
    try:
        st = os.fstat(fd)
        end = (max(0, st.st_size - max(0, max_bytes)) // BLOCK) * BLOCK
        start = first_data(fd, 0)
        if end <= start:
            return 0
        before = st.st_blocks
        punch_hole(fd, start, end - start)
        return max(0, before - os.fstat(fd).st_blocks) * 512
    finally:
        os.close(fd)


def first_data(fd: int, offset: int) -> int:
    """The first offset >= ``offset`` that is not in a punched hole: the file's size when
    only a hole follows, ``offset`` itself where the filesystem cannot tell."""
    try:
        return os.lseek(fd, offset, os.SEEK_DATA)
    except OSError as e:
        if e.errno == errno.ENXIO:
            return max(offset, os.fstat(fd).st_size)
        return offset


def tail(path: Path | str, lines: int = 40, max_bytes: int = TAIL_BYTES) -> str:
    """The console's last ``lines`` lines, from at most its last ``max_bytes`` ("" if none)."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            start = first_data(f.fileno(), max(0, size - max_bytes))
            f.seek(start)
            data = f.read(max_bytes)
    except OSError:
        return ""
    text = data.replace(b"\0", b"").decode(errors="replace")
    return "\n".join(text.splitlines()[-lines:])


def allocated(path: Path | str) -> int:
    """Bytes of disk the console file really holds (0 if there is none)."""
    try:
        return os.stat(path).st_blocks * 512
    except FileNotFoundError:
        return 0
