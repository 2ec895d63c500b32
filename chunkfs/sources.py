"""Where the chunk cache fetches chunks from: the snapshot store's chunk objects.

A source gives a chunk's bytes by name (``fetch(sha, length)``) or raises
``ChunkUnavailable``, and never hangs: a FUSE read waits on it, and behind that read a guest
vCPU. It does not verify the bytes (the cache does, and fetches again); ``FallbackSource``
does, to move on to the next source. The object names are the S3 store's
(agent/stores/s3_objects.py: ``<prefix>chunks/<sha>``, maybe compressed: ``compression``); this
package does not import it."""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol, runtime_checkable

from .compression import BadEncoding, decode
from .digests import check_sha, digest
from .errors import ChunkUnavailable

log = logging.getLogger(__name__)

# A GET of a 4 MiB chunk takes tens of milliseconds at 1 Gbit/s: 8 s without a byte is a dead
# store. Three attempts (S3 answers 503 SlowDown under load) bound a fetch to about 30 s.
CONNECT_TIMEOUT = 2.0
READ_TIMEOUT = 8.0
ATTEMPTS = 3

# A mount of a capture handed over while it still uploads (the daemon's ``store_wait``, in ping's
# ``features``): how long it may wait at most, and how often it asks again.
STORE_WAIT = "store_wait"
MAX_STORE_WAIT = 3600.0
STORE_WAIT_POLL = 0.1


@runtime_checkable
class ChunkSource(Protocol):
    name: str

    def fetch(self, sha: str, length: int) -> bytes:
        """The chunk's bytes (unverified), or ``ChunkUnavailable`` within a bounded time."""
        ...


def s3_client(endpoint: str = "", region: str = "", *, connect_timeout: float = CONNECT_TIMEOUT,
              read_timeout: float = READ_TIMEOUT, attempts: int = ATTEMPTS, pool: int = 16, **credentials):
    """A boto3 S3 client whose every request gives up: ``connect_timeout`` to connect,
    ``read_timeout`` between bytes of an answer, ``attempts`` tries in all (botocore's own
    default is 60 s per read and retries on top). Credentials: the standard AWS sources, or
    ``aws_access_key_id=…, aws_secret_access_key=…``."""
    import boto3  # noqa: PLC0415 - only S3 sources need it
    from botocore.config import Config  # noqa: PLC0415

    config = Config(connect_timeout=connect_timeout, read_timeout=read_timeout,
                    retries={"max_attempts": max(1, int(attempts)), "mode": "standard"},
                    max_pool_connections=pool, s3={"addressing_style": "path"} if endpoint else None)
    return boto3.client("s3", endpoint_url=endpoint or None, region_name=region or None, config=config,
                        **credentials)


def signed_getter(endpoint: str, bucket: str, region: str = "", *, connect_timeout: float = CONNECT_TIMEOUT,
                  read_timeout: float = READ_TIMEOUT, attempts: int = ATTEMPTS, pool: int = 16, **credentials):
    """``s3_get.SignedGetter`` with ``s3_client``'s bounds, or None without an endpoint (the
    boto3 client then GETs). Credentials as ``s3_client`` takes them."""
    if not endpoint:
        return None
    from .s3_get import SignedGetter  # noqa: PLC0415

    given = None
    if credentials.get("aws_access_key_id"):
        from botocore.credentials import Credentials  # noqa: PLC0415

        given = Credentials(credentials["aws_access_key_id"], credentials.get("aws_secret_access_key", ""),
                            credentials.get("aws_session_token"))
    return SignedGetter(endpoint, bucket, region, connect_timeout=connect_timeout, read_timeout=read_timeout,
                        attempts=attempts, pool=pool, credentials=given)


def _error_code(exc: Exception) -> str:
    code = getattr(exc, "code", None)  # s3_get.S3GetError
    if isinstance(code, str) and code:
        return code
    response = getattr(exc, "response", None)  # botocore's ClientError has one; its ReadTimeoutError None
    code = response.get("Error", {}).get("Code", "") if isinstance(response, dict) else ""
    return str(code) or type(exc).__name__


