"""Peer fetch (issue 24): a node's chunk cache served to its peers (chunkfs.peer_server) and
asked before the store (chunkfs.peer_source), on loopback with real caches and real HTTP:
a chunk one cache holds reaches the other without the store; a wrong or missing token is a
401 and the reader's chunk comes from the store; a peer's wrong bytes are never kept or
returned; a silent peer costs one bounded wait and is then skipped; a bad digest or a path
outside /chunks/ is answered before the file system is touched; a chunk the cache lacks is
a 404, never a fetch on the peer's behalf."""
from __future__ import annotations

import hashlib
import http.client
import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from chunkfs.cache import ChunkCache
from chunkfs.client import ChunkfsError
from chunkfs.errors import ChunkUnavailable
from chunkfs.peer_server import PeerServer, bearer_matches
from chunkfs.peer_source import PeerChunkSource, parse_peer
from chunkfs.sources import CountingSource, FallbackSource

TOKEN = "t" * 48
SIZE = 256 << 10


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Store:
    """A snapshot store that counts what it gives (or refuses everything)."""

    name = "store"

    def __init__(self, chunks: dict | None = None):
        self.chunks = chunks or {}
        self.calls = 0

    def fetch(self, name, length):
        self.calls += 1
        if name not in self.chunks:
            raise ChunkUnavailable(f"store: no {name}")
        return self.chunks[name]


def _fail(name, length):
    raise AssertionError("the serving node must never fetch on a peer's behalf")


@pytest.fixture
def pair(tmp_path):
    """Node A (holds ``data`` in its cache, serves it) and node B's empty cache."""
    data = os.urandom(SIZE)
    a = ChunkCache(tmp_path / "a", 8 << 20, state_interval=0)
    a.get(sha(data), SIZE, lambda n, l: data)
    server = PeerServer(a, "127.0.0.1", 0, TOKEN)
    b = ChunkCache(tmp_path / "b", 8 << 20, state_interval=0)
    yield a, server, b, data
    server.close()
    a.close()
    b.close()


def _get(port: int, path: str, token: str | None = TOKEN) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {token}"} if token is not None else {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_a_chunk_one_node_holds_reaches_another_without_the_store(pair):
    a, server, b, data = pair
    peers = PeerChunkSource()
    peers.configure([f"127.0.0.1:{server.port}"], TOKEN)
    store = Store()  # has nothing: only the peer can give it
    hits_before = a.stats()["hits"]
    got = b.get(sha(data), SIZE, FallbackSource([peers, CountingSource(store)]).fetch)
    assert got == data and store.calls == 0 and b.contains(sha(data))
    assert peers.stats()["peer_chunks"] == 1 and peers.stats()["peer_bytes"] == SIZE
    assert server.stats()["served_chunks"] == 1 and server.stats()["served_bytes"] == SIZE
    assert a.stats()["hits"] == hits_before  # serving a peer is not a use here
    # a chunk A lacks: a 404 (A fetches nothing for B), then B's store
    other = os.urandom(SIZE)
    store.chunks[sha(other)] = other
    counted = CountingSource(store)
    assert b.get(sha(other), SIZE, FallbackSource([peers, counted]).fetch) == other
    assert (store.calls, counted.chunks, counted.bytes) == (1, 1, SIZE)
    assert server.stats()["served_not_found"] == 1 and not a.contains(sha(other))
    assert peers.stats()["peer_misses"] == 1 and peers.stats()["peers_skipped"] == 0  # a 404 is no failure


def test_a_wrong_or_missing_token_is_refused_and_the_store_serves(pair):
    a, server, b, data = pair
    assert _get(server.port, f"/chunks/{sha(data)}", token=None)[0] == 401
    assert _get(server.port, f"/chunks/{sha(data)}", token="x" * 48)[0] == 401
    assert _get(server.port, f"/chunks/{sha(data)}", token=TOKEN[:-1])[0] == 401
    assert _get(server.port, f"/chunks/{sha(data)}")[0] == 200
    assert server.stats()["served_refused"] == 3
    peers = PeerChunkSource()
    peers.configure([f"127.0.0.1:{server.port}"], "w" * 48)
    store = Store({sha(data): data})
    assert b.get(sha(data), SIZE, FallbackSource([peers, store]).fetch) == data
    assert store.calls == 1 and server.stats()["served_chunks"] == 1  # only the right token's
    assert peers.stats()["peer_errors"] == 1 and peers.stats()["peers_skipped"] == 1
    assert not bearer_matches("Bearer ", "") and not bearer_matches(f"Basic {TOKEN}", TOKEN)


