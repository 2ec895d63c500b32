"""What the chunk cache and its sources raise. One base class, so the FUSE layer can turn
any of them into EIO for the reader without knowing which went wrong."""
from __future__ import annotations


class ChunkError(Exception):
    """A chunk could not be served."""


class ChunkUnavailable(ChunkError):
    """No source could give the chunk (missing object, store unreachable or too slow)."""


class ChunkCorrupt(ChunkError):
    """The source kept giving bytes whose digest is not the chunk's name."""


class CacheFull(ChunkError):
    """The chunk does not fit: everything left in the cache is pinned."""


class CacheInUse(ChunkError):
    """Another ChunkCache (this process or another) has this cache directory open."""
