"""A lazily filled file: a manifest entry (size, chunk size, chunk list) read through the
node's chunk cache, so a reader fetches only the chunks it touches.

- ``read(offset, size)``: chunk slices from the cache (``ChunkCache.read``: a pread of the
  chunk file), zeros for holes (chunks absent from the list) and for the tail of a short
  chunk. A chunk not yet in the cache is fetched on a worker of ``Pools.fetch`` and waited
  for until the read's ``deadline``: a source that hangs past its own timeouts still gives
  the reader an error (``ReadTimedOut``), never a hung FUSE request (and behind it a hung
  guest vCPU).
- Read-ahead: each open file (``Handle``) notices sequential access (a read starting where
  the last ended) and prefetches the next ``readahead`` chunks on ``Pools.prefetch``
  (bounded: at most ``Pools.max_pending`` queued), so a streaming reader finds them in the
  cache. The kernel's own read-ahead (``read_ahead_kb`` of the mount) covers the next MiBs;
  this covers the next chunks, which are the ones the store is slow to give.
- Recording: with a ``Recorder``, the first touch of every chunk by a reader is noted in
  order, as ``[name, chunk_index]`` pairs: the prefetch list a template's restores replay.
- COW overlay (writable mounts): writes go to a local sparse file and a map of written
  ranges; reads merge the overlay over the chunks. The chunks and the store are never
  written; ``close()`` deletes the overlay.
"""
from __future__ import annotations

import bisect
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from .digests import check_sha
from .errors import ChunkError
from .sparse import ZERO_PIECE, pwrite_nonzero

DEFAULT_READ_DEADLINE = 30.0
DEFAULT_READAHEAD = 4


class ReadTimedOut(ChunkError):
    """The read's overall deadline passed before its chunks arrived."""


def _blocking_signals() -> None:
    """Worker threads leave SIGTERM/SIGINT/SIGHUP to the thread that runs the FUSE loop
    (libfuse's handlers end the loop only when the signal reaches that thread)."""
    import signal  # noqa: PLC0415

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT, signal.SIGHUP})


class Pools:
    """The thread pools lazy files share: foreground fetches (a reader waits for them, up
    to its deadline) and background prefetches (read-ahead, prefetch lists), kept apart
    so prefetching never delays a reader's own chunk, and the GETs of prefetch pieces."""

    def __init__(self, fetch_workers: int = 16, prefetch_workers: int = 4, max_pending: int = 64,
                 piece_workers: int = 4):
        self.fetch = ThreadPoolExecutor(fetch_workers, thread_name_prefix="chunkfs-fetch",
                                        initializer=_blocking_signals)
        self.prefetch = ThreadPoolExecutor(prefetch_workers, thread_name_prefix="chunkfs-prefetch",
                                           initializer=_blocking_signals)
        # prefetch pieces' GETs (chunkfs.pieces): waited for by fetches, so never on their pool
        self.pieces = ThreadPoolExecutor(piece_workers, thread_name_prefix="chunkfs-pieces",
                                         initializer=_blocking_signals)
        self.max_pending = max_pending
        self._pending = 0
        self._lock = threading.Lock()

    def try_prefetch(self, fn, *args) -> bool:
        """Queues ``fn(*args)`` unless ``max_pending`` prefetches are already queued."""
        with self._lock:
            if self._pending >= self.max_pending:
                return False
            self._pending += 1

        def run():
            try:
                fn(*args)
            finally:
                with self._lock:
                    self._pending -= 1

        try:
            self.prefetch.submit(run)
        except RuntimeError:  # shut down
            with self._lock:
                self._pending -= 1
            return False
        return True

    def shutdown(self) -> None:
        self.prefetch.shutdown(wait=False, cancel_futures=True)
        self.fetch.shutdown(wait=False, cancel_futures=True)
        self.pieces.shutdown(wait=False, cancel_futures=True)


class Recorder:
    """First-touch order of chunks across the files of one mount: ``[[name, index], ...]``."""

    def __init__(self):
        self._seen: set[tuple[str, int]] = set()
        self._order: list[list] = []
        self._lock = threading.Lock()

    def touch(self, name: str, index: int) -> None:
        key = (name, index)
        if key in self._seen:  # read without the lock: a set lookup is atomic
            return
        with self._lock:
            if key not in self._seen:
                self._seen.add(key)
                self._order.append([name, index])

    def order(self) -> list[list]:
        with self._lock:
            return [list(x) for x in self._order]


