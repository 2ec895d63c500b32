"""The node's chunk cache (chunkfs.cache, issue 24) on real files: hit and miss counting, the
hard byte bound (a stream of inserts, many threads), 2Q keeping a hot set through a one-off
scan that would flush an LRU, pins and CacheFull, restarts (order kept, unknown files adopted
as cold, partial and damaged files dropped, digests checked again), wrong bytes from the
source refetched then refused, and single-flight fetches."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path

import pytest

from chunkfs.cache import STATE, ChunkCache
from chunkfs.errors import CacheFull, CacheInUse, ChunkCorrupt, ChunkUnavailable

ROOT = Path(__file__).resolve().parents[2]
K = 1024


def chunk(i: int, size: int = K) -> bytes:
    """Distinct content per ``i`` (so distinct names)."""
    seed = hashlib.sha256(str(i).encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Source:
    """A fetch that serves known chunks and counts what it was asked."""

    def __init__(self, chunks=(), delay: float = 0.0):
        self.chunks = {sha(c): c for c in chunks}
        self.calls: list[str] = []
        self.delay = delay
        self.lock = threading.Lock()

    def add(self, data: bytes) -> str:
        self.chunks[sha(data)] = data
        return sha(data)

    def __call__(self, name: str, length: int) -> bytes:
        with self.lock:
            self.calls.append(name)
        if self.delay:
            time.sleep(self.delay)
        if name not in self.chunks:
            raise ChunkUnavailable(f"no chunk {name}")
        return self.chunks[name]


def no_fetch(name, length):
    raise AssertionError(f"fetched {name}: it should have been a hit")


def disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.glob("??/*") if p.is_file())


@pytest.fixture
def cache(tmp_path):
    c = ChunkCache(tmp_path / "cache", 16 * K)
    yield c
    c.close()


def test_hits_misses_and_slices_are_counted(cache):
    src = Source()
    a = src.add(chunk(1))
    assert cache.get(a, K, src) == chunk(1)  # miss: fetched
    assert cache.get(a, K, no_fetch) == chunk(1)  # hit
    assert cache.read(a, K, 100, 50, no_fetch) == chunk(1)[100:150]  # hit, a slice of the file
    assert cache.read(a, K, K - 10, 50, no_fetch) == chunk(1)[-10:]  # clamped at the chunk's end
    assert cache.contains(a) and not cache.contains(sha(b"other"))
    stats = cache.stats()
    assert (stats["hits"], stats["misses"], stats["fetched_bytes"]) == (3, 1, K)
    assert stats["hit_ratio"] == 0.75
    assert (stats["entries"], stats["size_bytes"], stats["limit_bytes"]) == (1, K, 16 * K)
    assert src.calls == [a]
    b = src.add(chunk(2))
    cache.ensure(b, K, src)  # read-ahead: fetched, counted neither way
    assert cache.stats()["misses"] == 1 and cache.contains(b)
    with pytest.raises(ValueError):
        cache.get("../../etc/passwd", K, src)


def test_the_bound_holds_under_a_stream_of_inserts(cache, tmp_path):
    src = Source()
    for i in range(200):
        size = K // 2 + (i * 37) % (K + 1)  # lengths vary: the bound is in bytes
        name = src.add(chunk(i, size))
        cache.get(name, size, src)
        stats = cache.stats()
        assert stats["size_bytes"] <= 16 * K
        assert disk_bytes(tmp_path / "cache") == stats["size_bytes"]
    assert cache.stats()["evictions"] > 150
    assert cache.stats()["size_bytes"] > 14 * K  # and it is used, not kept empty


def test_the_bound_holds_with_many_threads(tmp_path):
    cache = ChunkCache(tmp_path / "cache", 16 * K)
    src = Source([chunk(i) for i in range(400)], delay=0.001)
    names = list(src.chunks)
    peak, stop, errors = [0], threading.Event(), []

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], cache.stats()["size_bytes"])

    def work(t):
        try:
            for i in range(200):
                name = names[(t * 53 + i * 7) % len(names)]
                assert cache.read(name, K, 10, 20, src) == src.chunks[name][10:30]
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    watcher = threading.Thread(target=watch)
    watcher.start()
    workers = [threading.Thread(target=work, args=(t,)) for t in range(16)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    stop.set()
    watcher.join()
    cache.close()
    assert errors == []
    assert 8 * K < peak[0] <= 16 * K
    assert disk_bytes(tmp_path / "cache") <= 16 * K
    stats = cache.stats()
    assert stats["hits"] + stats["misses"] == 16 * 200 and stats["evictions"] > 0


def test_books_stay_right_under_mixed_concurrent_use(tmp_path):
    """Readers, read-ahead, pins and unpins at once on a small cache: afterwards the size it
    reports is the bytes on disk, each file is its chunk, and nothing half-written is left."""
    cache = ChunkCache(tmp_path / "cache", 12 * K)
    src = Source([chunk(i, K // 2 + i * 13) for i in range(60)], delay=0.0005)
    names = list(src.chunks)
    errors = []

    def work(t):
        try:
            for i in range(150):
                name = names[(t * 31 + i * 11) % len(names)]
                size = len(src.chunks[name])
                op = (t + i) % 5
                if op == 0:
                    cache.ensure(name, size, src)
                elif op == 1 and t % 4 == 0:
                    cache.pin(f"owner-{t}", [name])
                elif op == 2 and t % 4 == 0:
                    cache.unpin(f"owner-{t}")
                else:
                    assert cache.read(name, size, 3, 40, src) == src.chunks[name][3:43]
        except CacheFull:
            pass  # pins may fill it for a moment
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    stats = cache.stats()
    assert stats["size_bytes"] == disk_bytes(tmp_path / "cache") <= 12 * K
    assert stats["a1in_bytes"] + stats["am_bytes"] == stats["size_bytes"]
    files = [p for p in (tmp_path / "cache").glob("??/*")]
    assert len(files) == stats["entries"] and all(sha(p.read_bytes()) == p.name for p in files)
    cache.close()


def lru_survivors(trace: list[str], capacity: int) -> set[str]:
    """What a plain LRU of ``capacity`` chunks would hold after ``trace``."""
    lru: OrderedDict[str, None] = OrderedDict()
    for name in trace:
        lru.pop(name, None)
        lru[name] = None
        while len(lru) > capacity:
            lru.popitem(last=False)
    return set(lru)


def test_a_one_off_scan_does_not_flush_the_hot_set(cache):
    """A hot set re-read across other traffic (a template's boot chunks) survives a scan of
    four caches' worth of chunks read once; an LRU of the same size keeps none of it."""
    src = Source([chunk(i) for i in range(200)])
    names = list(src.chunks)
    hot, warm, scan = names[:4], names[4:12], names[12:76]
    trace = hot + warm + hot + scan  # a one-off scan after the hot set has been re-used
    for name in trace:
        cache.read(name, K, 0, 100, src)
    assert set(cache.order()["am"]) == set(hot)
    assert all(cache.contains(name) for name in hot)
    assert not set(hot) & lru_survivors(trace, 16)
    before = cache.stats()["hits"]
    for name in hot:
        cache.get(name, K, no_fetch)
    assert cache.stats()["hits"] == before + 4
    # the scan went through A1in: none of it in Am, and only A1in's newest part is left
    assert not set(cache.order()["am"]) & set(scan)


def test_hits_within_a_burst_do_not_make_a_chunk_hot(cache):
    """A reader going through one chunk in 128 KiB pieces hits it many times in a row: one
    use, so the chunk stays in A1in (and a scan read that way still cannot flush Am)."""
    src = Source([chunk(i) for i in range(3)])
    a, b, c = src.chunks
    for offset in range(0, K, 64):
        cache.read(a, K, offset, 64, src)
    cache.get(b, K, src)
    cache.get(a, K, src)  # one chunk inserted since: still the same burst (window: 2 chunks)
    assert cache.order() == {"a1in": [a, b], "am": [], "a1out": []}
    cache.get(c, K, src)
    cache.get(a, K, src)  # past half of A1in's share since it came in: re-use
    assert cache.order()["am"] == [a]


def test_am_gives_way_while_a1in_is_within_its_share(cache):
    """Re-used chunks do not starve new ones: below A1in's quarter, Am's least recent goes;
    above it, A1in's oldest."""
    src = Source([chunk(i) for i in range(16)])
    names = list(src.chunks)
    for name in names + names:  # all but the last two re-used past their window: hot
        cache.get(name, K, src)
    assert cache.order()["am"] == names[:14] and cache.order()["a1in"] == names[14:]
    new = [src.add(chunk(100 + i)) for i in range(4)]
    for name in new:
        cache.get(name, K, src)
    assert cache.order()["am"] == names[3:14]
    assert cache.order()["a1in"] == [names[15]] + new


def test_a_chunk_fetched_again_while_its_ghost_lives_goes_to_am(cache):
    src = Source([chunk(i) for i in range(40)])
    names = list(src.chunks)
    for name in names[:20]:  # 16 fit: the first four are evicted from A1in, remembered as ghosts
        cache.get(name, K, src)
    assert names[0] in cache.order()["a1out"] and not cache.contains(names[0])
    cache.get(names[0], K, src)
    assert cache.order()["am"] == [names[0]]
    assert names[0] not in cache.order()["a1out"]


def test_pinned_chunks_are_never_evicted_and_only_pins_left_is_cache_full(tmp_path):
    cache = ChunkCache(tmp_path / "cache", 4 * K)
    src = Source([chunk(i) for i in range(40)])
    names = list(src.chunks)
    cache.pin("sandbox-1", names[:2])  # pinned before they are even present
    cache.pin("sandbox-2", [names[1], names[2]])
    for name in names[:3]:
        cache.get(name, K, src)
    for name in names[3:30]:
        cache.get(name, K, src)
        assert all(cache.contains(n) for n in names[:3])
    assert cache.stats()["pinned_bytes"] == 3 * K
    assert cache.pins() == {"sandbox-1": 2, "sandbox-2": 2}
    cache.pin("sandbox-3", [names[29]])  # the one unpinned slot, now pinned too
    with pytest.raises(CacheFull):
        cache.get(names[30], K, src)
    assert cache.stats()["size_bytes"] == 4 * K
    cache.unpin("sandbox-1")  # names[0] free; names[1] still held by sandbox-2
    assert cache.get(names[30], K, src) == src.chunks[names[30]]
    assert not cache.contains(names[0]) and cache.contains(names[1])
    with pytest.raises(CacheFull):  # bigger than the whole cache
        cache.get(src.add(chunk(99, 5 * K)), 5 * K, src)
    cache.close()


def test_a_restart_keeps_entries_order_and_pins_and_checks_digests(tmp_path):
    src = Source([chunk(i) for i in range(10)])
    names = list(src.chunks)
    with ChunkCache(tmp_path / "cache", 8 * K) as cache:
        for name in names[:6] + names[:2]:  # the first two re-used later: hot
            cache.get(name, K, src)
        cache.get(names[6], K, src)  # 4 inserted after names[0]: promoted above
        cache.pin("sandbox-1", [names[3]])
        order = cache.order()
    assert order["am"] == names[:2]
    with ChunkCache(tmp_path / "cache", 8 * K) as cache:
        assert cache.order() == order
        assert cache.pins() == {"sandbox-1": 1}
        assert cache.stats()["size_bytes"] == 7 * K
        assert cache.get(names[0], K, no_fetch) == src.chunks[names[0]]  # verified on the way
        assert cache.read(names[4], K, 5, 5, no_fetch) == src.chunks[names[4]][5:10]
        assert cache.stats()["hits"] == 2 and cache.stats()["corrupt"] == 0


def test_a_chunk_damaged_on_disk_across_a_restart_is_refetched(tmp_path):
    src = Source([chunk(i) for i in range(3)])
    a, b, c = src.chunks
    with ChunkCache(tmp_path / "cache", 8 * K) as cache:
        for name in (a, b, c):
            cache.get(name, K, src)
    path = tmp_path / "cache" / a[:2] / a
    data = bytearray(path.read_bytes())
    data[500] ^= 0xFF  # same length, wrong bytes: only the digest can tell
    path.write_bytes(bytes(data))
    with open(tmp_path / "cache" / b[:2] / b, "r+b") as f:
        f.truncate(K // 2)  # a torn write: the state's length tells at start
    src.calls.clear()
    with ChunkCache(tmp_path / "cache", 8 * K) as cache:
        assert not cache.contains(b) and cache.contains(a)
        assert cache.read(a, K, 400, 200, src) == src.chunks[a][400:600]  # never the damaged bytes
        assert src.calls == [a]
        assert cache.stats()["corrupt"] == 1
        assert path.read_bytes() == src.chunks[a]
        assert cache.get(b, K, src) == src.chunks[b]
        assert cache.get(c, K, no_fetch) == src.chunks[c]


def test_a_crash_keeps_the_saved_order_adopts_later_chunks_as_cold_and_drops_partials(tmp_path):
    """A process killed after a save: chunks saved keep their place, chunks written since are
    adopted as the coldest, a half-written temporary file is removed."""
    root = tmp_path / "cache"
    script = f"""
import os, sys
sys.path.insert(0, {str(ROOT)!r})
from chunkfs.cache import ChunkCache
from tests.unit.test_chunk_cache import Source, chunk
src = Source([chunk(i) for i in range(6)])
names = list(src.chunks)
cache = ChunkCache({str(root)!r}, 16 * 1024, state_interval=0)  # saved only when told
for name in names[:4]:
    cache.get(name, 1024, src)
cache.flush()
for name in names[4:]:
    cache.get(name, 1024, src)
open(os.path.join({str(root)!r}, names[5][:2], names[5] + ".tmp-dead"), "wb").write(b"half")
os._exit(9)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 9, proc.stderr
    names = list(Source([chunk(i) for i in range(6)]).chunks)
    with ChunkCache(root, 16 * K) as cache:
        order = cache.order()
        assert order["a1in"][:2] == names[4:6] or order["a1in"][:2] == names[5:3:-1]
        assert order["a1in"][2:] == names[:4]
        assert not list(root.glob("*/*.tmp*"))
        assert cache.stats()["entries"] == 6
        for name in names:
            assert cache.get(name, K, no_fetch) == chunk(names.index(name))
    assert "a1in" in (root / STATE).read_text()


def test_a_lowered_bound_applies_at_start(tmp_path):
    src = Source([chunk(i) for i in range(12)])
    with ChunkCache(tmp_path / "cache", 12 * K) as cache:
        for name in src.chunks:
            cache.get(name, K, src)
    with ChunkCache(tmp_path / "cache", 5 * K) as cache:
        assert cache.stats()["size_bytes"] <= 5 * K
        assert disk_bytes(tmp_path / "cache") <= 5 * K


def test_wrong_bytes_from_the_source_are_refetched_then_refused(cache):
    good = chunk(7)
    name = sha(good)
    answers = [b"x" * K, good[:-1] + b"\0"]  # wrong content, then a near miss

    def flaky(n, length):
        return answers.pop(0) if answers else good

    assert cache.get(name, K, flaky) == good
    assert cache.stats()["corrupt"] == 2

    other = chunk(8)
    calls = []

    def liar(n, length):
        calls.append(n)
        return chunk(9)  # a real chunk, just not this one

    with pytest.raises(ChunkCorrupt):
        cache.read(sha(other), K, 0, 10, liar)
    assert len(calls) == 3  # the first fetch and two more
    assert not cache.contains(sha(other)) and not (cache.root / sha(other)[:2] / sha(other)).exists()
    assert not list(cache.root.glob("*/*.tmp*"))
    with pytest.raises(ChunkCorrupt):  # right bytes, wrong length asked
        cache.get(sha(chunk(3)), K + 1, Source([chunk(3)]))


def test_source_errors_reach_the_caller_as_chunk_errors(cache):
    with pytest.raises(ChunkUnavailable):
        cache.get(sha(b"nowhere"), 7, Source())

    def broken(n, length):
        raise RuntimeError("boom")

    with pytest.raises(ChunkUnavailable, match="boom"):
        cache.get(sha(b"nowhere"), 7, broken)
    assert cache.stats()["size_bytes"] == 0


def test_a_failing_cache_disk_still_serves_verified_bytes(cache):
    """Writing the chunk file fails (a full or read-only disk): the reader still gets the
    verified bytes, the cache keeps nothing and its books stay right."""
    src = Source([chunk(1)])
    name = next(iter(src.chunks))
    (cache.root / name[:2]).write_bytes(b"")  # a file where its directory must go: ENOTDIR/EEXIST
    assert cache.get(name, K, src) == chunk(1)
    assert not cache.contains(name)
    assert cache.stats()["size_bytes"] == 0 and cache.stats()["fetched_bytes"] == K


def test_threads_missing_one_chunk_share_one_fetch(cache):
    src = Source([chunk(1)], delay=0.3)
    name = next(iter(src.chunks))
    results, barrier = [], threading.Barrier(16)

    def reader(i):
        barrier.wait()
        results.append(cache.read(name, K, i, 10, src))

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert src.calls == [name]
    assert sorted(results) == sorted(chunk(1)[i:i + 10] for i in range(16))
    assert cache.stats()["misses"] == 16

    down = Source(delay=0.3)  # and a failure is shared too: one attempt, every reader told
    errors, barrier = [], threading.Barrier(8)

    def failing():
        barrier.wait()
        try:
            cache.get(sha(b"gone"), 4, down)
        except ChunkUnavailable as exc:
            errors.append(exc)

    threads = [threading.Thread(target=failing) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 8 and len(down.calls) == 1


def test_one_cache_per_directory(cache):
    with pytest.raises(CacheInUse):
        ChunkCache(cache.root, K)


def test_state_is_saved_periodically(tmp_path):
    cache = ChunkCache(tmp_path / "cache", 8 * K, state_interval=0.05)
    try:
        src = Source([chunk(1)])
        cache.get(next(iter(src.chunks)), K, src)
        deadline = time.monotonic() + 5
        while not (tmp_path / "cache" / STATE).exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert next(iter(src.chunks)) in (tmp_path / "cache" / STATE).read_text()
        assert not [p for p in os.listdir(tmp_path / "cache") if ".tmp" in p]
    finally:
        cache.close()


def test_an_insert_waits_for_space_that_other_inserts_hold(tmp_path, monkeypatch):
    """Two inserts still writing their files reserve the whole cache: a third (another
    reader's chunk) waits until they are in the queues and evicts one, instead of failing
    with CacheFull (which a FUSE read turns into EIO; seen with 16 readers over a small cache)."""
    import chunkfs.cache as cache_module

    src = Source([chunk(i) for i in range(3)])
    names = list(src.chunks)
    cache = ChunkCache(tmp_path / "c", 2 * K)
    release, entered = threading.Event(), threading.Semaphore(0)
    real_rename = os.rename

    def held_rename(a, b):
        if threading.current_thread().name.startswith("held"):
            entered.release()
            release.wait(10)
        return real_rename(a, b)

    monkeypatch.setattr(cache_module.os, "rename", held_rename)
    results, errors = {}, []

    def get(name):
        try:
            results[name] = cache.get(name, K, src)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    held = [threading.Thread(target=get, args=(n,), name=f"held-{i}") for i, n in enumerate(names[:2])]
    for t in held:
        t.start()
    assert entered.acquire(timeout=10) and entered.acquire(timeout=10)
    third = threading.Thread(target=get, args=(names[2],), name="third")
    third.start()
    third.join(0.5)
    assert third.is_alive() and errors == []  # waiting, not refused
    release.set()
    for t in [*held, third]:
        t.join(10)
    assert errors == []
    assert {n: results[n] == src.chunks[n] for n in names} == {n: True for n in names}
    stats = cache.stats()
    assert stats["size_bytes"] <= stats["limit_bytes"] and stats["evictions"] == 1
    cache.close()
