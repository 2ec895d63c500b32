"""S3 chunk objects stored compressed (chunkfs.compression, AENV_S3_CHUNK_COMPRESSION), against
a real moto S3 server: a commit stores compressible chunks zstd-compressed under their
uncompressed digest and marked, incompressible ones as they are; the lazy path (S3ChunkSource
through the chunk cache) and the whole download read both, counting the compressed bytes on the
wire; chunks stored before (no marker) read as ever; a marked body that decodes to anything but
its chunk (a decompression bomb, a wrong length, garbage, an unknown encoding) is refused."""
from __future__ import annotations

import hashlib
import json
import os
import uuid

import pytest
import zstandard

from agent.stores.base import SnapshotStoreError
from agent.stores.s3 import S3Store
from chunkfs.cache import ChunkCache
from chunkfs.compression import META_KEY, ZSTD, BadEncoding, codec_setting, decode, encode
from chunkfs.errors import ChunkCorrupt
from chunkfs.sources import CountingSource, S3ChunkSource, s3_client
from harness.moto_s3 import REGION, moto_server, default_credentials, CLIENT_KEYS

BUCKET = "aenv-compress"
CHUNK = 64 << 10


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def s3_endpoint():
    default_credentials()
    with moto_server(BUCKET) as url:
        yield url


@pytest.fixture
def s3(s3_endpoint):
    return s3_client(s3_endpoint, REGION, **CLIENT_KEYS), f"t-{uuid.uuid4().hex[:8]}"


