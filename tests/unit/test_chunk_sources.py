"""Where the chunk cache fetches from (chunkfs.sources): the S3 store's own chunk objects
(a snapshot committed by agent.stores.s3.S3Store to a real moto S3 server, read back chunk by
chunk through the cache), a chunk directory, the fallback between sources, and a store that is
down or silent giving ChunkUnavailable within the client's timeouts instead of a hang."""
from __future__ import annotations

import hashlib
import json
import os
import socket
import time
import uuid

import pytest

from agent.stores.s3 import S3Store
from chunkfs.cache import ChunkCache
from chunkfs.errors import ChunkCorrupt, ChunkUnavailable
from chunkfs.sources import (ChunkSource, DirChunkSource, FallbackSource, S3ChunkSource, WaitingSource, s3_client,
                             signed_getter, source_from_spec)
from harness.moto_s3 import REGION, moto_server, default_credentials, CLIENT_KEYS
from harness.ports import free_port as _free_port

BUCKET = "aenv-chunks"
CHUNK = 64 << 10


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def s3_endpoint():
    default_credentials()
    with moto_server(BUCKET) as url:
        yield url


def _source(endpoint: str, bucket: str, prefix: str = "", lean: bool = False, **bounds) -> S3ChunkSource:
    """The chunk source through boto3's client, or (``lean``) through ``s3_get.SignedGetter``
    as the chunkfs daemon makes it for a store with an endpoint."""
    client = s3_client(endpoint, REGION, **bounds, **CLIENT_KEYS)
    getter = signed_getter(endpoint, bucket, REGION, **bounds, **CLIENT_KEYS) if lean else None
    return S3ChunkSource(client, bucket, prefix, getter=getter)


@pytest.mark.parametrize("lean", [False, True], ids=["boto3", "signed-getter"])
def test_s3_source_reads_what_the_s3_store_committed(s3_endpoint, tmp_path, lean):
    """A snapshot uploaded by the store, read back on "another node" chunk by chunk through
    the cache: every byte equal, holes absent from the manifest, nothing fetched twice."""
    client = s3_client(s3_endpoint, REGION, **CLIENT_KEYS)
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    home = tmp_path / "node-a"
    store = S3Store(home=home, images_dir=tmp_path / "images", bucket=BUCKET, client=client, prefix=prefix,
                    chunk_size=CHUNK, concurrency=2)
    snap = store.prepare("snap-1")
    ram = bytearray(8 * CHUNK)
    for i in (0, 3, 7):
        ram[i * CHUNK + 5: i * CHUNK + 5 + 1000] = os.urandom(1000)
    (snap / "memory.ram").write_bytes(bytes(ram))
    (snap / "device.state").write_bytes(b"QEVM" + os.urandom(3000))
    (snap / "manifest.json").write_text(json.dumps({"dir": str(snap)}))
    store.commit("snap-1")
    doc = json.loads(client.get_object(Bucket=BUCKET, Key=f"{prefix}/snapshots/snap-1/manifest.json")["Body"].read())

    source = _source(s3_endpoint, BUCKET, prefix, lean)
    assert (source.getter is not None) == lean
    assert isinstance(source, ChunkSource) and source.name == f"s3://{BUCKET}/{prefix}/"
    with ChunkCache(tmp_path / "node-b-cache", 64 * CHUNK) as cache:
        for name, entry in doc["files"].items():
            rebuilt = bytearray(entry["size"])
            for offset, length, name_sha in entry["chunks"]:
                rebuilt[offset:offset + length] = cache.get(name_sha, length, source.fetch)
            assert bytes(rebuilt) == (snap / name).read_bytes(), name
        assert [c[0] for c in doc["files"]["memory.ram"]["chunks"]] == [0, 3 * CHUNK, 7 * CHUNK]
        assert cache.stats()["misses"] == cache.stats()["entries"] == 4
    with pytest.raises(ChunkUnavailable, match="NoSuchKey|404"):
        source.fetch(sha(b"never stored"), 12)
    with pytest.raises(ChunkUnavailable, match="NoSuchBucket|404"):
        _source(s3_endpoint, "no-such-bucket", prefix, lean).fetch(doc["files"]["memory.ram"]["chunks"][0][2], CHUNK)
    assert source.wire_bytes > 0


def test_signed_getter_signs_bounds_and_reads_metadata():
    """What the store sees from ``s3_get.SignedGetter`` (moto does not check signatures: a
    recording server here): a SigV4-signed path-style GET of the key, user metadata read back,
    a body never read past the limit, a 503 retried, a 404 an error with its status."""
    import http.server
    import threading

    seen, answers = [], []

    class Store(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            seen.append((self.path, dict(self.headers)))
            status, body = answers.pop(0)
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("x-amz-meta-aenv-encoding", "zstd")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Store)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        getter = signed_getter(f"http://127.0.0.1:{server.server_port}", "my-bucket", REGION, connect_timeout=1,
                               read_timeout=2, attempts=2, **CLIENT_KEYS)
        answers[:] = [(503, b"slow down"), (200, b"x" * 100)]
        body, metadata = getter.get("pre/chunks/" + sha(b"a"), 10)
        assert body == b"x" * 10 and metadata == {"aenv-encoding": "zstd"}
        assert len(seen) == 2  # the 503 was retried
        path, headers = seen[-1]
        assert path == "/my-bucket/pre/chunks/" + sha(b"a")
        assert headers["Authorization"].startswith(f"AWS4-HMAC-SHA256 Credential={CLIENT_KEYS['aws_access_key_id']}/")
        assert "/s3/aws4_request" in headers["Authorization"] and headers.get("X-Amz-Date")
        answers[:] = [(404, b"<Error><Code>NoSuchKey</Code></Error>")]
        with pytest.raises(Exception, match="404"):
            getter.get("pre/chunks/" + sha(b"b"), 10)
    finally:
        server.shutdown()


