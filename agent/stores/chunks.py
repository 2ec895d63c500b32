"""Fixed-size, content-addressed chunks of snapshot files, for the S3 store.

Why fixed chunks and not whole files: guest RAM and qcow2 layers are large and
sparse, and successive snapshots of one lineage differ in a few places (a
layer's backing-file header, the pages a guest touched). Cutting every file at
the same offsets and naming each piece by its sha256 makes equal pieces one
object, and all-zero pieces (holes) no object at all.

Guest RAM files (``*.ram``) are cut smaller than disks (``RAM_CHUNK_SIZE``): a restored guest
touches its memory scattered all over, so a lazy restore fetches whole pieces around each touch
(docs/cluster.md, "Memory snapshots on demand"). A manifest names each file's chunk size;
manifests from before that name one for all files (4 MiB)."""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

CHUNK_SIZE = 4 << 20
RAM_CHUNK_SIZE = 1 << 20
RAM_SUFFIX = ".ram"


def chunk_size_for(name: str, chunk_size: int = CHUNK_SIZE, ram_chunk_size: int = RAM_CHUNK_SIZE) -> int:
    """The chunk size a snapshot file is cut at: ``ram_chunk_size`` for guest RAM, else ``chunk_size``."""
    return ram_chunk_size if str(name).endswith(RAM_SUFFIX) else chunk_size


@dataclass(frozen=True)
class Chunk:
    """Where a piece of a file lives: ``length`` bytes at ``offset`` (the last chunk
    of a file may be shorter)."""

    offset: int
    length: int


def chunk_spans(path: Path, chunk_size: int = CHUNK_SIZE) -> Iterator[Chunk]:
    """The chunks of ``path`` that may hold data. Chunks wholly inside a hole
    (SEEK_DATA says so) are skipped without reading them; what is left is read
    later and dropped if it is all zeros after all."""
    size = os.stat(path).st_size
    with open(path, "rb") as f:
        fd = f.fileno()
        offset = 0
        while offset < size:
            try:
                data = os.lseek(fd, offset, os.SEEK_DATA)
            except OSError:  # ENXIO: nothing but a hole up to the end
                return
            offset = data - data % chunk_size
            yield Chunk(offset, min(chunk_size, size - offset))
            offset += chunk_size


def read_chunk(path: Path, chunk: Chunk) -> bytes | None:
    """The chunk's bytes, or None if they are all zero (stored as nothing)."""
    with open(path, "rb") as f:
        data = os.pread(f.fileno(), chunk.length, chunk.offset)
    if len(data) != chunk.length:
        raise OSError(f"{path} shrank while being read (offset {chunk.offset})")
    return None if data == bytes(len(data)) else data


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def allocated_bytes(path: Path) -> int:
    """Bytes a directory tree really occupies (sparse files count allocated blocks)."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                pass
    return total
