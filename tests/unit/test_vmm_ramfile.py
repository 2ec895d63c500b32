"""vmm.qemu.ramfile: zero pages of a RAM file become holes; data pages stay byte for byte."""
import os

from vmm.qemu.ramfile import PAGE, punch_zero_pages, zero_runs


def test_zero_pages_are_punched_and_data_kept(tmp_path):
    path = tmp_path / "ram"
    size = 8 << 20
    with open(path, "wb") as f:
        f.write(bytes(size))  # fully allocated zeros
        for off in (0, 5 * PAGE, (2 << 20) + 3 * PAGE, size - PAGE):
            f.seek(off)
            f.write(b"\x01" + bytes(PAGE - 2) + b"\x02")
    before = path.read_bytes()
    assert os.stat(path).st_blocks * 512 >= size
    fd = os.open(path, os.O_RDONLY)
    try:
        runs = list(zero_runs(fd, size))
    finally:
        os.close(fd)
    assert runs[0] == (PAGE, 4 * PAGE) and runs[-1][0] + runs[-1][1] == size - PAGE
    freed = punch_zero_pages(path)
    assert freed == size - 4 * PAGE
    assert path.read_bytes() == before
    assert os.stat(path).st_blocks * 512 <= 4 * PAGE + (64 << 10)  # only the data pages (+fs slack)


def test_copy_sparse_into_keeps_offsets_and_holes(tmp_path):
    from vmm.qemu.ramfile import copy_sparse_into

    src = tmp_path / "src"
    size = 16 << 20
    with open(src, "wb") as f:
        f.truncate(size)
        for off in (0, 3 << 20, size - PAGE):
            f.seek(off)
            f.write(os.urandom(PAGE * 2 if off < size - PAGE else PAGE))
    dst = tmp_path / "dst"
    fd = os.open(dst, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        copied = copy_sparse_into(src, fd)
    finally:
        os.close(fd)
    assert dst.read_bytes() == src.read_bytes()
    assert copied < 1 << 20  # only the data extents, not the 16 MiB of holes
    assert os.stat(dst).st_blocks * 512 < 1 << 20


def test_copy_parallel_into_equals_the_source_and_skips_zero_pieces(tmp_path):
    """The copy of a RAM file on a lazy mount: several readers, every byte right, all-zero
    pieces left as holes, a reader's error raised (here a source shorter than it claimed)."""
    from unittest import mock

    import pytest

    from chunkfs.sparse import ZERO_PIECE
    from vmm.qemu.ramfile import copy_parallel_into, on_fuse

    src = tmp_path / "src"
    size = (40 << 20) + 3 * PAGE  # segments of 4 MiB below: ten full, one short
    with open(src, "wb") as f:
        f.truncate(size)
        for off in (0, (5 << 20) + 7, (17 << 20) - 10, size - 100):
            f.seek(off)
            f.write(os.urandom(100))
        f.seek(9 << 20)
        f.write(bytes(1 << 20))  # written zeros: nothing to copy
    dst = tmp_path / "dst"
    fd = os.open(dst, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        written = copy_parallel_into(src, fd, readers=3, segment=4 << 20)
    finally:
        os.close(fd)
    assert dst.read_bytes() == src.read_bytes()
    assert written <= 6 * ZERO_PIECE  # the pieces holding data (one write straddles two)
    assert os.stat(dst).st_blocks * 512 <= 6 * ZERO_PIECE + (64 << 10)
    assert on_fuse(src) is False

    fd = os.open(tmp_path / "dst2", os.O_CREAT | os.O_RDWR, 0o600)
    real = os.stat
    try:  # stat says 40 MiB more than the file holds: a reader's short read stops the copy
        with mock.patch("vmm.qemu.ramfile.os.stat",
                        lambda p, *a, **k: os.stat_result((*real(p)[:6], size + (40 << 20), *real(p)[7:]))):
            with pytest.raises(OSError, match="short read"):
                copy_parallel_into(src, fd, readers=4, segment=4 << 20)
    finally:
        os.close(fd)