def test_bad_digests_and_other_paths_never_reach_the_file_system(tmp_path):
    class Untouchable:
        def peek(self, name):
            raise AssertionError(f"the cache was asked for {name!r}")

    server = PeerServer(Untouchable(), "127.0.0.1", 0, TOKEN)
    try:
        good = "a" * 64
        for path in ("/chunks/../../etc/passwd", "/chunks/%2e%2e%2fstate.json", "/chunks/" + good.upper(),
                     "/chunks/" + good[:63], "/chunks/" + good + "0", "/chunks/" + good + "/x",
                     "/chunks/" + good + "?x=1", "/chunks/" + good[:62] + "/.", "/chunks/"):
            assert _get(server.port, path)[0] == 400, path
        for path in ("/etc/passwd", "/", "/chunk/" + good, "/chunks", "/state.json"):
            assert _get(server.port, path)[0] == 404, path
        assert _get(server.port, "/chunks/../../etc/passwd", token=None)[0] == 401  # the token first
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
        conn.request("POST", "/chunks/" + good, body=b"x", headers={"Authorization": f"Bearer {TOKEN}"})
        assert conn.getresponse().status == 405
        conn.close()
        assert server.stats()["served_bad_requests"] == 9
    finally:
        server.close()
    with pytest.raises(ValueError, match="at least 32"):
        PeerServer(Untouchable(), "127.0.0.1", 0, "short")


