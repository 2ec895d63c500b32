"""The FUSE file system of lazy files: ``<mountpoint>/<mount_id>/<name>``.

The root lists the mounts (directories), each mount directory lists its files; sizes are
exact, files are read-only (EROFS on a write or truncate) unless their mount is writable (a
COW overlay each: ``LazyFile``). A read whose chunk cannot be had (the source is down or
too slow, the chunk stays corrupt after the cache's refetches, the cache is full of pinned
chunks, the read's deadline passed) fails with EIO, promptly: the reader (QEMU, and behind
it a guest) sees an I/O error, never a hang.

Binding: ``mfusepy`` (ctypes over libfuse3's high-level API, libfuse's worker threads). It
was chosen over ``pyfuse3`` (Cython, trio) by a micro-benchmark on the 2-vCPU development
machine, one file system serving a file from a page-cached local file, kernel page cache on
(``keep_cache``), the mount's ``read_ahead_kb`` at 4096, each run on a fresh mount:

    cold reads through FUSE                          mfusepy            pyfuse3
    -----------------------------------------------  -----------------  ---------------
    sequential 1 GiB, 4 MiB reads, 1 thread          1128 MiB/s         727 MiB/s
    sequential 1 GiB, 4 MiB reads, 4 threads         1367 MiB/s         520 MiB/s
    the same again (page cache hits), 4 threads      5537 MiB/s         2263 MiB/s
    random 4 KiB reads/s, 1 / 8 / 32 threads         20.5k/14.0k/25.6k  5.5k/5.9k/5.3k

pyfuse3 serves requests from one trio thread and must hand every blocking cache read to a
worker thread (``trio.to_thread``), which costs more than the GIL does for ctypes
callbacks; mfusepy's callbacks run on libfuse's own threads and call the (thread-safe,
blocking) chunk cache directly. mfusepy is also pure Python (only the libfuse3 shared
library, the ``fuse3`` package, is needed at run time; no compiler, no libfuse3-dev).
Requests are up to 1 MiB (libfuse3 negotiates 256 pages); with the kernel's default
``read_ahead_kb`` of 128 sequential reads stayed near 200 MiB/s with either binding (a
first run, with a serving function that also copied its data), hence the larger window.

Concurrency: up to ``MAX_THREADS`` libfuse workers and ``MAX_BACKGROUND`` kernel background
(read-ahead) requests, instead of libfuse's 10 and the kernel's 12: a read waiting on a
slow fetch holds one of each, and must not queue reads of cached chunks behind it.

Page cache: every open sets ``keep_cache`` unless the path now names a different lazy file
than the last time it was opened (a mount id unmounted and mounted again): then the
kernel drops the inode's cached pages, so old bytes are never served for a new file."""
from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time

import mfusepy

from .errors import ChunkError
from .lazyfile import Counters, Handle, LazyFile, Recorder

log = logging.getLogger(__name__)

READ_AHEAD_KB = 4096
MAX_THREADS = 64  # libfuse's workers: each read waiting for a fetch holds one
MAX_BACKGROUND = 48


class Mount:
    """One mount request's files, under ``<mountpoint>/<mount_id>``."""

    def __init__(self, mount_id: str, files: dict[str, LazyFile], *, writable: bool = False,
                 recorder: Recorder | None = None, counters: Counters | None = None, chunk_size: int = 0,
                 pieces=None):
        """``pieces``: its ``chunkfs.pieces.PrefetchPieces`` (closed with the mount), if any."""
        self.id = mount_id
        self.pieces = pieces
        self.files = files
        self.writable = writable
        self.recorder = recorder
        self.counters = counters or Counters()
        self.chunk_size = chunk_size
        self.created_ns = time.time_ns()
        self.prefetch_state = {"queued": 0, "done": 0, "failed": 0, "finished": True}
        self.closed = threading.Event()

    def close(self) -> None:
        self.closed.set()
        if self.pieces is not None:
            self.pieces.close()
        for f in self.files.values():
            f.close()

    def describe(self) -> dict:
        return {"mount_id": self.id, "writable": self.writable, "record": self.recorder is not None,
                "chunk_size": self.chunk_size,
                "files": {name: {"size": f.size, "chunk_size": f.chunk_size} for name, f in sorted(self.files.items())}}

    def stats(self) -> dict:
        return {**self.counters.as_dict(), "prefetch": dict(self.prefetch_state),
                "recorded": self.recorder.order() if self.recorder is not None else None,
                "written_bytes": sum(f.written_bytes() for f in self.files.values())}


