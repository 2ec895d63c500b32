"""A lazily mounted snapshot whose store stops answering (issue 24), with a real chunkfs daemon
and a moto server SIGSTOPped: the node's daemon runs with ``AENV_CHUNK_READ_DEADLINE`` (the
store's ``chunk_read_deadline``), a read of a chunk it lacks fails with EIO within that deadline
(not the default 30 s) while cached chunks still read, and the node's VM watch finds the mount's
failed reads for the files a VM uses (what names the store in the sandbox's error). The same on
a real VM: tests/vmm/test_lazy_restore_vm.py."""
from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest

from agent import vm_watch
from harness.moto_s3 import silenced
from tests.unit.test_lazy_restore import CHUNK, _committed, _ram, _store, short_tmp  # noqa: F401
from tests.unit.test_snapshot_store_s3 import s3, s3_endpoint  # noqa: F401

pytestmark = pytest.mark.xdist_group("chunkfs")

DEADLINE = 1.5


def _pread(path: Path, offset: int, size: int) -> bytes:
    """One read at ``offset``, no read-ahead by the kernel (chunkfs's own needs sequential reads)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return os.pread(fd, size, offset)
    finally:
        os.close(fd)


def test_a_silent_store_fails_reads_at_the_nodes_deadline_and_the_watch_sees_the_mount(s3, s3_endpoint, short_tmp):
    ram = _ram(chunks=96)
    images, _ = _committed(s3, short_tmp, "lz-away", ram)
    store = _store(s3, short_tmp / "n2", images, chunk_read_deadline=DEADLINE)
    path = store.local_dir("lz-away")
    pid = store.lazy.running_client().ping()["pid"]
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert argv[argv.index(b"--read-deadline") + 1] == b"1.5"
    memory = path / "memory.ram"
    assert _pread(memory, 10, 100) == ram[10:110]  # its chunk is cached from now on
    uses = {str(memory), "/elsewhere/vmlinuz"}
    assert vm_watch.lazy_read_errors(store.lazy, uses) == {}

    far = 80 * CHUNK + 7
    with silenced(s3_endpoint):
        t0 = time.monotonic()
        with pytest.raises(OSError) as exc:
            _pread(memory, far, 100)
        took = time.monotonic() - t0
        assert exc.value.errno == errno.EIO
        assert _pread(memory, 10, 100) == ram[10:110]  # what the node holds still reads
    assert took < 15, f"the read waited {took:.1f} s: not the node's {DEADLINE} s deadline"
    errors = store.lazy.mount_stats("lz-away")["errors"]
    assert errors >= 1 and vm_watch.lazy_read_errors(store.lazy, uses) == {"lz-away": errors}
    assert vm_watch.lazy_read_errors(store.lazy, {"/elsewhere/vmlinuz"}) == {}  # a VM that reads none of it
    deadline = time.monotonic() + 30  # the store is back: so are the reads, once the fetch begun
    while True:                       # while it was silent has ended (it fails them until then)
        try:
            assert _pread(memory, far, 100) == ram[far:far + 100]
            break
        except OSError:
            assert time.monotonic() < deadline, "the store is back and the read still fails"
            time.sleep(0.2)
