"""A snapshot's prefetch pieces: the chunks a restore reads first, stored once more as a few
larger objects, so a node that never saw the snapshot fetches its start in a handful of GETs
rather than one GET per chunk.

A piece is one object (the S3 store names them ``snapshots/<id>/prefetch/<n>``) holding the
stored bodies of several chunks of the prefetch list one after another, each as the store keeps
it (zstd-compressed or plain: ``compression``); the prefetch list says which chunks each piece
holds, in its order, as ``[sha, length, body length, encoding]``.

Why: a template create on a new node fetches ~130 one-MiB chunks before its guest answers. One
GET each costs the node ~1.3 ms of CPU and the store its own request handling (~3 ms with moto;
tens of milliseconds to the first byte from S3 itself), all while the guest waits. Measured on
loopback (130 chunks of a ``base`` guest's RAM, 4 GETs at a time, zstd, digests checked):
547–693 ms and ~0.8 s of CPU one chunk a GET, 185–256 ms and ~0.3 s in pieces of 8–32.

The pieces are only a faster way to the same chunks. Every chunk taken from a piece is checked
by the cache like any other (digest and length); a chunk they cannot give (its piece missing or
failing, a body that does not decode, or asked for a second time: the cache found the first
bytes wrong, or evicted them) comes from the store as before. A piece is fetched when one of its
chunks is first asked for, with the next ``AHEAD`` pieces, on their own pool; its body is kept
only until each of its chunks has been taken once, or the mount's prefetch list has been
walked (``close``), whichever comes first."""
from __future__ import annotations

import logging
import re
import threading
from concurrent.futures import Future
from dataclasses import dataclass

from .compression import ENCODINGS, META_KEY, BadEncoding, decode
from .digests import check_sha
from .lazyfile import Tally

log = logging.getLogger(__name__)

AHEAD = 3  # pieces fetched after the one asked for: 4 GETs in flight, as a prefetch list runs 4 chunks
MAX_PIECES = 1024
MAX_PIECE_BYTES = 16 << 20  # the writer closes a piece at 4 MiB (agent.stores.prefetch_pieces)
MAX_BYTES = 512 << 20  # all of a mount's pieces (the writer stops at 256 MiB): what the daemon may hold
MAX_CHUNK = 64 << 20
WAIT = 60.0  # a piece's GET is bounded by the source's own timeouts; this bounds the wait on it
KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,511}$")


@dataclass(frozen=True)
class Place:
    """Where one chunk's stored body lies in a piece."""
    piece: int
    start: int
    size: int
    length: int  # the chunk's own length (decoded)
    encoding: str


def parse(pieces) -> tuple[list[str], dict[str, Place]]:
    """(the pieces' object keys, {sha: its place}) from a prefetch list's ``pieces``:
    ``[{"key", "chunks": [[sha, length, body length, encoding], ...]}, ...]``; ValueError when
    malformed. A chunk in two pieces is taken from the first."""
    if not isinstance(pieces, list) or len(pieces) > MAX_PIECES:
        raise ValueError(f"pieces must be a list of at most {MAX_PIECES}")
    keys: list[str] = []
    where: dict[str, Place] = {}
    total = 0
    for n, piece in enumerate(pieces):
        if not isinstance(piece, dict) or not isinstance(piece.get("key"), str) or not KEY.match(piece["key"]) \
                or ".." in piece["key"].split("/"):
            raise ValueError(f"piece {n}: needs a relative object key")
        chunks = piece.get("chunks")
        if not isinstance(chunks, list) or not chunks:
            raise ValueError(f"piece {n}: chunks must be a non-empty list")
        start = 0
        for entry in chunks:
            if not (isinstance(entry, list) and len(entry) == 4 and isinstance(entry[0], str)
                    and all(isinstance(x, int) and not isinstance(x, bool) for x in entry[1:3])
                    and isinstance(entry[3], str)):
                raise ValueError(f"piece {n}: a chunk is [sha, length, body length, encoding]")
            sha, length, size, encoding = check_sha(entry[0]), entry[1], entry[2], entry[3]
            if not 0 < length <= MAX_CHUNK or not 0 < size <= length + 4096:  # a frame adds a few bytes at most
                raise ValueError(f"piece {n}: bad lengths for chunk {sha}")
            if encoding and encoding not in ENCODINGS:
                raise ValueError(f"piece {n}: unknown encoding {encoding!r}")
            where.setdefault(sha, Place(n, start, size, length, encoding))
            start += size
        if start > MAX_PIECE_BYTES:
            raise ValueError(f"piece {n}: more than {MAX_PIECE_BYTES} bytes")
        total += start
        if total > MAX_BYTES:
            raise ValueError(f"pieces of more than {MAX_BYTES} bytes in all")
        keys.append(piece["key"])
    return keys, where


