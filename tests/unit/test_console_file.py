"""The serial console file's bound (vmm.qemu.console): a hole over all but the newest bytes,
offsets kept, and failure messages that read only its end."""
import os

from vmm.qemu import console
from vmm.qemu.process import console_tail

KIB = 1 << 10


def test_trim_keeps_the_newest_bytes_at_their_offsets_and_frees_the_rest(tmp_path):
    path = tmp_path / "console.log"
    data = b"".join(b"line %07d\n" % i for i in range(200_000))  # 2.6 MB
    path.write_bytes(data)
    freed = console.trim(path, 256 * KIB)
    assert freed > 2_000 * KIB
    assert console.allocated(path) <= 256 * KIB + console.BLOCK
    assert path.stat().st_size == len(data)  # QEMU writes on at its own offset
    with path.open("rb") as f:
        start = console.first_data(f.fileno(), 0)
        assert len(data) - start <= 256 * KIB + console.BLOCK and start % console.BLOCK == 0
        f.seek(start)
        assert f.read() == data[start:]  # the newest bytes, unchanged
    assert console.trim(path, 256 * KIB) == 0  # nothing more to give back
    with path.open("ab") as f:  # the guest goes on writing: trimmed again the next round
        f.write(b"x" * (512 * KIB))
    assert console.trim(path, 256 * KIB) >= 256 * KIB
    assert console.allocated(path) <= 256 * KIB + console.BLOCK


def test_trim_of_a_small_or_missing_console_does_nothing(tmp_path):
    path = tmp_path / "console.log"
    path.write_bytes(b"boot\n")
    assert console.trim(path, 256 * KIB) == 0 and path.read_bytes() == b"boot\n"
    assert console.trim(tmp_path / "missing.log", 0) == 0


def test_tail_reads_only_the_end_of_a_huge_sparse_console(tmp_path):
    path = tmp_path / "console.log"
    with path.open("wb") as f:
        f.truncate(50 << 30)  # 50 GiB apparent, all hole: reading it whole would never end
        f.seek(50 << 30)
        f.write(b"".join(b"panic line %d\n" % i for i in range(100)))
    assert console_tail(path, lines=3).splitlines() == ["panic line 97", "panic line 98", "panic line 99"]
    assert console.tail(tmp_path / "missing.log") == ""


def test_first_data_skips_a_hole_to_the_end(tmp_path):
    path = tmp_path / "console.log"
    with path.open("wb") as f:
        f.truncate(1 << 20)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert console.first_data(fd, 0) == 1 << 20
    finally:
        os.close(fd)
