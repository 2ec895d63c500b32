"""chunkfs.lazyfile without FUSE, over a real ChunkCache in a tmp dir: reads equal the
original bytes (holes, short last chunk, every border), the COW overlay against a plain
bytearray model (random writes, growth, truncates), read-ahead and recording, and a source
that hangs giving ReadTimedOut at the read's deadline, not a hang."""
from __future__ import annotations

import hashlib
import os
import random
import threading
import time

import pytest

from chunkfs.cache import ChunkCache
from chunkfs.errors import CacheFull, ChunkCorrupt, ChunkUnavailable
from chunkfs.lazyfile import Extents, Handle, LazyFile, Pools, ReadTimedOut, Recorder

CS = 64 * 1024


class DictSource:
    """Chunks by sha from a dict; counts fetches; optionally hangs or lies."""

    name = "dict"

    def __init__(self, chunks: dict[str, bytes]):
        self.chunks = chunks
        self.fetches: list[str] = []
        self.hang = threading.Event()
        self.release = threading.Event()
        self.wrong = False

    def fetch(self, sha, length):
        self.fetches.append(sha)
        if self.hang.is_set():
            self.release.wait(30)
        if sha not in self.chunks:
            raise ChunkUnavailable(sha)
        data = self.chunks[sha]
        return data[:-1] + bytes([data[-1] ^ 1]) if self.wrong else data


def cut(data: bytes, chunk_size: int = CS) -> tuple[list, dict]:
    chunks, store = [], {}
    for off in range(0, len(data), chunk_size):
        piece = data[off:off + chunk_size]
        if not piece.strip(b"\0"):
            continue
        sha = hashlib.sha256(piece).hexdigest()
        store[sha] = piece
        chunks.append([off, len(piece), sha])
    return chunks, store


def sample(size: int, seed: int = 1) -> bytes:
    """Random bytes with two whole-chunk holes and a zero run inside a chunk."""
    r = random.Random(seed)
    data = bytearray(r.randbytes(size))
    data[CS:2 * CS] = bytes(CS)
    data[4 * CS:6 * CS] = bytes(2 * CS)
    data[7 * CS + 100:7 * CS + 5000] = bytes(4900)
    return bytes(data)


@pytest.fixture
def cache(tmp_path):
    c = ChunkCache(tmp_path / "cache", 64 << 20, state_interval=0)
    yield c
    c.close()


@pytest.fixture
def pools():
    p = Pools(fetch_workers=4, prefetch_workers=2)
    yield p
    p.shutdown()


def test_reads_equal_the_original_across_borders_and_holes(cache, pools):
    data = sample(10 * CS + 777)
    chunks, store = cut(data)
    assert len(chunks) == 8  # 11 chunks, two holes of 1 and 2 chunks
    f = LazyFile(len(data), CS, chunks, cache, DictSource(store), pools=pools)
    assert f.read(0, len(data) + 100) == data
    r = random.Random(7)
    for _ in range(300):
        off = r.randrange(len(data) + 10)
        n = r.choice([1, 511, 4096, CS - 1, CS, CS + 1, 3 * CS])
        assert f.read(off, n) == data[off:off + n], (off, n)
    for border in range(CS, len(data), CS):
        assert f.read(border - 3, 6) == data[border - 3:border + 3]


def test_a_chunk_that_does_not_fit_the_file_is_refused(cache):
    with pytest.raises(ValueError):
        LazyFile(CS, CS, [[0, CS + 1, "a" * 64]], cache, DictSource({}))
    with pytest.raises(ValueError):
        LazyFile(2 * CS, CS, [[100, 10, "a" * 64]], cache, DictSource({}))
    with pytest.raises(ValueError):
        LazyFile(CS, CS, [[0, 10, "../etc/passwd"]], cache, DictSource({}))