class _Liar(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        body = b"\0" * SIZE  # the right length, not the chunk
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_peer_that_lies_is_skipped_and_its_bytes_never_reach_a_reader(tmp_path):
    liar = HTTPServer(("127.0.0.1", 0), _Liar)
    threading.Thread(target=liar.serve_forever, daemon=True).start()
    data = os.urandom(SIZE)
    try:
        with ChunkCache(tmp_path / "b", 8 << 20, state_interval=0) as b:
            peers = PeerChunkSource()
            peers.configure([f"127.0.0.1:{liar.server_address[1]}"], TOKEN)
            store = Store({sha(data): data})
            assert b.get(sha(data), SIZE, FallbackSource([peers, store]).fetch) == data
            assert store.calls == 1 and peers.stats()["peer_corrupt"] == 1 and peers.stats()["peer_chunks"] == 0
            assert b.stats()["corrupt"] == 0  # refused before the cache saw them
            with pytest.raises(ChunkUnavailable, match="no peer to ask"):  # skipped now
                peers.fetch(sha(data), SIZE)
            # with no store behind, a lying peer gives the reader an error, never its bytes
            other = os.urandom(SIZE)
            liar_only = PeerChunkSource()
            liar_only.configure([f"127.0.0.1:{liar.server_address[1]}"], TOKEN)
            with pytest.raises(ChunkUnavailable):
                b.get(sha(other), SIZE, FallbackSource([liar_only, Store()]).fetch)
            assert not b.contains(sha(other))
    finally:
        liar.shutdown()
        liar.server_close()


def test_a_damaged_chunk_on_the_serving_node_is_refused_by_the_asking_one(pair):
    a, server, b, data = pair
    path = a.root / sha(data)[:2] / sha(data)
    path.write_bytes(b"\1" * SIZE)  # the disk under A's cache changed after A verified the chunk
    peers = PeerChunkSource()
    peers.configure([f"127.0.0.1:{server.port}"], TOKEN)
    store = Store({sha(data): data})
    assert b.get(sha(data), SIZE, FallbackSource([peers, store]).fetch) == data
    assert store.calls == 1 and peers.stats()["peer_corrupt"] == 1


def test_a_silent_peer_costs_one_bounded_wait_then_is_skipped(tmp_path):
    data = os.urandom(SIZE)
    with socket.socket() as silent:  # accepts connections and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))  # bound, not listening: connection refused
            peers = PeerChunkSource(read_timeout=1.0)
            peers.configure([f"127.0.0.1:{closed.getsockname()[1]}", f"127.0.0.1:{silent.getsockname()[1]}"], TOKEN)
            store = Store({sha(data): data})
            with ChunkCache(tmp_path / "b", 8 << 20, state_interval=0) as b:
                t = time.monotonic()
                assert b.get(sha(data), SIZE, FallbackSource([peers, store]).fetch) == data
                assert time.monotonic() - t < 4  # one read timeout (1 s), not a hang
                assert store.calls == 1
                assert peers.stats()["peer_errors"] == 2 and peers.stats()["peers_skipped"] == 2
                with pytest.raises(ChunkUnavailable, match="no peer to ask"):
                    peers.fetch(sha(data), SIZE)


def test_a_peer_that_trickles_its_answer_is_cut_off(tmp_path):
    class Trickle(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", str(SIZE))
            self.end_headers()
            for _ in range(SIZE):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.2)

        def log_message(self, *args):
            pass

    class Server(HTTPServer):
        def handle_error(self, request, client_address):
            pass  # the client hanging up is the point

    slow = Server(("127.0.0.1", 0), Trickle)
    threading.Thread(target=slow.serve_forever, daemon=True).start()
    try:
        peers = PeerChunkSource(read_timeout=1.0)
        peers.configure([f"127.0.0.1:{slow.server_address[1]}"], TOKEN)
        t = time.monotonic()
        with pytest.raises(ChunkUnavailable, match="timed out|no whole answer"):
            peers.fetch("b" * 64, SIZE)
        assert time.monotonic() - t < 3
    finally:
        slow.shutdown()
        slow.server_close()


def test_too_many_connections_get_503_which_is_a_miss_not_a_failure(pair):
    a, _, b, data = pair
    server = PeerServer(a, "127.0.0.1", 0, TOKEN, max_connections=1)
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as holder:  # takes the one slot
            deadline = time.monotonic() + 10  # once the server accepted it (a fixed wait lost the race under load)
            while server.slots._value:  # read only: taking it to look could hand the holder a 503
                assert time.monotonic() < deadline, "the server never took the holder's connection"
                time.sleep(0.02)
            assert _get(server.port, f"/chunks/{sha(data)}")[0] == 503
            peers = PeerChunkSource()
            peers.configure([f"127.0.0.1:{server.port}"], TOKEN)
            with pytest.raises(ChunkUnavailable, match="not there"):
                peers.fetch(sha(data), SIZE)
            assert peers.stats()["peers_skipped"] == 0 and server.stats()["served_busy"] == 2
            holder.close()
        deadline = time.monotonic() + 10  # the slot comes back once the holder's connection ends
        while _get(server.port, f"/chunks/{sha(data)}")[0] != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        while not server.slots._value:  # that probe's own slot is released only after its answer went out
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert peers.fetch(sha(data), SIZE) == data
    finally:
        server.close()


def test_the_peer_that_answered_is_asked_first_next_time(tmp_path):
    data = os.urandom(SIZE)
    caches = [ChunkCache(tmp_path / f"n{i}", 8 << 20, state_interval=0) for i in range(3)]
    servers = [PeerServer(c, "127.0.0.1", 0, TOKEN) for c in caches]
    try:
        caches[2].get(sha(data), SIZE, lambda n, l: data)
        peers = PeerChunkSource()
        names = [f"127.0.0.1:{s.port}" for s in servers]
        peers.configure(names, TOKEN)
        assert peers.fetch(sha(data), SIZE) == data and peers.peers()[0] == names[2]
        peers.fetch(sha(data), SIZE)
        assert [s.stats()["served_not_found"] for s in servers] == [1, 1, 0]  # asked first the second time
        peers.configure(names[:2], TOKEN)  # node 2 left
        assert peers.peers() == names[:2]
    finally:
        for s in servers:
            s.close()
        for c in caches:
            c.close()


def test_peek_never_fetches_counts_or_serves_unverified_bytes(tmp_path):
    data = os.urandom(SIZE)
    with ChunkCache(tmp_path / "c", 8 << 20, state_interval=0) as cache:
        assert cache.peek(sha(data)) is None
        cache.get(sha(data), SIZE, lambda n, l: data)
        before = cache.stats()
        assert cache.peek(sha(data)) == data
        after = cache.stats()
        assert (after["hits"], after["misses"]) == (before["hits"], before["misses"])
        with pytest.raises(ValueError):
            cache.peek("../state.json")
    (tmp_path / "c" / sha(data)[:2] / sha(data)).write_bytes(b"\2" * SIZE)  # damaged while stopped
    with ChunkCache(tmp_path / "c", 8 << 20, state_interval=0) as cache:
        assert cache.contains(sha(data)) and cache.peek(sha(data)) is None  # unverified since the restart
        assert cache.get(sha(data), SIZE, lambda n, l: data) == data  # a reader refetches it
        assert cache.peek(sha(data)) == data


def test_peer_names():
    assert parse_peer("10.0.0.2:9465") == ("10.0.0.2", 9465)
    assert parse_peer("[fd00::2]:9465") == ("fd00::2", 9465)
    assert parse_peer("node-b.internal:1") == ("node-b.internal", 1)
    assert parse_peer("0.0.0.0:0", any_port=True) == ("0.0.0.0", 0)
    for bad in ("10.0.0.2", "10.0.0.2:0", ":9465", "10.0.0.2:99999", "a/b:1", "user@h:1", "h:1x", "", 5):
        with pytest.raises(ValueError):
            parse_peer(bad)


@pytest.fixture
def two_daemons(tmp_path):
    """Two real chunkfs daemons (FUSE), each with its own chunk directory as its store."""
    from tests.unit.test_chunkfs_fs import Node, _mounted  # noqa: PLC0415 - FUSE tests only

    if not os.path.exists("/dev/fuse"):
        pytest.fail("chunkfs needs /dev/fuse and fusermount3 (the fuse3 package; scripts/setup.sh)")
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    nodes = [Node(tmp_path / name) for name in ("a", "b")]
    yield nodes
    for n in nodes:
        n.stop()
        if _mounted(n.mnt):
            os.system(f"fusermount3 -u -z {n.mnt}")


@pytest.mark.xdist_group("chunkfs")
def test_two_daemons_a_lazy_read_on_one_comes_from_the_others_cache(two_daemons):
    from tests.unit.test_chunkfs_fs import CS, cut, sample  # noqa: PLC0415

    a, b = two_daemons
    data = sample(8 * CS, seed=7)
    spec = cut(data, a.store)  # only A's store has the chunks: B can have them from A alone
    chunks = len(spec["chunks"])
    ca, cb = a.start(), b.start()
    listen_a = ca.request({"op": "peers", "listen": "127.0.0.1:0", "token": TOKEN, "peers": []})["listen"]
    listen_b = cb.request({"op": "peers", "listen": "127.0.0.1:0", "token": TOKEN, "peers": [listen_a]})["listen"]
    assert listen_a.startswith("127.0.0.1:") and listen_a != listen_b
    assert (ca.mount("snap", CS, {"disk": spec}) / "disk").read_bytes() == data
    assert (cb.mount("snap", CS, {"disk": spec}) / "disk").read_bytes() == data
    fb, fa = cb.stats()["fetches"], ca.stats()["fetches"]
    assert (fb["peer_chunks"], fb["store_chunks"], fb["peer_bytes"]) == (chunks, 0, sum(c[1] for c in spec["chunks"]))
    assert (fa["served_chunks"], fa["store_chunks"]) == (chunks, chunks)
    # B with another deployment's token: A refuses it (401) and B's reads come from its store
    other = sample(4 * CS, seed=8)
    spec2 = cut(other, a.store)
    cut(other, b.store)
    assert (ca.mount("snap2", CS, {"disk": spec2}) / "disk").read_bytes() == other
    cb.request({"op": "peers", "listen": listen_b, "token": "w" * 48, "peers": [listen_a]})
    assert (cb.mount("snap2", CS, {"disk": spec2}) / "disk").read_bytes() == other
    fb, fa = cb.stats()["fetches"], ca.stats()["fetches"]
    assert fb["store_chunks"] == len(spec2["chunks"]) and fb["peer_chunks"] == chunks
    assert fa["served_refused"] >= 1 and fb["peer_errors"] >= 1 and fb["peers_skipped"] == 1  # (reads run in parallel)
    # the op refuses what it cannot enforce, and turns peer fetch off
    for bad in ({"token": "short", "peers": [listen_a]}, {"token": TOKEN, "peers": ["nowhere"]},
                {"token": TOKEN, "listen": "127.0.0.1"}, {"token": TOKEN, "peers": "x"}, {"token": 5}):
        with pytest.raises(ChunkfsError) as exc:
            cb.request({"op": "peers", **bad})
        assert exc.value.code == "bad_request", bad
    assert cb.request({"op": "peers"}) == {"listen": "", "peers": 0}
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(parse_peer(listen_b), timeout=2)


def test_a_burst_of_requests_is_answered_never_left_to_time_out(pair):
    """Many readers at once (read-ahead asks for several chunks together): each gets the chunk
    or a 503 (a miss), none waits out its connect timeout (a failure that skips the peer)."""
    a, server, b, data = pair
    peers = PeerChunkSource()
    peers.configure([f"127.0.0.1:{server.port}"], TOKEN)
    start = threading.Barrier(64)
    results = []

    def one():
        start.wait()
        try:
            results.append(peers.fetch(sha(data), SIZE) == data)
        except ChunkUnavailable as exc:
            results.append(str(exc))

    threads = [threading.Thread(target=one) for _ in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert peers.stats()["peer_errors"] == 0, [r for r in results if r is not True][:3]
    assert results.count(True) + server.stats()["served_busy"] == 64


def test_a_node_serves_chunks_of_its_own_files_verified_and_only_those_it_was_given(tmp_path):
    """Chunks inside the node's own files (a snapshot it took: chunkfs.own_files) reach a peer
    as its cached ones do; a piece whose file changed since it was indexed is a 404, never its
    bytes; a path the node was not given is never read."""
    from chunkfs.own_files import OwnFiles  # noqa: PLC0415

    first, second = os.urandom(SIZE), os.urandom(SIZE)
    capture = tmp_path / "memory.ram"
    capture.write_bytes(first + second)
    own = OwnFiles()
    assert own.set({str(capture): [[0, SIZE, sha(first)], [SIZE, SIZE, sha(second)]]}) == 2
    with ChunkCache(tmp_path / "a", 8 << 20, state_interval=0) as a, \
            ChunkCache(tmp_path / "b", 8 << 20, state_interval=0) as b:
        server = PeerServer(a, "127.0.0.1", 0, TOKEN, own=own)
        try:
            peers = PeerChunkSource()
            peers.configure([f"127.0.0.1:{server.port}"], TOKEN)
            store = Store()  # lost them: only node A's files have them
            assert b.get(sha(first), SIZE, FallbackSource([peers, store]).fetch) == first
            assert store.calls == 0 and not a.contains(sha(first))  # served from the file, not cached there
            stats = server.stats()
            assert (stats["served_chunks"], stats["served_file_chunks"], stats["served_file_bytes"]) == (1, 1, SIZE)
            with open(capture, "r+b") as f:  # the file changed under the index
                f.seek(SIZE + 7)
                f.write(b"\xff")
            assert _get(server.port, f"/chunks/{sha(second)}") == (404, b"neither in this node's chunk cache "
                                                                         b"nor in its files\n")
            assert _get(server.port, f"/chunks/{sha(first)}", token=None)[0] == 401  # the token first, as ever
            capture.unlink()
            assert _get(server.port, f"/chunks/{sha(first)}")[0] == 404
            assert server.stats()["served_file_chunks"] == 1
        finally:
            server.close()
    for bad in ({"relative/memory.ram": []}, {"/x": [[0, SIZE, "../../etc"]]}, {"/x": [[-1, SIZE, sha(first)]]},
                {"/x": [[0, 0, sha(first)]]}, {"/x": [[True, SIZE, sha(first)]]}, {"/x": [[0, SIZE]]},
                {"/x": "chunks"}, ["/x"], {"/x\0y": []}):
        with pytest.raises(ValueError):
            own.set(bad)
    assert len(own) == 2  # a refused map leaves the last one
    assert own.set({}) == 0 and own.read(sha(first)) is None
