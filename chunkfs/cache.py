"""The node's one chunk cache: content-addressed chunk files under a hard byte bound, with
2Q eviction, surviving restarts.

Layout: ``<root>/<sha[:2]>/<sha>`` (a chunk, named by the sha256 of its bytes),
``<root>/<sha[:2]>/<sha>.tmp-<rand>`` (being written; renamed into place when complete),
``<root>/state.json`` (the queues' order, ghosts and pins, written atomically every
``state_interval`` seconds when something changed and at close) and ``<root>/.lock``
(flock: one cache per directory).

Eviction is 2Q (Johnson & Shasha, VLDB 1994), in bytes:

- **A1in**, a FIFO of chunks touched once, kept to ``A1IN_FRACTION`` (25 %) of the bound
  when something must go. A FUSE reader hits one 4 MiB chunk many times in a row (the kernel
  reads it in 128 KiB pieces, read-ahead asks for its neighbours): those hits are one use, so a
  hit inside A1in does not make a chunk hot unless the chunk has already travelled half way
  through A1in (``A1IN_FRACTION/2`` of the bound inserted after it): past the burst, a second
  use is real re-use.
- **Am**, an LRU of re-used chunks: the other 75 %, which a one-off scan (a template read once
  from end to end, a restore of a sandbox never seen again) cannot flush: the scan's chunks
  pass through A1in and out again.
- **A1out**, ghost keys (no data) of chunks evicted from A1in, up to ``A1OUT_FRACTION`` (50 %)
  of the bound in former bytes: a chunk fetched again while its ghost is remembered was re-used
  within about half a cache of traffic, and goes straight to Am.

These are the paper's recommended sizes (Kin 25 %, Kout 50 %); a smaller A1in would evict a
chunk before a reader is done with it, a larger one shrinks what scans cannot touch.

Bound: ``size_bytes`` (the chunks' lengths plus the space reserved by inserts in progress)
never exceeds ``limit_bytes``: an insert reserves its length under the lock, evicting first,
and ``CacheFull`` is raised when only pinned chunks are left to evict (space held by other
inserts still writing is waited for: it becomes evictable in milliseconds). Pins (``pin(owner,
shas)``) hold chunks that could not be fetched again (a store that is going away, a running
sandbox's only copy); they persist across restarts until their owner unpins.

Integrity: a fetched chunk is stored only if its sha256 and length match; wrong bytes are
fetched again ``retries`` more times, then ``ChunkCorrupt``. Chunk files are not fsynced:
after a restart every chunk is unverified until first read, when its digest is checked
again (a torn or damaged file is dropped and fetched), so bytes are never served unverified.

Single flight: threads that miss the same chunk wait for one fetch (or one verification).
Thread-safe; one process per directory (the node's chunkfs daemon)."""
from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from .digests import SHA, check_sha, digest
from .errors import CacheFull, CacheInUse, ChunkCorrupt, ChunkError, ChunkUnavailable

log = logging.getLogger(__name__)

FORMAT = "aenv-chunk-cache/1"
STATE = "state.json"
# How long an insert waits for others still writing their chunk files when only their
# reservations fill the cache (each takes milliseconds; the bound is for a stuck disk).
RESERVED_WAIT = 10.0
RETRIES = 2  # fetches after the first when a source gives wrong bytes (then ChunkCorrupt: EIO)
A1IN_FRACTION = 0.25
A1OUT_FRACTION = 0.5

Fetch = Callable[[str, int], bytes]  # a ChunkSource's fetch(sha, length)


@dataclass
class _Entry:
    size: int
    hot: bool  # in Am (else A1in)
    mark: int  # A1in bytes inserted up to and including this chunk
    verified: bool  # digest checked since this process started


class _Flight:
    """One fetch (or verification) of a chunk that other threads wait for."""

    def __init__(self):
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.fetched = False