def test_extents_match_a_model():
    r = random.Random(3)
    for _ in range(50):
        e, model = Extents(), [False] * 400
        for _ in range(30):
            if r.random() < 0.15:
                limit = r.randrange(400)
                e.cut(limit)
                model[limit:] = [False] * (400 - limit)
            else:
                s = r.randrange(400)
                t = min(400, s + r.randrange(1, 40))
                e.add(s, t)
                model[s:t] = [True] * (t - s)
        got = [False] * 400
        for s, t in e.overlapping(0, 400):
            got[s:t] = [True] * (t - s)
        assert got == model
        assert all(a < b for a, b in zip(e.ends, e.starts[1:])), "ranges stay disjoint and apart"


def test_cow_overlay_matches_a_bytearray_and_never_reaches_the_source(cache, pools, tmp_path):
    data = sample(8 * CS + 123, seed=2)
    chunks, store = cut(data)
    before = dict(store)
    overlay = tmp_path / "overlay" / "disk"
    f = LazyFile(len(data), CS, chunks, cache, DictSource(store), pools=pools, overlay=overlay)
    model = bytearray(data)
    r = random.Random(5)
    for step in range(200):
        if step % 37 == 36:
            length = r.randrange(len(model) + 2 * CS)
            f.truncate(length)
            model = model[:length] + bytearray(max(0, length - len(model)))
        else:
            off = r.randrange(len(model) + CS)
            blob = r.randbytes(r.randrange(1, 2 * CS))
            assert f.write(off, blob) == len(blob)
            if off > len(model):
                model += bytearray(off - len(model))
            model[off:off + len(blob)] = blob
        assert f.size == len(model)
        off = r.randrange(len(model) + 1)
        assert f.read(off, 3 * CS) == bytes(model[off:off + 3 * CS])
    assert f.read(0, len(model)) == bytes(model)
    assert store == before
    assert all(hashlib.sha256(v).hexdigest() == k for k, v in store.items())
    assert overlay.exists()
    f.close()
    assert not overlay.exists()


def test_copy_into_writes_the_file_with_its_overlay_and_skips_holes(cache, pools, tmp_path):
    """``copy_into`` (the daemon's ``copy_out``): the base chunks in parallel, holes never
    fetched nor written; after a write into a hole the overlay's bytes are copied too."""
    data = sample(8 * CS + 123, seed=3)
    chunks, store = cut(data)
    source = DictSource(store)
    f = LazyFile(len(data), CS, chunks, cache, source, pools=pools, overlay=tmp_path / "ov")
    dest = tmp_path / "dest"
    with open(dest, "wb") as out:
        out.truncate(len(data))
    fd = os.open(dest, os.O_WRONLY)
    try:
        written = f.copy_into(fd, workers=4, zero_piece=4096)
    finally:
        os.close(fd)
    assert dest.read_bytes() == data
    assert sorted(source.fetches) == sorted(sha for _, _, sha in chunks)  # each once, no hole asked for
    pieces = [data[i:i + 4096] for i in range(0, len(data), 4096)]
    assert written == sum(len(p) for p in pieces if p.strip(b"\0")) < len(data)
    f.write(CS + 100, b"in the hole")
    model = bytearray(data)
    model[CS + 100:CS + 111] = b"in the hole"
    dest.unlink()
    with open(dest, "wb") as out:
        out.truncate(len(data))
    fd = os.open(dest, os.O_WRONLY)
    try:
        f.copy_into(fd, workers=2)
    finally:
        os.close(fd)
    assert dest.read_bytes() == bytes(model)
    source.chunks.clear()
    cache.close()
    f2 = LazyFile(len(data), CS, chunks, ChunkCache(tmp_path / "empty", 1 << 30), source, pools=pools)
    fd = os.open(dest, os.O_WRONLY)
    try:
        with pytest.raises(ChunkUnavailable):
            f2.copy_into(fd, workers=4)
    finally:
        os.close(fd)


