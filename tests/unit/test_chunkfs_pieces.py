"""Prefetch pieces (chunkfs.pieces) without a store: a piece is fetched once for all its
chunks (and the next ones ahead), each chunk is given once, a piece that fails or holds wrong
bytes sends its chunks to the store (the cache never keeps wrong bytes), and bodies are not
kept after use or after ``close``."""
from __future__ import annotations

import hashlib
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from chunkfs.cache import ChunkCache
from chunkfs.compression import encode
from chunkfs.errors import ChunkUnavailable
from chunkfs.pieces import PiecesFirst, PrefetchPieces, parse
from chunkfs.sources import CountingSource

CHUNK = 4096


def _chunk(i: int) -> bytes:
    return bytes([i % 251 + 1]) * (CHUNK - 64) + hashlib.sha256(str(i).encode()).digest() * 2


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Store:
    """The bucket: piece objects by key and chunk objects by sha; counts GETs."""

    def __init__(self, chunks: list[bytes], per_piece: int, codec="zstd"):
        self.chunks = {_sha(c): c for c in chunks}
        self.objects: dict[str, bytes] = {}
        self.pieces = []
        for n in range(0, len(chunks), per_piece):
            entries, bodies = [], []
            for c in chunks[n:n + per_piece]:
                body, meta = encode(c, codec)
                entries.append([_sha(c), len(c), len(body), meta.get("aenv-encoding", "")])
                bodies.append(body)
            key = f"snapshots/s/prefetch/{len(self.pieces)}"
            self.objects[key] = b"".join(bodies)
            self.pieces.append({"key": key, "chunks": entries})
        self.gets: list[str] = []
        self.fetches: list[str] = []
        self.lock = threading.Lock()
        self.name = "store"

    def get(self, key: str, limit: int) -> bytes:
        with self.lock:
            self.gets.append(key)
        if key not in self.objects:
            raise ChunkUnavailable(f"{key}: 404")
        return self.objects[key][:limit]

    def fetch(self, sha: str, length: int) -> bytes:
        with self.lock:
            self.fetches.append(sha)
        return self.chunks[sha]


@pytest.fixture
def pool():
    p = ThreadPoolExecutor(4)
    yield p
    p.shutdown(wait=True)


def _pieces(store: Store, pool, **kw) -> PrefetchPieces:
    return PrefetchPieces(*parse(store.pieces), store.get, pool, **kw)


def test_each_piece_is_fetched_once_and_gives_each_of_its_chunks_once(pool):
    chunks = [_chunk(i) for i in range(20)]
    store = Store(chunks, per_piece=8)
    pieces = _pieces(store, pool, ahead=0)
    for c in chunks:
        assert pieces.take(_sha(c), len(c)) == c
    assert store.gets == [p["key"] for p in store.pieces]
    assert pieces.take(_sha(chunks[0]), CHUNK) is None, "a second ask (the cache found it wrong) goes to the store"
    assert pieces.held == 0, "every body went once its chunks were taken"
    assert pieces.counters.as_dict() == {"piece_gets": 3, "piece_bytes": sum(map(len, store.objects.values())),
                                         "piece_chunks": 20}


def test_asking_for_one_chunk_starts_the_pieces_ahead_of_it(pool):
    chunks = [_chunk(i) for i in range(40)]
    store = Store(chunks, per_piece=8)
    pieces = _pieces(store, pool, ahead=2)
    assert pieces.take(_sha(chunks[0]), CHUNK) == chunks[0]
    pool.shutdown(wait=True)  # the GETs started ahead have ended
    assert sorted(store.gets) == sorted(p["key"] for p in store.pieces[:3])