class ChunkCache:
    def __init__(self, root: Path, limit_bytes: int, *, retries: int = RETRIES, state_interval: float = 30.0,
                 a1in_fraction: float = A1IN_FRACTION, a1out_fraction: float = A1OUT_FRACTION):
        """``retries``: fetches after the first when the source gives wrong bytes.
        ``state_interval``: seconds between state saves (0: only at ``flush``/``close``)."""
        self.root = Path(root).absolute()
        self.limit_bytes = int(limit_bytes)
        if self.limit_bytes <= 0:
            raise ValueError("the chunk cache needs a positive limit")
        self.retries = max(0, int(retries))
        self.kin = max(1, int(self.limit_bytes * a1in_fraction))
        self.kout = int(self.limit_bytes * a1out_fraction)
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock_file = open(self.root / ".lock", "a+")  # noqa: SIM115 - held until close
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise CacheInUse(f"the chunk cache {self.root} is open elsewhere") from None
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)  # an insert in flight finished or gave up
        self._reserved = 0  # bytes reserved by inserts still writing their file
        self._save_lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._a1in: OrderedDict[str, None] = OrderedDict()  # oldest first
        self._am: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self._a1out: OrderedDict[str, int] = OrderedDict()  # ghost sha -> its size, oldest first
        self._a1in_bytes = 0
        self._a1out_bytes = 0
        self._size = 0
        self._inserted = 0  # bytes ever inserted into A1in (the promotion window's clock)
        self._flights: dict[str, _Flight] = {}
        self._pins: dict[str, set[str]] = {}
        self._pin_count: dict[str, int] = {}
        self._counts = {"hits": 0, "misses": 0, "evictions": 0, "fetched_bytes": 0, "corrupt": 0}
        self._dirty = False
        self._closed = threading.Event()
        self._load()
        self._saver = None
        if state_interval and state_interval > 0:
            self._saver = threading.Thread(target=self._save_loop, args=(float(state_interval),),
                                           name="chunk-cache-state", daemon=True)
            self._saver.start()

    # ------------------------------------------------------------------ reading

    def get(self, sha: str, length: int, fetch: Fetch) -> bytes:
        """The whole chunk (``length`` bytes), from the cache or fetched, verified."""
        return self._serve(sha, length, 0, length, fetch)

    def read(self, sha: str, length: int, offset: int, size: int, fetch: Fetch) -> bytes:
        """``size`` bytes at ``offset`` of the chunk (fewer past its end), read from the chunk
        file with pread: the rest of the chunk is not loaded."""
        if offset < 0 or size < 0:
            raise ValueError("negative offset or size")
        size = max(0, min(size, length - offset))
        return self._serve(sha, length, offset, size, fetch)

    def ensure(self, sha: str, length: int, fetch: Fetch) -> None:
        """Makes the chunk present (read-ahead, prefetch) without reading it and without
        counting a hit or miss: the reader that comes later does."""
        self._acquire(check_sha(sha), int(length), fetch, count=False)

    def contains(self, sha: str) -> bool:
        with self._lock:
            return sha in self._entries

    def peek(self, sha: str) -> bytes | None:
        """The chunk's bytes if the cache holds it (verified, as every read), else None:
        never a fetch, and neither a hit nor a use (serving a peer, ``chunkfs.peer_server``,
        must not make a chunk hot here). A chunk evicted meanwhile or damaged on disk is None."""
        check_sha(sha)
        with self._lock:
            entry = self._entries.get(sha)
            if entry is None:
                return None
            verified = entry.verified
        try:
            with open(self._path(sha), "rb") as f:
                data = f.read(entry.size + 1)
        except FileNotFoundError:
            return None
        if len(data) != entry.size:
            return None
        if not verified:  # first read since a restart: as _lead checks it (a reader's fetch drops a bad one)
            if digest(data) != sha:
                return None
            with self._lock:
                if self._entries.get(sha) is entry:
                    entry.verified = True
        return data

    def _serve(self, sha: str, length: int, offset: int, size: int, fetch: Fetch) -> bytes:
        check_sha(sha)
        length = int(length)
        count = True
        for _ in range(5):
            got = self._acquire(sha, length, fetch, count, open_file=True)
            count = False
            if isinstance(got, bytes):
                return got[offset:offset + size]
            try:  # the chunk file, opened while its entry was held: an eviction since cannot take it
                out = os.pread(got, size, offset) if size else b""
            finally:
                os.close(got)
            if len(out) == size:
                return out
            log.warning("chunk file %s is shorter than its entry: dropped", self._path(sha))
            with self._lock:
                self._drop(sha, corrupt=True)
        raise ChunkUnavailable(f"chunk {sha}: its cache file kept coming up short")

    def _acquire(self, sha: str, length: int, fetch: Fetch, count: bool,
                 open_file: bool = False) -> bytes | int | None:
        """Makes the chunk present and verified. Returns its bytes when this call had them in
        hand anyway (it fetched or verified them); else, with ``open_file``, a descriptor of
        its file opened under the lock (so many readers over a small cache cannot have it
        evicted between finding and opening it: the caller closes it), or None."""
        if length <= 0:
            raise ValueError(f"chunk {sha}: length {length}")
        while True:
            with self._lock:
                entry = self._entries.get(sha)
                if entry is not None and entry.verified and entry.size == length:
                    fd = None
                    if open_file:
                        try:
                            fd = os.open(self._path(sha), os.O_RDONLY | os.O_CLOEXEC)
                        except FileNotFoundError:  # removed behind the cache's back: fetch it again
                            self._drop(sha, corrupt=True)
                            entry = None
                    if entry is not None:
                        self._touch(sha, entry)
                        if count:
                            self._counts["hits"] += 1
                        return fd
                flight = self._flights.get(sha)
                leader = flight is None
                if leader:
                    flight = self._flights[sha] = _Flight()
            if not leader:
                flight.done.wait()
                if flight.error is not None:
                    if count:
                        self._count("misses")
                    err = flight.error
                    raise type(err)(*err.args) if isinstance(err, ChunkError) else ChunkUnavailable(
                        f"chunk {sha}: {err}")
                if count:
                    self._count("misses" if flight.fetched else "hits")
                    count = False
                continue  # look again (it may have been evicted since: then lead a fetch)
            try:
                data = self._lead(sha, length, fetch, entry, flight)
            except BaseException as exc:
                flight.error = exc
                raise
            finally:
                with self._lock:
                    del self._flights[sha]
                flight.done.set()
            if count:
                self._count("misses" if flight.fetched else "hits")
            return data

    def _lead(self, sha: str, length: int, fetch: Fetch, entry: _Entry | None, flight: _Flight) -> bytes:
        if entry is not None:  # on disk but not verified since the restart (or a wrong length)
            data = self._verified_file(sha, entry, length)
            with self._lock:
                if data is not None:
                    if self._entries.get(sha) is entry:
                        entry.verified = True
                        self._touch(sha, entry)
                    return data
                if self._entries.get(sha) is entry:
                    self._drop(sha, corrupt=True)
        data = self._fetch_verified(sha, length, fetch)
        flight.fetched = True
        try:
            self._insert(sha, data)
        except OSError as exc:  # the cache's disk failed (full, read-only): still serve the verified bytes
            log.warning("chunk %s not kept in the cache: %s", sha, exc)
        return data

    def _verified_file(self, sha: str, entry: _Entry, length: int) -> bytes | None:
        try:
            with open(self._path(sha), "rb") as f:
                data = f.read(length + 1)
        except FileNotFoundError:
            return None
        if len(data) == length == entry.size and digest(data) == sha:
            return data
        log.warning("chunk %s on disk does not match its digest or length: dropped, fetched again", sha)
        return None

    def _fetch_verified(self, sha: str, length: int, fetch: Fetch) -> bytes:
        for attempt in range(1 + self.retries):
            try:
                data = fetch(sha, length)
            except ChunkError:
                raise
            except Exception as exc:  # a source's bug or an unexpected client error: still EIO, not a crash
                raise ChunkUnavailable(f"chunk {sha}: {exc}") from exc
            data = bytes(data)
            if len(data) == length and digest(data) == sha:
                with self._lock:
                    self._counts["fetched_bytes"] += length
                return data
            self._count("corrupt")
            log.warning("chunk %s: the source gave %d bytes that are not the chunk (attempt %d of %d)",
                        sha, len(data), attempt + 1, 1 + self.retries)
        raise ChunkCorrupt(f"chunk {sha}: wrong bytes from the source {1 + self.retries} times")

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    # ------------------------------------------------------------------ inserting and evicting

    def _path(self, sha: str) -> Path:
        return self.root / sha[:2] / sha

    def _insert(self, sha: str, data: bytes) -> None:
        size = len(data)
        with self._lock:
            self._make_room(size)
            self._size += size  # reserved: concurrent inserts cannot overshoot the bound
            self._reserved += size
        path = self._path(sha)
        tmp = path.with_name(f"{sha}.tmp-{uuid.uuid4().hex[:12]}")
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
            os.rename(tmp, path)
        except BaseException:
            try:
                tmp.unlink(missing_ok=True)  # first, so the disk never holds more than is reserved
            except OSError:
                pass
            with self._lock:
                self._size -= size
                self._reserved -= size
                self._settled.notify_all()
            raise
        with self._lock:
            self._reserved -= size
            self._settled.notify_all()
            ghost = self._a1out.pop(sha, None)
            hot = ghost is not None
            if hot:
                self._a1out_bytes -= ghost
            if hot:
                self._am[sha] = None
            else:
                self._a1in[sha] = None
                self._a1in_bytes += size
                self._inserted += size
            self._entries[sha] = _Entry(size=size, hot=hot, mark=self._inserted, verified=True)
            self._dirty = True

    def _make_room(self, size: int) -> None:
        """Evicts until ``size`` more bytes fit (lock held)."""
        if size > self.limit_bytes:
            raise CacheFull(f"a chunk of {size} bytes is larger than the cache ({self.limit_bytes})")
        waited = 0.0
        while self._size + size > self.limit_bytes:
            victim = self._victim()
            if victim is None and self._reserved and waited < RESERVED_WAIT:
                # The rest is other inserts still writing: once in the queues they can be evicted.
                t0 = time.monotonic()
                self._settled.wait(RESERVED_WAIT - waited)
                waited += time.monotonic() - t0
                continue
            if victim is None:
                raise CacheFull(f"the chunk cache is full of pinned chunks ({self._pinned_bytes()} of "
                                f"{self.limit_bytes} bytes pinned, {self._size} used)")
            self._evict(victim)

    def _victim(self, ignore_pins: bool = False) -> str | None:
        """2Q's choice: the oldest of A1in while it holds more than its share, else the least
        recently used of Am; pinned chunks are skipped (then the other queue is tried)."""
        queues = (self._a1in, self._am) if self._a1in_bytes > self.kin else (self._am, self._a1in)
        for queue in queues:
            for sha in queue:
                if ignore_pins or not self._pin_count.get(sha):
                    return sha
        return None

    def _evict(self, sha: str) -> None:
        entry = self._remove(sha)
        if not entry.hot:  # remembered: a fetch while the ghost lives goes straight to Am
            self._a1out[sha] = entry.size
            self._a1out_bytes += entry.size
            while self._a1out_bytes > self.kout and self._a1out:
                _, ghost = self._a1out.popitem(last=False)
                self._a1out_bytes -= ghost
        self._counts["evictions"] += 1

    def _drop(self, sha: str, corrupt: bool = False) -> None:
        """Removes a damaged entry (not an eviction: no ghost). Lock held."""
        if sha in self._entries:
            self._remove(sha)
            if corrupt:
                self._counts["corrupt"] += 1

    def _remove(self, sha: str) -> _Entry:
        entry = self._entries.pop(sha)
        if entry.hot:
            del self._am[sha]
        else:
            del self._a1in[sha]
            self._a1in_bytes -= entry.size
        self._size -= entry.size
        # under the lock: a re-insert of the same chunk cannot rename its file into place first
        try:
            self._path(sha).unlink(missing_ok=True)
        except OSError as exc:  # the books stay right; the next start counts the file again (as cold)
            log.warning("could not remove chunk file %s: %s", self._path(sha), exc)
        self._dirty = True
        return entry

    def _touch(self, sha: str, entry: _Entry) -> None:
        """A use of a present chunk (lock held): Am's LRU order, or promotion out of A1in once
        the chunk is past its correlated-reference window."""
        if entry.hot:
            self._am.move_to_end(sha)
        elif self._inserted - entry.mark >= self.kin // 2:
            del self._a1in[sha]
            self._a1in_bytes -= entry.size
            entry.hot = True
            self._am[sha] = None
        else:
            return
        self._dirty = True

    # ------------------------------------------------------------------ pins

    def pin(self, owner: str, shas: Iterable[str]) -> None:
        """Never evict these chunks (present now or inserted later) until ``owner`` unpins."""
        with self._lock:
            held = self._pins.setdefault(str(owner), set())
            for sha in shas:
                if check_sha(sha) not in held:
                    held.add(sha)
                    self._pin_count[sha] = self._pin_count.get(sha, 0) + 1
            self._dirty = True

    def unpin(self, owner: str, shas: Iterable[str] | None = None) -> None:
        """Drops ``owner``'s pins (all of them, or just ``shas``)."""
        with self._lock:
            held = self._pins.get(str(owner), set())
            for sha in list(held) if shas is None else [s for s in shas if s in held]:
                held.discard(sha)
                left = self._pin_count.get(sha, 0) - 1
                if left > 0:
                    self._pin_count[sha] = left
                else:
                    self._pin_count.pop(sha, None)
            if not held:
                self._pins.pop(str(owner), None)
            self._dirty = True

    def pins(self) -> dict[str, int]:
        """owner -> number of chunks it pins (pins survive restarts: owners gone meanwhile are
        for the caller to unpin)."""
        with self._lock:
            return {owner: len(shas) for owner, shas in self._pins.items()}

    def _pinned_bytes(self) -> int:
        return sum(self._entries[sha].size for sha in self._pin_count if sha in self._entries)

    # ------------------------------------------------------------------ stats

    def stats(self) -> dict:
        with self._lock:
            hits, misses = self._counts["hits"], self._counts["misses"]
            return {
                **self._counts,
                "hit_ratio": hits / (hits + misses) if hits + misses else 0.0,
                "size_bytes": self._size,
                "limit_bytes": self.limit_bytes,
                "entries": len(self._entries),
                "pinned_bytes": self._pinned_bytes(),
                "a1in_bytes": self._a1in_bytes,
                "am_bytes": sum(e.size for e in self._entries.values() if e.hot),
                "ghosts": len(self._a1out),
            }

    def order(self) -> dict[str, list[str]]:
        """The queues as they stand (A1in oldest first, Am least recent first, ghosts): for
        tests and for looking at a node."""
        with self._lock:
            return {"a1in": list(self._a1in), "am": list(self._am), "a1out": list(self._a1out)}

    # ------------------------------------------------------------------ persistence

    def flush(self) -> None:
        """Writes the state file now (atomically: a temporary file renamed over it)."""
        with self._save_lock:
            with self._lock:
                doc = {
                    "format": FORMAT, "saved_at": time.time(),
                    "a1in": [[sha, self._entries[sha].size] for sha in self._a1in],
                    "am": [[sha, self._entries[sha].size] for sha in self._am],
                    "a1out": [[sha, size] for sha, size in self._a1out.items()],
                    "pins": {owner: sorted(shas) for owner, shas in self._pins.items()},
                }
                self._dirty = False
            tmp = self.root / f"{STATE}.tmp-{uuid.uuid4().hex[:12]}"
            try:
                with open(tmp, "w") as f:
                    json.dump(doc, f)
                    f.flush()
                    os.fsync(f.fileno())
                os.rename(tmp, self.root / STATE)
            except BaseException:
                tmp.unlink(missing_ok=True)
                with self._lock:
                    self._dirty = True
                raise

    def _save_loop(self, interval: float) -> None:
        while not self._closed.wait(interval):
            if self._dirty:
                try:
                    self.flush()
                except OSError as exc:  # a full disk: try again next time
                    log.warning("could not save the chunk cache state: %s", exc)

    def close(self) -> None:
        """Stops the state saver and saves the state; the cache is not used after this."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._saver is not None:
            self._saver.join()
        try:
            self.flush()
        finally:
            self._lock_file.close()

    def __enter__(self) -> ChunkCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _load(self) -> None:
        """The entries on disk, in the saved order; files the state does not know (a crash
        before the last save) are adopted as the coldest; partial writes are dropped, and so
        is a chunk whose length is not the saved one. Nothing is verified yet (see reading)."""
        for stale in self.root.glob(f"{STATE}.tmp-*"):
            stale.unlink(missing_ok=True)
        on_disk: dict[str, tuple[int, float]] = {}
        for sub in self.root.iterdir():
            if len(sub.name) != 2 or not sub.is_dir():
                continue
            for path in sub.iterdir():
                if ".tmp" in path.name:
                    path.unlink(missing_ok=True)
                elif SHA.match(path.name) and path.name[:2] == sub.name and path.is_file():
                    st = path.stat()
                    on_disk[path.name] = (st.st_size, st.st_mtime)
        state = {}
        try:
            state = json.loads((self.root / STATE).read_text())
            if state.get("format") != FORMAT:
                state = {}
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as exc:
            log.warning("chunk cache state %s unreadable (%s): adopting the files on disk as cold",
                        self.root / STATE, exc)
        saved = [(sha, size, False) for sha, size in state.get("a1in", [])] + \
                [(sha, size, True) for sha, size in state.get("am", [])]
        known = {sha for sha, _, _ in saved}
        adopted = sorted((mtime, sha, size) for sha, (size, mtime) in on_disk.items() if sha not in known)
        for sha, size, hot in [(sha, size, False) for _, sha, size in adopted] + saved:
            if sha not in on_disk or sha in self._entries:
                continue
            if on_disk[sha][0] != size or size <= 0:
                log.warning("chunk %s on disk has %d bytes, not %d: dropped", sha, on_disk[sha][0], size)
                self._path(sha).unlink(missing_ok=True)
                continue
            if hot:
                self._am[sha] = None
            else:
                self._a1in[sha] = None
                self._a1in_bytes += size
                self._inserted += size
            self._entries[sha] = _Entry(size=size, hot=hot, mark=self._inserted, verified=False)
            self._size += size
        for sha, size in state.get("a1out", []):
            if sha not in self._entries and SHA.match(sha):
                self._a1out[sha] = int(size)
                self._a1out_bytes += int(size)
        while self._a1out_bytes > self.kout and self._a1out:  # the bound may have been lowered
            self._a1out_bytes -= self._a1out.popitem(last=False)[1]
        for owner, shas in (state.get("pins") or {}).items():
            self._pins[owner] = {sha for sha in shas if SHA.match(sha)}
            for sha in self._pins[owner]:
                self._pin_count[sha] = self._pin_count.get(sha, 0) + 1
        while self._size > self.limit_bytes:  # the bound was lowered since
            victim = self._victim() or self._victim(ignore_pins=True)
            if self._pin_count.get(victim):
                log.warning("chunk cache over its new bound: evicting pinned chunk %s", victim)
            self._evict(victim)
        self._dirty = bool(adopted) or len(self._entries) != len(saved)
