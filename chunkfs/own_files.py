"""Chunks inside this node's own files (its snapshots' captures, its image builds, its
downloads), which the peer server may give to peer nodes (issue 24, peer fetch).

Why: the node that took a snapshot holds it as files, not as cached chunks, so without this
the first other node to resume a pause image (or create from a template built here) reads
it all from the store. The node worker knows where those pieces are (its own-file index,
``agent.stores.local_chunks``) and hands the map over the control socket (the ``own`` op);
the daemon never walks the file system itself.

A file may change or vanish after it was indexed: a piece is read with one ``pread`` and
handed out only when its length and sha256 are the chunk's, else it is not there."""
from __future__ import annotations

import os
import threading

from .digests import check_sha, digest

MAX_CHUNK = 64 << 20  # a piece longer than this is no chunk of ours


class OwnFiles:
    """``{sha: (path, offset, length)}``, replaced as a whole by ``set``; thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._where: dict[str, tuple[str, int, int]] = {}

    def set(self, files: dict) -> int:
        """``files``: ``{absolute path: [[offset, length, sha], ...]}`` (a snapshot manifest's
        chunk lists). ValueError on anything else, and then the old map stays. Returns the
        number of distinct chunks."""
        if not isinstance(files, dict):
            raise ValueError("files must be an object {absolute path: [[offset, length, sha], ...]}")
        where: dict[str, tuple[str, int, int]] = {}
        for path, chunks in files.items():
            if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
                raise ValueError(f"not an absolute path: {path!r}")
            if not isinstance(chunks, list):
                raise ValueError(f"{path}: chunks must be [[offset, length, sha], ...]")
            for entry in chunks:
                if not (isinstance(entry, list) and len(entry) == 3 and all(
                        isinstance(x, int) and not isinstance(x, bool) for x in entry[:2])
                        and entry[0] >= 0 and 0 < entry[1] <= MAX_CHUNK):
                    raise ValueError(f"{path}: bad chunk entry {entry!r}")
                where.setdefault(check_sha(entry[2]), (path, entry[0], entry[1]))
        with self._lock:
            self._where = where
        return len(where)

    def __len__(self) -> int:
        with self._lock:
            return len(self._where)

    def read(self, sha: str) -> bytes | None:
        """The chunk's bytes from the file that holds it, verified, or None (not known here,
        unreadable, or the file no longer holds it)."""
        with self._lock:
            found = self._where.get(sha)
        if found is None:
            return None
        path, offset, length = found
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            data = os.pread(fd, length, offset)
        except OSError:
            return None
        finally:
            os.close(fd)
        return data if len(data) == length and digest(data) == sha else None