class Tally:
    """Thread-safe counts named by ``FIELDS``, reported as ``PREFIX + name``."""

    FIELDS: tuple[str, ...] = ()
    PREFIX = ""

    def __init__(self):
        for name in self.FIELDS:
            setattr(self, name, 0)
        self._lock = threading.Lock()

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def as_dict(self) -> dict:
        with self._lock:
            return {self.PREFIX + name: getattr(self, name) for name in self.FIELDS}


class Counters(Tally):
    """What one mount's readers cost: reads, bytes read, chunks and bytes fetched from the source."""

    FIELDS = ("reads", "read_bytes", "fetched_chunks", "fetched_bytes", "errors")


class Extents:
    """Disjoint, sorted ``[start, end)`` ranges (the overlay's written bytes)."""

    def __init__(self):
        self.starts: list[int] = []
        self.ends: list[int] = []

    def add(self, start: int, end: int) -> None:
        if end <= start:
            return
        # every range touching [start, end] merges into one
        i = bisect.bisect_left(self.ends, start)
        j = bisect.bisect_right(self.starts, end)
        if i < j:
            start = min(start, self.starts[i])
            end = max(end, self.ends[j - 1])
        self.starts[i:j] = [start]
        self.ends[i:j] = [end]

    def cut(self, limit: int) -> None:
        """Forgets everything at or past ``limit`` (a truncate)."""
        i = bisect.bisect_left(self.ends, limit + 1)
        del self.starts[i + 1:], self.ends[i + 1:]
        if i < len(self.starts):
            if self.starts[i] >= limit:
                del self.starts[i], self.ends[i]
            else:
                self.ends[i] = limit

    def overlapping(self, start: int, end: int) -> list[tuple[int, int]]:
        """The parts of ``[start, end)`` that are written."""
        out = []
        i = bisect.bisect_right(self.ends, start)
        while i < len(self.starts) and self.starts[i] < end:
            out.append((max(start, self.starts[i]), min(end, self.ends[i])))
            i += 1
        return out

    def __len__(self) -> int:
        return len(self.starts)


class Handle:
    """One open file's access pattern (where its last read ended)."""

    __slots__ = ("last_end", "streak")

    def __init__(self):
        self.last_end = -1
        self.streak = 0