@pytest.mark.parametrize("lean", [False, True], ids=["boto3", "signed-getter"])
def test_s3_source_gives_up_on_a_closed_port_quickly(lean):
    source = _source(f"http://127.0.0.1:{_free_port()}", BUCKET, lean=lean, connect_timeout=1, read_timeout=1,
                     attempts=2)
    start = time.monotonic()
    with pytest.raises(ChunkUnavailable):
        source.fetch(sha(b"x"), 1)
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("lean", [False, True], ids=["boto3", "signed-getter"])
def test_s3_source_gives_up_on_a_store_that_never_answers(lean):
    """Connected, then silence (a hung store, a black-holed route): the read timeout ends it."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)  # never accepted, never answered
        source = _source(f"http://127.0.0.1:{silent.getsockname()[1]}", BUCKET, lean=lean, connect_timeout=1,
                         read_timeout=1, attempts=2)
        start = time.monotonic()
        with pytest.raises(ChunkUnavailable):
            source.fetch(sha(b"x"), 1)
        assert 0.9 < time.monotonic() - start < 8


def test_dir_source_reads_chunk_files(tmp_path):
    data = os.urandom(5000)
    (tmp_path / "chunks").mkdir()
    (tmp_path / "chunks" / sha(data)).write_bytes(data)
    source = DirChunkSource(tmp_path)
    assert source.fetch(sha(data), 5000) == data
    with pytest.raises(ChunkUnavailable, match="No such file"):
        source.fetch(sha(b"absent"), 6)
    with pytest.raises(ValueError):  # a name is never a path
        source.fetch("../chunks/" + sha(data), 5000)


class Fixed:
    def __init__(self, name, chunks=None, wrong=False):
        self.name, self.chunks, self.wrong, self.calls = name, chunks or {}, wrong, 0

    def fetch(self, name, length):
        self.calls += 1
        if self.wrong:
            return b"\0" * length
        if name not in self.chunks:
            raise ChunkUnavailable(f"{self.name}: no {name}")
        return self.chunks[name]


def test_fallback_takes_the_first_source_with_the_right_bytes(tmp_path):
    data = os.urandom(3000)
    name = sha(data)
    empty, liar, good = Fixed("peer"), Fixed("bad-peer", wrong=True), Fixed("store", {name: data})
    assert FallbackSource([empty, liar, good]).fetch(name, 3000) == data
    assert (empty.calls, liar.calls, good.calls) == (1, 1, 1)
    assert FallbackSource([good, empty]).fetch(name, 3000) == data and empty.calls == 1
    with pytest.raises(ChunkUnavailable, match="peer: no .*store: no"):
        FallbackSource([Fixed("peer"), Fixed("store")]).fetch(name, 3000)
    # only wrong bytes anywhere: the cache sees them, refetches, and refuses
    with ChunkCache(tmp_path / "cache", 1 << 20) as cache, pytest.raises(ChunkCorrupt):
        cache.get(name, 3000, FallbackSource([Fixed("peer"), liar]).fetch)
    assert cache.stats()["corrupt"] == 3


def test_a_waiting_source_asks_again_until_the_chunk_is_there_or_its_time_is_up():
    data = os.urandom(3000)
    name = sha(data)
    now = [100.0]
    store = Fixed("store")
    slept = []

    def sleep(seconds):
        slept.append(seconds)
        now[0] += seconds
        if len(slept) == 5:  # the upload put it meanwhile
            store.chunks[name] = data

    waiting = WaitingSource(store, until=110.0, poll=0.5, clock=lambda: now[0], sleep=sleep)
    assert waiting.fetch(name, 3000) == data
    assert store.calls == 6 and slept == [0.5] * 5 and waiting.waits == 5
    # past its time it is an ordinary source: the miss is said at once
    other = sha(b"never")
    store.calls, now[0] = 0, 110.0
    with pytest.raises(ChunkUnavailable, match="store: no"):
        waiting.fetch(other, 5)
    assert store.calls == 1 and len(slept) == 5


def test_sources_from_their_json_description(s3_endpoint, tmp_path):
    """What the agent sends the chunkfs daemon with a mount; S3 mounts share one client."""
    data, other = os.urandom(2000), os.urandom(3000)
    client = s3_client(s3_endpoint, REGION, **CLIENT_KEYS)
    client.put_object(Bucket=BUCKET, Key=f"spec/chunks/{sha(data)}", Body=data)
    (tmp_path / "chunks").mkdir()
    (tmp_path / "chunks" / sha(other)).write_bytes(other)
    s3_spec = {"kind": "s3", "endpoint": s3_endpoint, "region": REGION, "bucket": BUCKET, "prefix": "spec/",
               "read_timeout": 2}
    both = source_from_spec({"kind": "fallback", "sources": [{"kind": "dir", "root": str(tmp_path)}, s3_spec]})
    assert both.fetch(sha(data), 2000) == data and both.fetch(sha(other), 3000) == other
    assert both.spec["sources"][1] == s3_spec
    assert source_from_spec(s3_spec).client is source_from_spec(dict(s3_spec)).client
    assert source_from_spec({**s3_spec, "read_timeout": 3}).client is not source_from_spec(s3_spec).client
    with pytest.raises(ValueError):
        source_from_spec({"kind": "ftp"})