def test_a_read_only_file_refuses_writes(cache):
    data = sample(3 * CS)
    chunks, store = cut(data)
    f = LazyFile(len(data), CS, chunks, cache, DictSource(store))
    with pytest.raises(PermissionError):
        f.write(0, b"x")
    with pytest.raises(PermissionError):
        f.truncate(0)


def test_sequential_reads_prefetch_the_next_chunks(cache, pools):
    data = os.urandom(12 * CS)
    chunks, store = cut(data)
    source = DictSource(store)
    f = LazyFile(len(data), CS, chunks, cache, source, pools=pools, readahead=3)
    h = Handle()
    f.read(0, 4096, h)  # one read is not yet a pattern
    time.sleep(0.2)
    assert len(source.fetches) == 1
    f.read(4096, 4096, h)  # sequential: chunks 1..3 are fetched ahead
    deadline = time.monotonic() + 5
    while len(source.fetches) < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sorted(source.fetches) == sorted(c[2] for c in chunks[:4])
    f.read(10 * CS, 10, h)  # a jump: no read-ahead
    time.sleep(0.2)
    assert len(source.fetches) == 5


def test_recording_gives_first_touch_order(cache):
    data = os.urandom(6 * CS)
    chunks, store = cut(data)
    rec = Recorder()
    a = LazyFile(len(data), CS, chunks, cache, DictSource(store), name="a", recorder=rec)
    b = LazyFile(len(data), CS, chunks, cache, DictSource(store), name="b", recorder=rec)
    a.read(3 * CS + 5, 10)
    b.read(0, 10)
    a.read(CS - 1, 2)  # chunks 0 and 1 of a
    a.read(3 * CS, 10)  # again: not a first touch
    assert rec.order() == [["a", 3], ["b", 0], ["a", 0], ["a", 1]]


def test_a_hanging_source_gives_a_timeout_at_the_deadline(cache, pools):
    data = os.urandom(2 * CS)
    chunks, store = cut(data)
    source = DictSource(store)
    source.hang.set()
    f = LazyFile(len(data), CS, chunks, cache, source, pools=pools, read_deadline=0.5)
    t = time.monotonic()
    with pytest.raises(ReadTimedOut):
        f.read(0, 100)
    assert time.monotonic() - t < 2
    t = time.monotonic()
    with pytest.raises(ReadTimedOut):  # the fetch still hangs: the next read of the chunk fails at once
        f.read(10, 100)
    assert time.monotonic() - t < 0.2
    source.hang.clear()
    source.release.set()
    deadline = time.monotonic() + 5
    while not cache.contains(chunks[0][2]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert f.read(0, 100) == data[:100]  # the source came back: the same file reads again
    assert f.counters.as_dict()["errors"] == 2


def test_wrong_bytes_are_never_returned(cache, pools):
    data = os.urandom(2 * CS)
    chunks, store = cut(data)
    source = DictSource(store)
    source.wrong = True
    f = LazyFile(len(data), CS, chunks, cache, source, pools=pools)
    with pytest.raises(ChunkCorrupt):
        f.read(0, 100)
    source.wrong = False
    assert f.read(0, 100) == data[:100]


def test_a_cache_full_of_pinned_chunks_refuses_the_read(tmp_path, pools):
    data = os.urandom(3 * CS)
    chunks, store = cut(data)
    cache = ChunkCache(tmp_path / "small", 2 * CS, state_interval=0)
    try:
        f = LazyFile(len(data), CS, chunks, cache, DictSource(store), pools=pools)
        assert f.read(0, 2 * CS) == data[:2 * CS]
        cache.pin("sandbox-1", [chunks[0][2], chunks[1][2]])
        with pytest.raises(CacheFull):
            f.read(2 * CS, 10)
        assert f.read(10, 10) == data[10:20]  # what is cached still reads
        cache.unpin("sandbox-1")
        assert f.read(2 * CS, 10) == data[2 * CS:2 * CS + 10]
    finally:
        cache.close()