def test_a_piece_holding_only_chunks_the_node_has_is_never_fetched(pool):
    chunks = [_chunk(i) for i in range(16)]
    store = Store(chunks, per_piece=8)
    pieces = _pieces(store, pool, ahead=3)
    pieces.skip([_sha(c) for c in chunks[:8]])
    assert pieces.take(_sha(chunks[0]), CHUNK) is None
    assert pieces.take(_sha(chunks[8]), CHUNK) == chunks[8]
    pool.shutdown(wait=True)
    assert store.gets == [store.pieces[1]["key"]]


def test_a_missing_piece_sends_its_chunks_to_the_store(pool):
    chunks = [_chunk(i) for i in range(16)]
    store = Store(chunks, per_piece=8)
    del store.objects[store.pieces[0]["key"]]
    source = PiecesFirst(_pieces(store, pool, ahead=0), CountingSource(store))
    for c in chunks:
        assert source.fetch(_sha(c), CHUNK) == c
    assert store.fetches == [_sha(c) for c in chunks[:8]]
    assert source.store.chunks == 16, "what the pieces gave counts as from the store"


def test_wrong_bytes_in_a_piece_are_refetched_from_the_store_never_kept(pool, tmp_path):
    chunks = [_chunk(i) for i in range(8)]
    store = Store(chunks, per_piece=8, codec=None)  # plain bodies: wrong bytes decode "fine"
    key = store.pieces[0]["key"]
    store.objects[key] = bytes(len(store.objects[key]))
    cache = ChunkCache(tmp_path / "cache", 1 << 20)
    source = PiecesFirst(_pieces(store, pool), CountingSource(store))
    for c in chunks:
        assert cache.read(_sha(c), CHUNK, 0, CHUNK, source.fetch) == c
    assert cache.stats()["corrupt"] == 8
    assert store.fetches == [_sha(c) for c in chunks]
    cache.close()


def test_a_closed_set_gives_nothing_and_keeps_no_body(pool):
    chunks = [_chunk(i) for i in range(16)]
    store = Store(chunks, per_piece=8)
    pieces = _pieces(store, pool, ahead=1)
    assert pieces.take(_sha(chunks[0]), CHUNK) == chunks[0]
    assert pieces.held == 2
    pieces.close()
    assert pieces.held == 0 and pieces.take(_sha(chunks[1]), CHUNK) is None


@pytest.mark.parametrize("bad", [
    "not a list",
    [{"key": "/abs", "chunks": [["a" * 64, 1, 1, ""]]}],
    [{"key": "snapshots/../x", "chunks": [["a" * 64, 1, 1, ""]]}],
    [{"key": "k", "chunks": []}],
    [{"key": "k", "chunks": [["nothex", 1, 1, ""]]}],
    [{"key": "k", "chunks": [["a" * 64, 0, 1, ""]]}],
    [{"key": "k", "chunks": [["a" * 64, 10, 10, "gzip"]]}],
    [{"key": "k", "chunks": [["a" * 64, 10, 1 << 20, ""]]}],
    [{"key": "k", "chunks": [["a" * 64, True, 1, ""]]}],
])
def test_malformed_pieces_are_refused(bad):
    with pytest.raises(ValueError):
        parse(bad)


def test_pieces_bigger_than_the_daemon_may_hold_are_refused():
    """A prefetch list from the store is bounded before any GET: a piece of at most 16 MiB, all
    of them at most 512 MiB (the writer makes 4 MiB pieces, 256 MiB in all)."""
    big = [[f"{i:064x}", 4 << 20, 4 << 20, ""] for i in range(5)]
    with pytest.raises(ValueError, match="more than"):
        parse([{"key": "k", "chunks": big}])
    fine = [{"key": f"k{n}", "chunks": [[f"{n * 4 + i:064x}", 4 << 20, 4 << 20, ""] for i in range(4)]}
            for n in range(32)]
    assert len(parse(fine)[1]) == 128
    with pytest.raises(ValueError, match="in all"):
        parse(fine + [{"key": "k-last", "chunks": [["f" * 64, 4 << 20, 4 << 20, ""]]}])
