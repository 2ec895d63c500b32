"""Guest RAM files: copies that keep holes (a snapshot's RAM into a sandbox's own file, a
paused VM's RAM between tmpfs and disk, in the background of the rest of the verb), and
giving all-zero pages back to tmpfs.

A snapshot's RAM on a lazily filled file (a FUSE mount of the node's chunkfs daemon: a snapshot
restored from the S3 store without downloading it) is copied by ``COPY_READERS`` threads at
once, each reading its own segments sequentially: every missing piece is a round trip to the
store, and one reader would wait for them one after another (docs/cluster.md, "Memory snapshots
on demand"). Better still, the node hands such a copy to the chunkfs daemon that serves the
file (``LazyCopier``, set by the agent: ``QemuDriver.set_lazy_ram_copier``), which writes the
chunks straight into the sandbox's file without a FUSE round trip per MiB; these threads are
the fallback (a daemon older than that op, or no copier).

Why the punching: when a copy-on-write VM (restored or forked) is resumed onto a RAM file of its own, QEMU's
migration loader reads every page of that new file to check it is zero, and on tmpfs a read
fault allocates: the file would hold the guest's full memory size instead of what the guest
really uses. Punching holes for the zero pages (while the VM is still stopped) undoes that.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from chunkfs.sparse import pwrite_nonzero
from vmm.errors import VMError

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
PAGE = 4096
CHUNK = 2 << 20
FUSE_SUPER_MAGIC = 0x65735546
COPY_READERS = 4
COPY_SEGMENT = 16 << 20  # what one reader copies in one go (sequential reads: read-ahead works)
COPY_BLOCK = 1 << 20  # a FUSE read is at most 1 MiB

LazyCopier = Callable[[Path, Path], bool]
"""Copies the lazily filled file ``src`` into ``dst`` (an existing file of its size, all holes)
outside this process and returns True, or returns False when it does not serve ``src`` (the
caller copies); a failed copy raises."""

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_libc.statfs.argtypes = [ctypes.c_char_p, ctypes.c_void_p]


def on_fuse(path) -> bool:
    """The file lives on a FUSE file system (statfs's f_type, the first field of struct statfs)."""
    buf = ctypes.create_string_buffer(256)
    if _libc.statfs(os.fsencode(str(path)), buf) != 0:
        return False
    return int.from_bytes(buf.raw[:ctypes.sizeof(ctypes.c_long)], "little") == FUSE_SUPER_MAGIC


def punch_hole(fd: int, offset: int, length: int) -> None:
    if _libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def zero_runs(fd: int, size: int):
    """(offset, length) of the runs of all-zero pages; pread never allocates tmpfs holes."""
    zero_chunk, zero_page = bytes(CHUNK), bytes(PAGE)
    start = None
    for off in range(0, size, CHUNK):
        data = os.pread(fd, CHUNK, off)
        if data == zero_chunk[:len(data)]:
            if start is None:
                start = off
            continue
        for i in range(0, len(data), PAGE):
            page = data[i:i + PAGE]
            if page == zero_page[:len(page)]:
                if start is None:
                    start = off + i
            elif start is not None:
                yield start, off + i - start
                start = None
    if start is not None:
        yield start, size - start


def punch_zero_pages(path) -> int:
    """Deallocates every all-zero page of `path` (the VM using it must be stopped); returns bytes."""
    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        freed = 0
        for offset, length in zero_runs(fd, size):
            punch_hole(fd, offset, length)
            freed += length
        return freed
    finally:
        os.close(fd)


def allocated(path) -> int:
    """Bytes a (sparse) file really holds."""
    return os.stat(path).st_blocks * 512


def copy_sparse_into(src, fd_out: int) -> int:
    """Copies the data extents of `src` into the open file `fd_out` at the same offsets (holes
    stay holes; fd_out must already have its final size). In-kernel copy: copy_file_range, or
    sendfile across filesystems. Returns the bytes copied."""
    fd_in = os.open(src, os.O_RDONLY)
    try:
        size = os.fstat(fd_in).st_size
        copied, off = 0, 0
        use_cfr = hasattr(os, "copy_file_range")
        while off < size:
            try:
                start = os.lseek(fd_in, off, os.SEEK_DATA)
            except OSError as e:
                if e.errno == errno.ENXIO:  # only a hole is left
                    break
                raise
            end = os.lseek(fd_in, start, os.SEEK_HOLE)
            pos = start
            while pos < end:
                n = 0
                if use_cfr:
                    try:
                        n = os.copy_file_range(fd_in, fd_out, end - pos, pos, pos)
                    except OSError as e:
                        if e.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                            raise
                        use_cfr = False
                        continue
                else:
                    os.lseek(fd_out, pos, os.SEEK_SET)
                    n = os.sendfile(fd_out, fd_in, pos, end - pos)
                if n <= 0:
                    raise OSError(errno.EIO, f"short copy of {src} at {pos}")
                pos += n
                copied += n
            off = end
        return copied
    finally:
        os.close(fd_in)


def copy_parallel_into(src, fd_out: int, readers: int = COPY_READERS, segment: int = COPY_SEGMENT) -> int:
    """Copies `src` into `fd_out` (already of its final size) with `readers` threads, each taking
    the next `segment` of the file and reading it in order with its own descriptor; all-zero
    pieces are skipped (holes read as zeros, without a fetch, on a lazy file). Returns the bytes
    written. The first error stops the others and is raised."""
    size = os.stat(src).st_size
    lock = threading.Lock()
    state = {"next": 0, "written": 0, "error": None}

    def take() -> int | None:
        with lock:
            if state["error"] is not None or state["next"] >= size:
                return None
            start = state["next"]
            state["next"] += segment
            return start

    def reader() -> None:
        written = 0
        try:
            fd_in = os.open(src, os.O_RDONLY)
        except OSError as e:
            with lock:
                state["error"] = state["error"] or e
            return
        try:
            while (start := take()) is not None:
                for off in range(start, min(start + segment, size), COPY_BLOCK):
                    data = os.pread(fd_in, COPY_BLOCK, off)
                    if len(data) != min(COPY_BLOCK, size - off):
                        raise OSError(errno.EIO, f"short read of {src} at {off}")
                    written += pwrite_nonzero(fd_out, data, off)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            with lock:
                state["error"] = state["error"] or e
        finally:
            os.close(fd_in)
            with lock:
                state["written"] += written

    threads = [threading.Thread(target=reader, daemon=True, name=f"ramcopy-reader-{i}") for i in range(readers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if state["error"] is not None:
        raise state["error"]
    return state["written"]


def copy_into(src, fd_out: int, dst: Path | None = None, copier: LazyCopier | None = None) -> str:
    """A copy of a RAM file that keeps holes, into the open ``fd_out`` (the file ``dst``): from
    a lazily filled (FUSE) file (which reports no holes) by ``copier`` if it serves it, else in
    parallel skipping zeros; from any other file in the kernel (``copy_sparse_into``). Returns
    how: ``daemon``, ``readers`` or ``kernel``."""
    if not on_fuse(src):
        copy_sparse_into(src, fd_out)
        return "kernel"
    if copier is not None and dst is not None and copier(Path(src), Path(dst)):
        return "daemon"
    copy_parallel_into(src, fd_out)
    return "readers"


class RamCopy:
    """A sparse copy of a snapshot's RAM into a new file, running in a thread. The file gets
    its final size before the thread starts, so QEMU may map it meanwhile; it must not run the
    guest before wait() returned."""

    def __init__(self, src: Path, dst: Path, size: int, copier: LazyCopier | None = None):
        self.dst = dst
        self.copier = copier
        self.how = ""  # daemon, readers or kernel (copy_into)
        self.error: BaseException | None = None
        self.waited_ms = 0.0
        fd = os.open(dst, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self.t0 = time.monotonic()
        self.t1 = self.t0
        self.thread = threading.Thread(target=self._run, args=(src, fd), daemon=True, name=f"ramcopy-{dst.name}")
        self.thread.start()

    def _run(self, src: Path, fd: int) -> None:
        try:
            self.how = copy_into(src, fd, self.dst, self.copier)
        except BaseException as e:
            self.error = e
        finally:
            os.close(fd)
            self.t1 = time.monotonic()

    @property
    def readers(self) -> int:
        """Threads of this process that copied: 0 when the chunkfs daemon did."""
        return {"readers": COPY_READERS, "kernel": 1}.get(self.how, 0)

    @property
    def elapsed_ms(self) -> float:
        return (self.t1 - self.t0) * 1e3

    def wait(self, raise_error: bool = True) -> None:
        t = time.monotonic()
        self.thread.join()
        self.waited_ms = (time.monotonic() - t) * 1e3
        if raise_error and self.error is not None:
            raise VMError(f"copying RAM into {self.dst} failed: {self.error}")