def _commit(s3, tmp_path, **kw) -> tuple[S3Store, dict, dict, dict]:
    """A snapshot with a compressible RAM file (text-like pages) and an incompressible state
    file, committed; returns the store, the commit's counts, the files and the manifest."""
    client, prefix = s3
    store = S3Store(home=tmp_path / "node-a", images_dir=tmp_path / "images", bucket=BUCKET, client=client,
                    prefix=prefix, chunk_size=CHUNK, concurrency=2, **kw)
    snap = store.prepare("snap-1")
    words = b" ".join(os.urandom(3).hex().encode() for _ in range(400))
    files = {"memory.ram": (words * (4 * CHUNK // len(words) + 1))[:4 * CHUNK],
             "device.state": os.urandom(2 * CHUNK)}
    for name, data in files.items():
        (snap / name).write_bytes(data)
    (snap / "manifest.json").write_text(json.dumps({"dir": str(snap)}))
    counts = store.commit("snap-1")
    doc = json.loads(client.get_object(Bucket=BUCKET, Key=f"{prefix}/snapshots/snap-1/manifest.json")["Body"].read())
    return store, counts, files, doc


def _read_through_cache(client, prefix, doc, cache_dir) -> tuple[dict, CountingSource]:
    source = CountingSource(S3ChunkSource(client, BUCKET, prefix))
    out = {}
    with ChunkCache(cache_dir, 64 * CHUNK) as cache:
        for name, entry in doc["files"].items():
            rebuilt = bytearray(entry["size"])
            for offset, length, chunk_sha in entry["chunks"]:
                rebuilt[offset:offset + length] = cache.get(chunk_sha, length, source.fetch)
            out[name] = bytes(rebuilt)
        assert cache.stats()["corrupt"] == 0
    return out, source


def test_compressible_chunks_are_stored_compressed_and_read_back_whole(s3, tmp_path):
    client, prefix = s3
    store, counts, files, doc = _commit(s3, tmp_path)
    for name, entry in doc["files"].items():
        for _, length, chunk_sha in entry["chunks"]:
            got = client.get_object(Bucket=BUCKET, Key=f"{prefix}/chunks/{chunk_sha}")
            body = got["Body"].read()
            if name == "memory.ram":  # named by the uncompressed bytes, stored smaller and marked
                assert got["Metadata"] == {META_KEY: ZSTD} and len(body) < 0.9 * length
            else:  # random: compressing saves nothing, so it is stored as it is
                assert got["Metadata"] == {} and sha(body) == chunk_sha and len(body) == length
    assert counts["sent_bytes"] < counts["uploaded_bytes"] - 2 * CHUNK

    read, source = _read_through_cache(client, prefix, doc, tmp_path / "node-b-cache")
    assert read == files
    assert source.bytes == sum(map(len, files.values()))
    assert 2 * CHUNK < source.wire_bytes < source.bytes - 2 * CHUNK  # the RAM crossed the wire compressed

    staging = tmp_path / "download"  # the whole download (no lazy restore) decompresses too
    staging.mkdir()
    other = S3Store(home=tmp_path / "node-c", images_dir=tmp_path / "images-c", bucket=BUCKET, client=client,
                    prefix=prefix, chunk_size=CHUNK)
    other._fetch_files("snap-1", {n: (e["size"], e["chunks"], CHUNK) for n, e in doc["files"].items()}, staging)
    assert {name: (staging / name).read_bytes() for name in files} == files


def test_with_compression_off_and_for_chunks_stored_before_bodies_are_the_chunks(s3, tmp_path):
    client, prefix = s3
    _, counts, files, doc = _commit(s3, tmp_path, chunk_compression=None)
    assert counts["sent_bytes"] == counts["uploaded_bytes"]
    for entry in doc["files"].values():
        for _, _, chunk_sha in entry["chunks"]:
            got = client.get_object(Bucket=BUCKET, Key=f"{prefix}/chunks/{chunk_sha}")
            assert got["Metadata"] == {} and sha(got["Body"].read()) == chunk_sha
    read, source = _read_through_cache(client, prefix, doc, tmp_path / "cache")
    assert read == files and source.wire_bytes == source.bytes


def _marked(client, prefix, name: str, body: bytes, encoding: str = ZSTD) -> None:
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/chunks/{name}", Body=body, Metadata={META_KEY: encoding})


def test_a_marked_body_that_is_not_its_chunk_is_refused_and_never_cached(s3, tmp_path):
    client, prefix = s3
    good = os.urandom(CHUNK // 2) * 2
    zc = zstandard.ZstdCompressor(level=1)
    bodies = {
        "bomb": zc.compress(bytes(256 << 20)),  # a few KiB that would decompress to 256 MiB
        "longer": zc.compress(good + b"x"),
        "shorter": zc.compress(good[:-1]),
        "other bytes": zc.compress(bytes(len(good))),
        "garbage": b"not a zstd frame" * 100,
        "unknown encoding": good,
    }
    source = S3ChunkSource(client, BUCKET, prefix)
    for i, (what, body) in enumerate(bodies.items()):
        data = good[:-1] + bytes([i])  # each case its own chunk name
        _marked(client, prefix, sha(data), body, "gzip" if what == "unknown encoding" else ZSTD)
        with ChunkCache(tmp_path / f"cache-{i}", 64 * CHUNK) as cache:
            with pytest.raises(ChunkCorrupt):
                cache.get(sha(data), len(data), source.fetch)
            assert cache.stats()["corrupt"] == 3 and cache.stats()["entries"] == 0, what
        staging = tmp_path / f"download-{i}"
        staging.mkdir()
        store = S3Store(home=tmp_path / f"node-{i}", images_dir=tmp_path / "images", bucket=BUCKET, client=client,
                        prefix=prefix, chunk_size=CHUNK)
        with pytest.raises(SnapshotStoreError, match="damaged"):
            store._fetch_files("s", {"memory.ram": (len(data), [[0, len(data), sha(data)]], CHUNK)}, staging)
    assert source.wire_bytes == 3 * sum(min(len(b), len(good) + 1) for b in bodies.values())


def test_encode_and_decode_bounds():
    text = b"aenv " * 10000
    body, meta = encode(text, ZSTD)
    assert meta == {META_KEY: ZSTD} and len(body) < len(text) // 10
    assert decode(body, meta, len(text)) == text
    noise = os.urandom(10000)
    assert encode(noise, ZSTD) == (noise, {}) and encode(text, None) == (text, {})
    assert decode(noise, {}, 5) == noise  # unmarked: as it is (the reader checks it)
    with pytest.raises(BadEncoding, match="more than 100"):
        decode(body, meta, 100)
    # a frame asking for a window beyond any chunk's size is refused before it is decoded
    streaming = zstandard.ZstdCompressor(compression_params=zstandard.ZstdCompressionParameters(
        window_log=27, write_content_size=False)).compressobj()  # no size known: the window stays 128 MiB
    wide = streaming.compress(text) + streaming.flush()
    assert zstandard.get_frame_parameters(wide).window_size == 128 << 20
    with pytest.raises(BadEncoding, match="memory"):
        decode(wide, meta, len(text))


def test_the_setting(settings, s3_endpoint):
    assert codec_setting("zstd") == codec_setting("") == codec_setting("on") == ZSTD
    assert codec_setting("off") is codec_setting("0") is None
    with pytest.raises(ValueError, match="AENV_S3_CHUNK_COMPRESSION"):
        codec_setting("lz4")
    from agent.stores import get_store

    settings.AENV_SNAPSHOT_BACKEND = "s3"
    settings.AENV_S3_ENDPOINT, settings.AENV_S3_BUCKET, settings.AENV_S3_REGION = s3_endpoint, BUCKET, REGION
    settings.AENV_S3_CHUNK_COMPRESSION = "off"
    assert get_store().chunk_compression is None
    settings.AENV_S3_CHUNK_COMPRESSION = "lz4"
    with pytest.raises(SnapshotStoreError, match="AENV_S3_CHUNK_COMPRESSION"):
        get_store()
