"""The node's chunk cache and its own files' chunks, served to peer nodes:
``GET /chunks/<sha256>`` (issue 24, peer fetch).

Why a server at all: a chunk one node holds is one round trip on the cluster's network away
from another that needs it (``chunkfs.peer_source`` asks before the store). It holds chunks
in two places: its chunk cache, and its own files (``chunkfs.own_files``: the snapshots it
took, its image builds, its downloads), each piece read at its offset and checked against its
digest before a byte is sent.

What it never does: fetch. A chunk in neither is a 404, so a peer cannot make this node spend
the store's bandwidth (or its cache's room) on its behalf, and a request never changes the
cache's hot/cold order or hit counts (``ChunkCache.peek``).

Guarded: every request needs ``Authorization: Bearer <token>`` (compared in constant time;
401 otherwise, before the path is looked at); the path must be ``/chunks/`` and 64 lower-case
hex digits (400 otherwise, 404 for any other path) before anything touches the file system;
at most ``max_connections`` are served at once (one request each, HTTP/1.0), more get a 503 at
once, and a client that does not send its request within ``request_timeout`` is dropped. It
listens on the node's own address (the cluster's network); a sandbox cannot reach it
(docs/cluster.md, "Peer fetch")."""
from __future__ import annotations

import hmac
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from socketserver import ThreadingMixIn

from .digests import SHA

log = logging.getLogger(__name__)

PATH = "/chunks/"
MAX_CONNECTIONS = 16
REQUEST_TIMEOUT = 5.0
MIN_TOKEN = 32
# what stats() counts: chunks and bytes served (of them from the node's own files), 404s, 401s,
# 400s, 503s (too many at once)
COUNTS = ("served_chunks", "served_bytes", "served_file_chunks", "served_file_bytes", "served_not_found",
          "served_refused", "served_bad_requests", "served_busy")
BUSY = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n"
        b"Retry-After: 1\r\nConnection: close\r\n\r\nbusy\n")


def bearer_matches(authorization: str | None, token: str) -> bool:
    """``Authorization: Bearer <token>``, compared in constant time (never with an empty token)."""
    scheme, _, given = (authorization or "").partition(" ")
    return bool(token) and scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


class _Handler(BaseHTTPRequestHandler):
    server_version = "aenv-chunk-peer/1"
    sys_version = ""

    def setup(self):
        self.timeout = self.server.owner.request_timeout  # StreamRequestHandler applies it to the socket
        super().setup()

    def do_GET(self):  # noqa: N802 - http.server's name
        owner: PeerServer = self.server.owner
        if not bearer_matches(self.headers.get("Authorization"), owner.token):
            owner.count("served_refused")
            return self._answer(401, b"chunk peers need Authorization: Bearer <token>\n",
                                [("WWW-Authenticate", 'Bearer realm="aenv chunk peers"')])
        if not self.path.startswith(PATH):
            return self._answer(404, b"not found\n")
        sha = self.path[len(PATH):]
        if not SHA.match(sha) or len(sha) != 64:  # the regex's $ would let a trailing newline through
            owner.count("served_bad_requests")
            return self._answer(400, b"not a chunk digest (64 lower-case hex digits)\n")
        data = owner.cache.peek(sha)
        if data is None and owner.own is not None:
            data = owner.own.read(sha)  # verified: a file that changed since it was indexed gives nothing
            if data is not None:
                owner.count("served_file_chunks")
                owner.count("served_file_bytes", len(data))
        if data is None:
            owner.count("served_not_found")
            return self._answer(404, b"neither in this node's chunk cache nor in its files\n")
        owner.count("served_chunks")
        owner.count("served_bytes", len(data))
        self._answer(200, data, content_type="application/octet-stream")

    def do_HEAD(self):  # noqa: N802
        self._answer(405, b"GET only\n", [("Allow", "GET")])

    do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD  # noqa: N815

    def _answer(self, status: int, body: bytes, headers=(), content_type: str = "text/plain; charset=utf-8"):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format, *args):  # noqa: A002 - one line per chunk would drown the daemon's log
        log.debug("peer %s: " + format, self.client_address[0], *args)


class _Server(ThreadingMixIn, HTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # socketserver's 5 drops a burst of connects (a reader's read-ahead asks for several chunks
    # at once) until SYN retries, past the asking side's connect timeout; beyond the slots,
    # connections are accepted and answered 503
    request_queue_size = 128

    def process_request(self, request, client_address):
        if not self.owner.slots.acquire(blocking=False):
            self.owner.count("served_busy")
            try:
                request.settimeout(0.5)
                request.sendall(BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.owner.slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.owner.slots.release()


class PeerServer:
    """Serves ``cache`` (a ``ChunkCache``) and ``own`` (an ``OwnFiles``, or None) on
    ``address:port`` (0: any free port) in a thread."""

    def __init__(self, cache, address: str, port: int, token: str, *, own=None, max_connections: int = MAX_CONNECTIONS,
                 request_timeout: float = REQUEST_TIMEOUT):
        if len(token or "") < MIN_TOKEN:
            raise ValueError(f"the chunk peer token must be at least {MIN_TOKEN} characters")
        self.cache = cache
        self.own = own
        self.token = token
        self.request_timeout = float(request_timeout)
        self.slots = threading.BoundedSemaphore(max(1, int(max_connections)))
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(COUNTS, 0)
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        server_class = type("_PeerHTTPServer", (_Server,), {"address_family": family})
        self._server = server_class((address, int(port)), _Handler)
        self._server.owner = self
        self.address = address
        self.requested_port = int(port)  # 0: any (the daemon's "peers" op compares what it was asked)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="chunk-peer-server", daemon=True)
        self._thread.start()
        log.info("serving the chunk cache to peers on %s:%d", address, self.port)

    @property
    def listen(self) -> str:
        return f"[{self.address}]:{self.port}" if ":" in self.address else f"{self.address}:{self.port}"

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def stats(self) -> dict:
        with self._lock:
            return dict(self._counts)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
