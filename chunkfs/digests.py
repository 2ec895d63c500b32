"""Chunk names: a chunk is named by the sha256 of its bytes (as agent/stores/chunks.py cuts them)."""
from __future__ import annotations

import hashlib
import re

SHA = re.compile(r"^[0-9a-f]{64}$")


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check_sha(sha: str) -> str:
    """``sha`` if it is a chunk name (64 lower-case hex digits); a name is also a file name,
    so anything else (``..``, slashes) is refused before it reaches a path."""
    if not isinstance(sha, str) or not SHA.match(sha):
        raise ValueError(f"not a chunk digest: {sha!r}")
    return sha
