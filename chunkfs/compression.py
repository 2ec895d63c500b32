"""Chunk objects stored compressed (zstd), so fewer bytes cross the wire for the same chunk.

A chunk object keeps its name, the digest of its uncompressed bytes (dedup, presence checks and
objects stored before all work as they did); a compressed one says so in its S3 metadata
(``x-amz-meta-aenv-encoding: zstd``) rather than in Content-Encoding, which HTTP layers in
between may act on. Guest RAM shrinks to about half at zstd level 1 (~700 MB/s a core to
compress, ~1.2 GB/s to decompress; zlib level 1 shrinks it as much at a seventh of the speed); a
chunk that saves less than a tenth (random or already compressed data) is stored as it is.
Decoding is bounded: a body yields at most its chunk's length (a decompression bomb costs
nothing, a frame asking for a window beyond ``MAX_WINDOW`` is refused), and a broken frame, an
unknown marker or a wrong length is ``BadEncoding``: not the chunk."""
from __future__ import annotations

import io

import zstandard

META_KEY = "aenv-encoding"  # S3 user metadata: x-amz-meta-aenv-encoding
ZSTD = "zstd"
ENCODINGS = (ZSTD,)  # what a reader here decodes (the chunkfs daemon's ping says so)
LEVEL = 1
MIN_SAVING = 0.10
MAX_WINDOW = 8 << 20  # chunks are at most 4 MiB: a frame needs no larger window


class BadEncoding(ValueError):
    """A stored body that does not decode to a chunk of the expected length."""


def codec_setting(value: str | None) -> str | None:
    """``AENV_S3_CHUNK_COMPRESSION``: ``zstd`` (also on/1/true/yes/empty: the default) or None
    for ``off`` (0/false/no); anything else is a ValueError."""
    v = (value or "").strip().lower()
    if v in ("", ZSTD, "on", "1", "true", "yes"):
        return ZSTD
    if v in ("off", "0", "false", "no", "none"):
        return None
    raise ValueError(f"AENV_S3_CHUNK_COMPRESSION must be 'zstd' or 'off', not {value!r}")


def encode(data: bytes, codec: str | None) -> tuple[bytes, dict]:
    """(body, S3 metadata) to store a chunk's ``data`` as: compressed when ``codec`` is zstd
    and that saves at least ``MIN_SAVING``, else the bytes themselves and no marker."""
    if codec == ZSTD:
        packed = zstandard.ZstdCompressor(level=LEVEL).compress(data)  # one per call: not thread-safe
        if len(packed) <= len(data) * (1 - MIN_SAVING):
            return packed, {META_KEY: ZSTD}
    return data, {}


def decode(body: bytes, metadata: dict | None, length: int) -> bytes:
    """A stored chunk's bytes from its ``body`` and S3 ``metadata``: unmarked bodies as they are
    (the reader checks them as always), marked ones decompressed to exactly ``length`` bytes or
    ``BadEncoding``."""
    encoding = (metadata or {}).get(META_KEY, "")
    if not encoding:
        return body
    if encoding != ZSTD:
        raise BadEncoding(f"unknown chunk encoding {encoding!r}")
    out = bytearray()
    try:
        reader = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW).stream_reader(io.BytesIO(body))
        while len(out) <= length:
            piece = reader.read(length + 1 - len(out))
            if not piece:
                break
            out += piece
    except zstandard.ZstdError as exc:
        raise BadEncoding(f"a zstd body that does not decode: {exc}") from None
    if len(out) != length:
        got = f"more than {length}" if len(out) > length else str(len(out))
        raise BadEncoding(f"a zstd body that decodes to {got} bytes, not {length}")
    return bytes(out)