class S3ChunkSource:
    """``<prefix>chunks/<sha>`` in a bucket, as the S3 snapshot store writes them (a compressed
    one decompressed: ``compression``; ``wire_bytes`` counts the bodies as they came). Give it
    a client from ``s3_client`` (bounded timeouts), and for a store with an explicit endpoint
    a ``getter`` (``s3_get.SignedGetter``: the same GET at a third of the CPU)."""

    def __init__(self, client, bucket: str, prefix: str = "", getter=None):
        if not bucket:
            raise ValueError("an S3 chunk source needs a bucket")
        self.client = client
        self.getter = getter
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""  # as S3Objects normalizes it
        self.name = f"s3://{bucket}/{self.prefix}"
        self.spec = {"kind": "s3", "bucket": bucket, "prefix": prefix}
        self._lock = threading.Lock()
        self.wire_bytes = 0

    def key(self, sha: str) -> str:
        return f"{self.prefix}chunks/{check_sha(sha)}"

    def _get(self, key: str, limit: int) -> tuple[bytes, dict | None]:
        """At most ``limit`` bytes of an object's body and its user metadata (counted in
        ``wire_bytes``); errors of every kind as they come."""
        if self.getter is not None:
            body, metadata = self.getter.get(key, limit)
        else:
            answer = self.client.get_object(Bucket=self.bucket, Key=key)
            try:
                body = answer["Body"].read(limit)
            finally:
                answer["Body"].close()
            metadata = answer.get("Metadata")
        with self._lock:
            self.wire_bytes += len(body)
        return body, metadata

    def get(self, relative_key: str, limit: int) -> bytes:
        """An object other than a chunk under the prefix (a snapshot's prefetch piece:
        ``chunkfs.pieces``), at most ``limit`` bytes; ``ChunkUnavailable`` when it cannot be had."""
        try:
            return self._get(self.prefix + relative_key, int(limit))[0]
        except Exception as exc:  # noqa: BLE001
            raise ChunkUnavailable(f"{relative_key} from {self.name}: {_error_code(exc)}: {exc}") from exc

    def fetch(self, sha: str, length: int) -> bytes:
        try:  # a compressed body is smaller than its chunk: more than asked is wrong anyway
            body, metadata = self._get(self.key(sha), int(length) + 1)
        except Exception as exc:  # missing, denied, unreachable, timed out: all the same to a reader
            raise ChunkUnavailable(f"chunk {sha} from {self.name}: {_error_code(exc)}: {exc}") from exc
        try:
            return decode(body, metadata, int(length))
        except BadEncoding as exc:  # no bytes are not the chunk: the cache counts it corrupt, fetches again
            log.warning("chunk %s from %s: %s", sha, self.name, exc)
            return b""


class DirChunkSource:
    """``<root>/chunks/<sha>`` files: a chunk store on shared storage (NFS and the like)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.name = f"dir:{self.root}"
        self.spec = {"kind": "dir", "root": str(self.root)}

    def fetch(self, sha: str, length: int) -> bytes:
        path = self.root / "chunks" / check_sha(sha)
        try:
            with open(path, "rb") as f:
                return f.read(int(length) + 1)
        except OSError as exc:
            raise ChunkUnavailable(f"chunk {sha} from {self.name}: {exc.strerror or exc}") from exc


class LocalFileSource:
    """Chunks this node already has inside its own files (an image build, a template
    snapshot, an earlier download): ``{sha: (path, offset)}``, read with one pread. The
    bytes are not trusted (a file may have changed since it was indexed): put it first in a
    ``FallbackSource``, which checks them and otherwise asks the next source."""

    name = "local-files"

    def __init__(self, where: dict):
        self.where = {check_sha(sha): (str(path), int(offset)) for sha, (path, offset) in where.items()}
        self.spec = {"kind": "local", "count": len(self.where)}

    def fetch(self, sha: str, length: int) -> bytes:
        found = self.where.get(sha)
        if found is None:
            raise ChunkUnavailable(f"chunk {sha} is in none of this node's files")
        path, offset = found
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                return os.pread(fd, int(length), offset)
            finally:
                os.close(fd)
        except OSError as exc:
            raise ChunkUnavailable(f"chunk {sha} from {path}: {exc.strerror or exc}") from exc


class FallbackSource:
    """The first of ``sources`` that has the chunk (a peer, then the store). A source whose
    bytes are not the chunk counts as not having it; if none has the right bytes but one gave
    wrong ones, those are returned, so the cache sees (and counts) a corrupt chunk rather than
    a missing one. Not hashed here: the bytes of a source that ``verifies`` them itself, and
    the last source's (nothing is left to ask: the cache checks them)."""

    def __init__(self, sources: Iterable[ChunkSource]):
        self.sources = list(sources)
        if not self.sources:
            raise ValueError("a fallback source needs at least one source")
        self.name = " | ".join(s.name for s in self.sources)
        self.spec = {"kind": "fallback", "sources": [getattr(s, "spec", {"name": s.name}) for s in self.sources]}

    def fetch(self, sha: str, length: int) -> bytes:
        wrong: bytes | None = None
        reasons = []
        for source in self.sources:
            try:
                data = source.fetch(sha, length)
            except ChunkUnavailable as exc:
                reasons.append(str(exc))
                continue
            if source is self.sources[-1] and wrong is None or getattr(source, "verifies", False) or (
                    len(data) == length and digest(data) == sha):
                return data
            reasons.append(f"{source.name}: wrong bytes")
            if wrong is None:
                wrong = data
        if wrong is not None:
            return wrong
        raise ChunkUnavailable(f"chunk {sha} is in none of the sources: " + "; ".join(reasons))