class PrefetchPieces:
    """One mount's pieces: ``take(sha, length)`` gives a chunk's bytes from its piece (fetched
    then, with the next ``AHEAD``) once, or None. ``get(key, limit)``: an object's body from
    the store (``sources.S3ChunkSource.get``); ``pool``: the executor the GETs run on."""

    def __init__(self, keys: list[str], where: dict[str, Place], get, pool, *, ahead: int = AHEAD,
                 counters: PieceCounters | None = None):
        self.keys = keys
        self.get = get
        self.pool = pool
        self.ahead = max(0, int(ahead))
        self.counters = counters or PieceCounters()
        self._where = dict(where)
        self._left = [0] * len(keys)  # chunks of each piece not yet taken
        self._limits = [0] * len(keys)  # each piece's body length
        for place in self._where.values():
            self._left[place.piece] += 1
            self._limits[place.piece] = max(self._limits[place.piece], place.start + place.size)
        self._bodies: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._closed = False

    def skip(self, shas) -> None:
        """Chunks the node has already (its cache, its own files): never asked for here, so a
        piece holding only those is never fetched."""
        with self._lock:
            for sha in shas:
                place = self._where.pop(sha, None)
                if place is not None:
                    self._left[place.piece] -= 1

    def _start(self, n: int) -> Future | None:
        """Piece ``n``'s GET (started now unless it was), and the next ``ahead`` with chunks
        left. Call with the lock held."""
        for m in range(n, min(n + 1 + self.ahead, len(self.keys))):
            if m not in self._bodies and self._left[m] > 0:
                try:
                    self._bodies[m] = self.pool.submit(self._fetch, m)
                except RuntimeError:  # the pool was shut down: the daemon is stopping
                    break
        return self._bodies.get(n)

    def _fetch(self, n: int) -> bytes:
        body = self.get(self.keys[n], self._limits[n])
        self.counters.add(gets=1, bytes=len(body))
        return body

    def take(self, sha: str, length: int) -> bytes | None:
        with self._lock:
            place = None if self._closed else self._where.pop(sha, None)
            if place is None or place.length != length:
                return None
            future = self._start(place.piece)
        try:
            body = future.result(timeout=WAIT) if future is not None else None
        except Exception as exc:  # noqa: BLE001 - a failed piece: its chunks come from the store
            log.info("prefetch piece %s: %s", self.keys[place.piece], exc)
            body = None
        finally:
            self._taken(place.piece)
        if body is None or len(body) < place.start + place.size:
            return None
        try:
            data = decode(body[place.start:place.start + place.size], {META_KEY: place.encoding}, length)
        except BadEncoding as exc:
            log.warning("prefetch piece %s, chunk %s: %s", self.keys[place.piece], sha, exc)
            return None
        self.counters.add(chunks=1)
        return data

    def _taken(self, n: int) -> None:
        with self._lock:
            self._left[n] -= 1
            if self._left[n] <= 0:
                self._bodies.pop(n, None)

    def close(self) -> None:
        """The prefetch list was walked (or the mount went): what is left comes from the store."""
        with self._lock:
            self._closed = True
            self._where.clear()
            self._bodies.clear()

    @property
    def held(self) -> int:
        """Pieces fetched or being fetched whose bodies are still kept."""
        with self._lock:
            return len(self._bodies)


class PieceCounters(Tally):
    """The daemon's piece GETs, their bytes (as they crossed the wire) and the chunks taken from them."""

    FIELDS = ("gets", "bytes", "chunks")
    PREFIX = "piece_"


class PiecesFirst:
    """A chunk source: the mount's pieces first, then ``store`` (the daemon's counting store
    source, which also counts what the pieces gave: those bytes came from the store too)."""

    def __init__(self, pieces: PrefetchPieces, store):
        self.pieces = pieces
        self.store = store
        self.name = f"prefetch pieces | {store.name}"
        self.spec = {"kind": "pieces", "pieces": len(pieces.keys), "then": getattr(store, "spec", {})}

    def fetch(self, sha: str, length: int) -> bytes:
        data = self.pieces.take(sha, length)
        if data is None:
            return self.store.fetch(sha, length)
        counted = getattr(self.store, "counted", None)
        if counted is not None:
            counted(data)  # (the piece's GET counted its wire bytes)
        return data