def _eio(what: str, exc: Exception) -> mfusepy.FuseOSError:
    log.warning("%s: %s", what, exc)
    return mfusepy.FuseOSError(errno.EIO)


class ChunkFS(mfusepy.Operations):
    use_ns = True

    def __init__(self):
        self._mounts: dict[str, Mount] = {}
        self._lock = threading.Lock()
        self._handles: dict[int, tuple[LazyFile, Handle, Mount]] = {}
        self._next_fh = 1
        self._last_opened: dict[str, int] = {}  # path -> id() of the LazyFile opened last time
        self._uid, self._gid = os.getuid(), os.getgid()
        self._started_ns = time.time_ns()

    def init_with_config(self, conn, config):
        """More requests in flight than the kernel's default 12 background (read-ahead)
        requests: a chunk being fetched must not hold up reads of chunks already cached."""
        if conn is not None:
            conn.max_background = MAX_BACKGROUND
            conn.congestion_threshold = MAX_BACKGROUND * 3 // 4

    # ------------------------------------------------------------------ mounts

    def add(self, mount: Mount) -> None:
        with self._lock:
            if mount.id in self._mounts:
                raise FileExistsError(mount.id)
            self._mounts[mount.id] = mount

    def remove(self, mount_id: str) -> Mount | None:
        with self._lock:
            mount = self._mounts.pop(mount_id, None)
        if mount is not None:
            mount.close()
        return mount

    def mounts(self) -> dict[str, Mount]:
        with self._lock:
            return dict(self._mounts)

    def get(self, mount_id: str) -> Mount | None:
        with self._lock:
            return self._mounts.get(mount_id)

    def _resolve(self, path: str) -> tuple[Mount | None, LazyFile | None]:
        parts = [p for p in path.split("/") if p]
        if not parts:
            return None, None
        mount = self.get(parts[0])
        if mount is None or len(parts) > 2:
            raise mfusepy.FuseOSError(errno.ENOENT)
        if len(parts) == 1:
            return mount, None
        f = mount.files.get(parts[1])
        if f is None:
            raise mfusepy.FuseOSError(errno.ENOENT)
        return mount, f

    def _file(self, path: str) -> tuple[Mount, LazyFile]:
        mount, f = self._resolve(path)
        if f is None:
            raise mfusepy.FuseOSError(errno.EISDIR if mount is not None or path.strip("/") == "" else errno.ENOENT)
        return mount, f

    # ------------------------------------------------------------------ metadata

    def getattr(self, path, fh=None):
        mount, f = self._resolve(path)
        if mount is None:
            return {"st_mode": stat.S_IFDIR | 0o755, "st_nlink": 2 + len(self.mounts()), "st_uid": self._uid,
                    "st_gid": self._gid, "st_mtime": self._started_ns, "st_ctime": self._started_ns,
                    "st_atime": self._started_ns}
        t = mount.created_ns
        common = {"st_uid": self._uid, "st_gid": self._gid, "st_mtime": t, "st_ctime": t, "st_atime": t}
        if f is None:
            return {**common, "st_mode": stat.S_IFDIR | (0o755 if mount.writable else 0o555), "st_nlink": 2}
        return {**common, "st_mode": stat.S_IFREG | (0o644 if mount.writable else 0o444), "st_nlink": 1,
                "st_size": f.size, "st_blocks": (f.size + 511) // 512, "st_blksize": 1 << 20}

    def readdir(self, path, fh):
        mount, f = self._resolve(path)
        if f is not None:
            raise mfusepy.FuseOSError(errno.ENOTDIR)
        names = sorted(self.mounts()) if mount is None else sorted(mount.files)
        return [".", "..", *names]

    def statfs(self, path):
        size = sum(f.size for m in self.mounts().values() for f in m.files.values())
        return {"f_bsize": 4096, "f_frsize": 4096, "f_blocks": size // 4096, "f_bfree": 0, "f_bavail": 0,
                "f_files": sum(len(m.files) for m in self.mounts().values()), "f_ffree": 0, "f_namemax": 255}

    def access(self, path, amode):
        mount, f = self._resolve(path)
        if amode & os.W_OK and (mount is None or not mount.writable):
            raise mfusepy.FuseOSError(errno.EROFS)
        return 0

    # ------------------------------------------------------------------ files

    def open(self, path, fi):
        mount, f = self._file(path)
        if (fi.flags & os.O_ACCMODE) != os.O_RDONLY and not mount.writable:
            raise mfusepy.FuseOSError(errno.EROFS)
        with self._lock:
            fh = self._next_fh
            self._next_fh += 1
            self._handles[fh] = (f, Handle(), mount)
            same = self._last_opened.get(path) == id(f)
            self._last_opened[path] = id(f)
        fi.fh = fh
        fi.keep_cache = 1 if same else 0
        return 0

    def _handle(self, path: str, fi) -> tuple[LazyFile, Handle | None, Mount]:
        entry = self._handles.get(fi.fh) if fi is not None else None
        if entry is not None:
            return entry
        mount, f = self._file(path)
        return f, None, mount

    def read(self, path, size, offset, fi):
        f, handle, mount = self._handle(path, fi)
        try:
            return f.read(offset, size, handle)
        except ChunkError as exc:
            raise _eio(f"read of {path} at {offset} (+{size})", exc) from None
        except OSError as exc:  # the overlay file
            raise _eio(f"read of {path} at {offset} (+{size})", exc) from None

    def write(self, path, data, offset, fi):
        f, _, mount = self._handle(path, fi)
        if not mount.writable:
            raise mfusepy.FuseOSError(errno.EROFS)
        try:
            return f.write(offset, data)
        except (ChunkError, OSError) as exc:
            raise _eio(f"write of {path} at {offset}", exc) from None

    def truncate(self, path, length, fh=None):
        mount, f = self._file(path)
        if not mount.writable:
            raise mfusepy.FuseOSError(errno.EROFS)
        try:
            f.truncate(length)
        except OSError as exc:
            raise _eio(f"truncate of {path}", exc) from None
        return 0

    def release(self, path, fi):
        with self._lock:
            self._handles.pop(fi.fh, None)
        return 0

    def flush(self, path, fi):
        return 0

    def fsync(self, path, datasync, fi):
        return 0

    def utimens(self, path, times=None):
        mount, _ = self._resolve(path)
        if mount is None or not mount.writable:
            raise mfusepy.FuseOSError(errno.EROFS)
        return 0

    def chmod(self, path, mode):
        raise mfusepy.FuseOSError(errno.EROFS)

    def chown(self, path, uid, gid):
        raise mfusepy.FuseOSError(errno.EROFS)

    def create(self, path, mode, fi=None):
        raise mfusepy.FuseOSError(errno.EROFS)

    def mkdir(self, path, mode):
        raise mfusepy.FuseOSError(errno.EROFS)

    def unlink(self, path):
        raise mfusepy.FuseOSError(errno.EROFS)

    def rmdir(self, path):
        raise mfusepy.FuseOSError(errno.EROFS)

    def rename(self, old, new):
        raise mfusepy.FuseOSError(errno.EROFS)


def fuse_options(*, allow_other: bool | None = None, max_threads: int = MAX_THREADS) -> dict:
    """The mount options: multithreaded (libfuse's workers), short entry and attribute
    timeouts (mounts come and go; sizes of writable files change), page cache kept per open
    (``keep_cache`` in ``open``), other users (QEMU as another user) allowed when root mounts."""
    if allow_other is None:
        allow_other = os.geteuid() == 0
    options = {"fsname": "chunkfs", "subtype": "chunkfs", "entry_timeout": 1.0, "attr_timeout": 1.0,
               "negative_timeout": 0.0, "max_threads": max_threads, "default_permissions": True}
    if allow_other:
        options["allow_other"] = True
    return options


def set_read_ahead(mountpoint: str, kib: int = READ_AHEAD_KB) -> bool:
    """Widens the mount's read-ahead window (``/sys/class/bdi/<dev>/read_ahead_kb``; the
    kernel offers FUSE 128 KiB). Best effort: False where sysfs is read-only."""
    dev = os.stat(mountpoint).st_dev
    try:
        with open(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb", "w") as f:
            f.write(str(int(kib)))
        return True
    except OSError as exc:
        log.info("could not set read_ahead_kb of %s: %s", mountpoint, exc)
        return False


def run(fs: ChunkFS, mountpoint: str, **options) -> None:
    """Mounts ``fs`` on ``mountpoint`` and serves it until unmounted or SIGTERM/SIGINT/SIGHUP
    (libfuse's handlers end the loop; the caller's thread must be the main thread)."""
    mfusepy.FUSE(fs, mountpoint, foreground=True, raw_fi=True, **{**fuse_options(), **options})