class WaitingSource:
    """``source`` asked again, every ``poll`` seconds, for a chunk it does not have yet, until
    ``until`` (a ``clock`` time): a fork's capture is handed to other nodes before its upload
    ends, and a chunk neither its node (peer fetch) nor the store can give at this moment (the
    peer busy, the upload not there yet) will be there. Past ``until`` it is an ordinary
    source again. A read still ends at its own deadline (``lazyfile``); the fetch goes on."""

    def __init__(self, source: ChunkSource, until: float, *, poll: float = STORE_WAIT_POLL,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
        self.source = source
        self.until = float(until)
        self.poll = float(poll)
        self.clock = clock
        self.sleep = sleep
        self.name = source.name
        self.spec = getattr(source, "spec", {"name": source.name})
        self.waits = 0

    def fetch(self, sha: str, length: int) -> bytes:
        while True:
            try:
                return self.source.fetch(sha, length)
            except ChunkUnavailable:
                if self.clock() + self.poll > self.until:
                    raise
            self.waits += 1
            self.sleep(self.poll)


class CountingSource:
    """``source`` counting the chunks and bytes it gave (the daemon's store: how much came
    from the store rather than from peers or the node's own files); ``wire_bytes``: the
    source's own count of what crossed the wire (compressed), else the bytes it gave."""

    def __init__(self, source: ChunkSource):
        self.source = source
        self.name = source.name
        self.spec = getattr(source, "spec", {"name": source.name})
        self._lock = threading.Lock()
        self.chunks = 0
        self.bytes = 0

    def fetch(self, sha: str, length: int) -> bytes:
        return self.counted(self.source.fetch(sha, length))

    def counted(self, data: bytes) -> bytes:
        """Counts a chunk the source gave by another route (a prefetch piece: ``chunkfs.pieces``)."""
        with self._lock:
            self.chunks += 1
            self.bytes += len(data)
        return data

    @property
    def wire_bytes(self) -> int:
        wire = getattr(self.source, "wire_bytes", None)
        return wire if isinstance(wire, int) else self.bytes


_clients: dict[tuple, object] = {}
_clients_lock = threading.Lock()


def source_from_spec(spec: dict) -> ChunkSource:
    """A source from its JSON description (what the agent sends the chunkfs daemon with a
    mount): ``{"kind": "s3", "bucket", "prefix"?, "endpoint"?, "region"?, "connect_timeout"?,
    "read_timeout"?, "attempts"?}`` (credentials: the daemon's standard AWS sources; one
    client per endpoint and timeouts, shared by every mount), ``{"kind": "dir", "root"}``, or
    ``{"kind": "fallback", "sources": [spec, ...]}``."""
    kind = spec.get("kind")
    if kind == "s3":
        options = (spec.get("endpoint") or "", spec.get("region") or "",
                   float(spec.get("connect_timeout", CONNECT_TIMEOUT)), float(spec.get("read_timeout", READ_TIMEOUT)),
                   int(spec.get("attempts", ATTEMPTS)))
        with _clients_lock:
            client = _clients.get(options)
            if client is None:
                endpoint, region, connect, read, attempts = options
                client = _clients[options] = s3_client(endpoint, region, connect_timeout=connect,
                                                       read_timeout=read, attempts=attempts)
        source = S3ChunkSource(client, spec["bucket"], spec.get("prefix") or "")
        source.spec = dict(spec)
        return source
    if kind == "dir":
        return DirChunkSource(Path(spec["root"]))
    if kind == "fallback":
        return FallbackSource([source_from_spec(s) for s in spec.get("sources") or []])
    raise ValueError(f"unknown chunk source {spec!r}")