class LazyFile:
    def __init__(self, size: int, chunk_size: int, chunks: Sequence, cache, source, *, name: str = "",
                 pools: Pools | None = None, readahead: int = DEFAULT_READAHEAD,
                 read_deadline: float = DEFAULT_READ_DEADLINE, recorder: Recorder | None = None,
                 counters: Counters | None = None, overlay: Path | None = None):
        """``chunks``: ``[[offset, length, sha], ...]`` as in a snapshot manifest (offsets
        multiples of ``chunk_size``; absent chunks are zeros). ``overlay``: a path for the
        COW overlay, which makes the file writable."""
        self.size = int(size)
        self.chunk_size = int(chunk_size)
        if self.size < 0 or self.chunk_size <= 0:
            raise ValueError("bad size or chunk size")
        self.name = name
        self.cache = cache
        self.source = source
        self.pools = pools
        self.readahead = max(0, int(readahead))
        self.read_deadline = float(read_deadline)
        self.recorder = recorder
        self.counters = counters or Counters()
        self._chunks: dict[int, tuple[int, str]] = {}
        for entry in chunks:
            offset, length, sha = int(entry[0]), int(entry[1]), check_sha(entry[2])
            if offset % self.chunk_size or not 0 < length <= self.chunk_size or offset + length > self.size:
                raise ValueError(f"chunk {entry!r} does not fit a file of {self.size} bytes in {self.chunk_size}-byte chunks")
            self._chunks[offset // self.chunk_size] = (length, sha)
        self._prefetching: set[int] = set()
        self._timed_out: dict[int, Future] = {}  # chunk index -> its fetch that outlived a read's deadline
        self._lock = threading.Lock()
        self._closed = False
        # COW overlay
        self.writable = overlay is not None
        self._overlay_path = Path(overlay) if overlay is not None else None
        self._overlay_fd = -1
        self._written = Extents()
        self._base_limit = self.size  # chunk bytes past this read as zeros (after a shrinking truncate)
        if self._overlay_path is not None:
            self._overlay_path.parent.mkdir(parents=True, exist_ok=True)
            self._overlay_fd = os.open(self._overlay_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)

    # ------------------------------------------------------------------ chunks

    @property
    def chunk_count(self) -> int:
        return -(-self.size // self.chunk_size)

    def shas(self) -> list[str]:
        return [sha for _, sha in self._chunks.values()]

    def _fetch(self, sha: str, length: int) -> bytes:
        """The source's fetch, counted for this file's mount (called only on a cache miss)."""
        data = self.source.fetch(sha, length)
        self.counters.add(fetched_chunks=1, fetched_bytes=len(data))
        return data

    def _slice(self, index: int, offset: int, size: int, deadline: float) -> bytes:
        """``size`` bytes at ``offset`` inside chunk ``index`` (zeros past its data)."""
        entry = self._chunks.get(index)
        if entry is None:
            return bytes(size)
        length, sha = entry
        if self.recorder is not None:
            self.recorder.touch(self.name, index)
        want = max(0, min(size, length - offset))
        if want == 0:
            data = b""
        elif self.cache.contains(sha):
            data = self.cache.read(sha, length, offset, want, self._fetch)
        else:
            if self.pools is None:
                data = self.cache.read(sha, length, offset, want, self._fetch)
            else:
                hung = self._timed_out.get(index)
                if hung is not None:
                    if not hung.done():
                        raise ReadTimedOut(f"chunk {index} of {self.name or 'a lazy file'}: its fetch is still "
                                           f"hanging after a read's deadline")
                    self._timed_out.pop(index, None)
                future = self.pools.fetch.submit(self.cache.read, sha, length, offset, want, self._fetch)
                try:
                    data = future.result(timeout=max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    # the kernel retries a failed read-ahead page by page: while this fetch still
                    # hangs, those retries (and other readers of the chunk) fail at once rather
                    # than after another deadline each
                    if not future.cancel():
                        self._timed_out[index] = future
                    raise ReadTimedOut(f"chunk {index} of {self.name or 'a lazy file'} did not arrive within "
                                       f"{self.read_deadline:g} s") from None
        return data if len(data) == size else data + bytes(size - len(data))

    def _base_read(self, offset: int, size: int, deadline: float) -> bytes:
        end = min(offset + size, self._base_limit)
        if end > offset:
            self._start_fetches(offset // self.chunk_size + 1, (end - 1) // self.chunk_size)
        parts = []
        pos = offset
        while pos < end:
            index, inner = divmod(pos, self.chunk_size)
            n = min(end - pos, self.chunk_size - inner)
            parts.append(self._slice(index, inner, n, deadline))
            pos += n
        if offset + size > max(end, offset):
            parts.append(bytes(offset + size - max(end, offset)))
        return b"".join(parts)

    def _start_fetches(self, first: int, last: int) -> None:
        """A read spanning several chunks (a 1 MiB request over smaller RAM chunks) has the
        missing ones after its first fetched at once on ``Pools.fetch``; each slice then joins
        its fetch (the cache shares one per chunk) instead of starting it after the last."""
        if self.pools is None:
            return
        for index in range(first, last + 1):
            entry = self._chunks.get(index)
            if entry is None or index in self._timed_out or self.cache.contains(entry[1]):
                continue
            try:
                self.pools.fetch.submit(self._fetch_quietly, entry[1], entry[0])
            except RuntimeError:  # shut down
                return

    def _fetch_quietly(self, sha: str, length: int) -> None:
        try:
            self.cache.ensure(sha, length, self._fetch)
        except ChunkError:
            pass  # the slice that waits for it fetches it again and sees the error

    # ------------------------------------------------------------------ reading

    def read(self, offset: int, size: int, handle: Handle | None = None) -> bytes:
        """Up to ``size`` bytes at ``offset`` (fewer at the end of the file). Raises a
        ``ChunkError`` (``ChunkUnavailable``, ``ChunkCorrupt``, ``CacheFull``,
        ``ReadTimedOut``) when a chunk cannot be had in time."""
        if self._closed:
            raise ChunkError("the lazy file was unmounted")
        if offset < 0 or size < 0:
            raise ValueError("negative offset or size")
        size = max(0, min(size, self.size - offset))
        if size == 0:
            return b""
        deadline = time.monotonic() + self.read_deadline
        if handle is not None:
            self._notice(handle, offset, size)
        try:
            data = self._base_read(offset, size, deadline)
            if self.writable and len(self._written):
                data = self._merge_overlay(data, offset, size)
        except ChunkError:
            self.counters.add(errors=1)
            raise
        self.counters.add(reads=1, read_bytes=len(data))
        return data

    def _notice(self, handle: Handle, offset: int, size: int) -> None:
        """Sequential reads (each starting where the last ended) start read-ahead of the
        chunks after the one the read ends in."""
        handle.streak = handle.streak + 1 if offset == handle.last_end else 0
        handle.last_end = offset + size
        if handle.streak >= 1 and self.readahead and self.pools is not None:
            last = (offset + size - 1) // self.chunk_size
            for index in range(last + 1, min(last + 1 + self.readahead, self.chunk_count)):
                self.prefetch(index)

    def prefetch(self, index: int) -> bool:
        """Makes chunk ``index`` present in the background (no-op for holes, cached or
        already queued chunks, or when the prefetch queue is full). True if queued."""
        entry = self._chunks.get(index)
        if entry is None or self.pools is None or self._closed:
            return False
        length, sha = entry
        with self._lock:
            if index in self._prefetching or self.cache.contains(sha):
                return False
            self._prefetching.add(index)
        if not self.pools.try_prefetch(self._prefetch_one, index, sha, length):
            with self._lock:
                self._prefetching.discard(index)
            return False
        return True

    def ensure(self, index: int) -> None:
        """Makes chunk ``index`` present now (prefetch lists; errors raised)."""
        entry = self._chunks.get(index)
        if entry is not None:
            self.cache.ensure(entry[1], entry[0], self._fetch)

    def _prefetch_one(self, index: int, sha: str, length: int) -> None:
        try:
            if not self._closed:
                self.cache.ensure(sha, length, self._fetch)
        except ChunkError:
            pass  # a reader that needs it will fetch it again and see the error
        finally:
            with self._lock:
                self._prefetching.discard(index)

    def copy_into(self, fd_out: int, *, workers: int, zero_piece: int = ZERO_PIECE) -> int:
        """Writes this file's bytes into the open file ``fd_out`` (already of this size, all
        zeros) at the same offsets, ``workers`` chunks at once, leaving holes: chunks the
        manifest lacks are never read, all-zero ``zero_piece`` pieces never written. What a
        restore that copies a lazy RAM file asks the daemon for, instead of reading it through
        FUSE (one kernel round trip and two more copies per MiB). Returns the bytes written;
        the first error (a ``ChunkError`` as ``read`` raises it) is raised."""
        with self._lock:
            written_over = bool(len(self._written))
        indices = range(self.chunk_count) if written_over else sorted(self._chunks)

        def one(index: int) -> int:
            offset = index * self.chunk_size
            return pwrite_nonzero(fd_out, self.read(offset, min(self.chunk_size, self.size - offset)), offset,
                                  zero_piece)

        pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="chunkfs-copy", initializer=_blocking_signals)
        try:
            return sum(future.result() for future in [pool.submit(one, index) for index in indices])
        finally:
            pool.shutdown(wait=True, cancel_futures=True)  # after an error: the rest is not started

    # ------------------------------------------------------------------ COW overlay

    def _merge_overlay(self, data: bytes, offset: int, size: int) -> bytes:
        with self._lock:  # a concurrent write changes the map and the overlay together
            parts = self._written.overlapping(offset, offset + size)
            if not parts:
                return data
            out = bytearray(data)
            for start, end in parts:
                got = os.pread(self._overlay_fd, end - start, start)
                out[start - offset:start - offset + len(got)] = got  # short: a hole that reads as zeros
        return bytes(out)

    def write(self, offset: int, data: bytes) -> int:
        if not self.writable:
            raise PermissionError("read-only lazy file")
        if self._closed:
            raise ChunkError("the lazy file was unmounted")
        if not data:
            return 0
        with self._lock:
            n = os.pwrite(self._overlay_fd, data, offset)
            self._written.add(offset, offset + n)
            self.size = max(self.size, offset + n)
        return n

    def truncate(self, length: int) -> None:
        if not self.writable:
            raise PermissionError("read-only lazy file")
        length = int(length)
        if length < 0:
            raise ValueError("negative length")
        with self._lock:
            if length < self.size:
                self._written.cut(length)
                self._base_limit = min(self._base_limit, length)
            os.ftruncate(self._overlay_fd, length)
            self.size = length

    def written_bytes(self) -> int:
        return sum(e - s for s, e in zip(self._written.starts, self._written.ends))

    def close(self) -> None:
        """Unmounted: reads fail from now on and the overlay is deleted."""
        self._closed = True
        with self._lock:
            if self._overlay_fd >= 0:
                os.close(self._overlay_fd)
                self._overlay_fd = -1
            if self._overlay_path is not None:
                self._overlay_path.unlink(missing_ok=True)
