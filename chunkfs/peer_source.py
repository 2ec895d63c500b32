"""Chunks from peer nodes' chunk caches, asked before the store (issue 24, peer fetch).

Why: a sandbox paused on node A and resumed on node B, or a template built on A and
created on B, reads chunks that A's cache already holds; on the cluster's network they come
faster from A than from the store, and the store's bandwidth is shared by every node. The
peer's side is ``chunkfs.peer_server`` (``GET /chunks/<sha>``, bearer-authenticated, served
only from what its cache and its own files hold).

A peer is only a hint: its bytes are checked by digest here (a lying or damaged peer counts
as not having the chunk, and the next peer or the store is asked), and the chunk cache checks
them again before a reader sees them. Every request is bounded (``connect_timeout`` to
connect, ``read_timeout`` for the whole answer), and a peer that fails (unreachable, too
slow, refuses the token, lies) is skipped for ``skip_seconds``: a dead peer costs one
timeout, not one per chunk. A 404 is an ordinary miss. The peer that answered last is
asked first: a restore's chunks tend to sit together on the node that had the snapshot."""
from __future__ import annotations

import http.client
import logging
import socket
import threading
import time

from .digests import check_sha, digest
from .errors import ChunkUnavailable

log = logging.getLogger(__name__)

CONNECT_TIMEOUT = 0.5
READ_TIMEOUT = 2.0
SKIP_SECONDS = 30.0
MAX_ASKED = 4  # peers asked per chunk before the store (404s are a round trip each)
PATH = "/chunks/"


def parse_peer(value: str, any_port: bool = False) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) as (host, port); ValueError otherwise. ``any_port``:
    port 0 (a listener's "any free port") allowed."""
    if not isinstance(value, str) or len(value) > 300:
        raise ValueError(f"a peer is 'host:port': {value!r}")
    host, sep, port = value.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not (0 if any_port else 1) <= int(port) < 65536 \
            or any(c in host for c in "/@ ?#[]"):
        raise ValueError(f"a peer is 'host:port': {value!r}")
    return host, int(port)


class _PeerDown(Exception):
    """The peer failed (not a miss): skip it for a while."""


class PeerChunkSource:
    """A ``ChunkSource`` over the peers set by ``configure`` (none: every fetch is a miss at
    once, so a daemon without peers pays nothing). Thread-safe; the peer list may change
    while fetches run. ``verifies``: what it returns is the chunk (FallbackSource need not
    hash it again)."""

    name = "peers"
    verifies = True

    def __init__(self, *, connect_timeout: float = CONNECT_TIMEOUT, read_timeout: float = READ_TIMEOUT,
                 skip_seconds: float = SKIP_SECONDS, max_asked: int = MAX_ASKED, clock=time.monotonic):
        self.connect_timeout = float(connect_timeout)
        self.read_timeout = float(read_timeout)
        self.skip_seconds = float(skip_seconds)
        self.max_asked = max(1, int(max_asked))
        self.clock = clock
        self.spec = {"kind": "peers"}
        self._lock = threading.Lock()
        self._peers: list[str] = []  # "host:port", the one that answered last first
        self._token = ""
        self._skip_until: dict[str, float] = {}
        self._counts = {"peer_chunks": 0, "peer_bytes": 0, "peer_misses": 0, "peer_errors": 0, "peer_corrupt": 0}

    def configure(self, peers: list[str], token: str) -> None:
        """The peers to ask (``host:port``) and the bearer token they take. Peers kept from
        the last list keep their order and their skip time."""
        for peer in peers:
            parse_peer(peer)
        with self._lock:
            kept = [p for p in self._peers if p in peers]
            self._peers = kept + [p for p in dict.fromkeys(peers) if p not in kept]
            self._token = token
            self._skip_until = {p: t for p, t in self._skip_until.items() if p in peers}

    def peers(self) -> list[str]:
        with self._lock:
            return list(self._peers)

    def stats(self) -> dict:
        with self._lock:
            now = self.clock()
            return {**self._counts, "peers": len(self._peers),
                    "peers_skipped": sum(1 for t in self._skip_until.values() if t > now)}

    def fetch(self, sha: str, length: int) -> bytes:
        check_sha(sha)
        length = int(length)
        with self._lock:
            now = self.clock()
            candidates = [p for p in self._peers if self._skip_until.get(p, 0.0) <= now][:self.max_asked]
            token = self._token
        if not candidates:
            raise ChunkUnavailable(f"chunk {sha}: no peer to ask")
        reasons = []
        for peer in candidates:
            try:
                data = self._get(peer, sha, length, token)
            except _PeerDown as exc:
                self._down(peer, str(exc))
                reasons.append(f"{peer}: {exc}")
                continue
            if data is None:
                reasons.append(f"{peer}: not there")
                continue
            if len(data) != length or digest(data) != sha:
                self._down(peer, "gave bytes that are not the chunk", corrupt=True)
                reasons.append(f"{peer}: wrong bytes")
                continue
            with self._lock:
                self._counts["peer_chunks"] += 1
                self._counts["peer_bytes"] += length
                if peer in self._peers and self._peers[0] != peer:
                    self._peers.remove(peer)
                    self._peers.insert(0, peer)
            return data
        with self._lock:
            self._counts["peer_misses"] += 1
        raise ChunkUnavailable(f"chunk {sha} from peers: " + "; ".join(reasons))

    def _down(self, peer: str, why: str, corrupt: bool = False) -> None:
        with self._lock:
            now = self.clock()
            already = self._skip_until.get(peer, 0.0) > now  # parallel fetches failing together: said once
            self._skip_until[peer] = now + self.skip_seconds
            self._counts["peer_corrupt" if corrupt else "peer_errors"] += 1
        if not already:
            log.warning("chunk peer %s %s: skipped for %g s", peer, why, self.skip_seconds)

    def _get(self, peer: str, sha: str, length: int, token: str) -> bytes | None:
        """The peer's bytes for the chunk (at most ``length`` + 1), None on 404/503 (a miss),
        ``_PeerDown`` on anything else."""
        host, port = parse_peer(peer)
        conn = http.client.HTTPConnection(host, port, timeout=self.connect_timeout)
        resp = None
        try:
            try:
                conn.connect()
            except OSError as exc:
                raise _PeerDown(f"cannot connect: {exc}") from None
            deadline = self.clock() + self.read_timeout
            sock = conn.sock  # the connection lets go of it once an HTTP/1.0 answer's headers are read
            sock.settimeout(self.read_timeout)
            try:
                conn.request("GET", PATH + sha, headers={"Authorization": f"Bearer {token}"})
                resp = conn.getresponse()
                if resp.status in (404, 503):  # not there / busy: a miss, not a failure
                    return None
                if resp.status != 200:
                    raise _PeerDown(f"answered {resp.status} {resp.reason}")
                body = bytearray()
                while len(body) <= length:
                    left = deadline - self.clock()
                    if left <= 0:
                        raise _PeerDown(f"no whole answer within {self.read_timeout:g} s")
                    sock.settimeout(left)
                    piece = resp.read1(min(1 << 20, length + 1 - len(body)))
                    if not piece:
                        break
                    body += piece
                return bytes(body)
            except (OSError, socket.timeout, http.client.HTTPException) as exc:
                raise _PeerDown(f"{type(exc).__name__}: {exc}") from None
        finally:
            if resp is not None:
                resp.close()  # it holds the socket once the connection let go of it
            conn.close()
