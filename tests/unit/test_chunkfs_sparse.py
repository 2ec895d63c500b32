"""chunkfs.sparse: the one zero-skipping write both lazy RAM copies use (the daemon's
copy_out and vmm.qemu.ramfile's FUSE readers)."""
from __future__ import annotations

import os

import pytest

from chunkfs.sparse import ZERO_PIECE, pwrite_nonzero


def _written_file(tmp_path, size: int, writes) -> tuple[bytes, int, int]:
    """A sparse file of ``size`` after ``writes`` ((data, offset, piece)...): its bytes, the
    bytes ``pwrite_nonzero`` said it wrote, and the bytes the file holds on disk."""
    path = tmp_path / "out"
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        written = sum(pwrite_nonzero(fd, data, offset, *piece) for data, offset, *piece in writes)
    finally:
        os.close(fd)
    return path.read_bytes(), written, os.stat(path).st_blocks * 512


def test_only_the_pieces_holding_data_are_written(tmp_path):
    data = bytearray(10 * ZERO_PIECE + 100)  # ten whole pieces and a short tail
    data[3 * ZERO_PIECE + 5] = 1  # one byte in piece 3
    data[7 * ZERO_PIECE:8 * ZERO_PIECE] = os.urandom(ZERO_PIECE)  # all of piece 7
    data[-1] = 9  # the short tail
    offset = 1 << 20
    got, written, held = _written_file(tmp_path, offset + len(data), [(bytes(data), offset)])
    assert got == bytes(offset) + data
    assert written == 2 * ZERO_PIECE + 100
    assert held <= 2 * ZERO_PIECE + 4096  # the rest stayed holes


def test_all_zeros_write_nothing_and_pieces_count_from_the_offset(tmp_path):
    got, written, held = _written_file(tmp_path, 1 << 20, [(bytes(256 << 10), 0)])
    assert (got, written, held) == (bytes(1 << 20), 0, 0)
    data = bytes(4095) + b"x" + bytes(4096)  # pieces of 4 KiB: only the first holds data
    got, written, _ = _written_file(tmp_path, 1 << 20, [(data, 8192, 4096)])
    assert written == 4096 and got[8192:8192 + len(data)] == data


def test_a_piece_size_must_be_positive(tmp_path):
    with pytest.raises(ValueError):
        _written_file(tmp_path, 4096, [(b"x", 0, 0)])
