"""A snapshot's prefetch pieces cut from its prefetch list (``chunkfs.pieces`` reads them):
the chunks of the snapshot's own files that a restore read first, in that order, their stored
bodies (compressed as the store stores chunks) put side by side ``PIECE_CHUNKS`` at a time.

Only the snapshot's own files go in (its memory, device state, disk layers): the image files a
recording mounts too (``image-*``: the base disk, kernel, initrd) are the same on most nodes,
which read them from their own copies. The bytes are read from a directory that has the files
(the lazy mount the list was recorded on) and each is checked against its digest before it is
packed; a chunk that does not match is left out (a restore then fetches it alone)."""
from __future__ import annotations

import logging
import os
from pathlib import Path

from chunkfs.compression import META_KEY, encode

from .chunks import digest

log = logging.getLogger(__name__)

PIECE_CHUNKS = 8  # ~3 MiB of compressed guest RAM: 4 in flight keep a restore's first second fed
PIECE_BYTES = 4 << 20  # a piece closes at this many body bytes whatever its chunk count
LIMIT_BYTES = 256 << 20  # in all: a longer list's tail is fetched a chunk at a time, as before


def cut(order: list, files: dict, source_dir: Path, codec: str | None) -> list[tuple[bytes, list]]:
    """``[(body, [[sha, length, body length, encoding], ...]), ...]``: the pieces of ``order``
    (``[[name, chunk index], ...]``) over ``files`` (``{name: (size, chunks, chunk size)}``, the
    snapshot's own), each chunk once, read from ``source_dir/<name>``."""
    where: dict[str, dict[int, tuple[int, int, str]]] = {}
    for name, (_, chunks, chunk_size) in files.items():
        where[name] = {int(offset) // int(chunk_size): (int(offset), int(length), sha)
                       for offset, length, sha in chunks}
    pieces: list[tuple[bytes, list]] = []
    bodies: list[bytes] = []
    entries: list[list] = []
    seen: set[str] = set()
    total = 0
    fds: dict[str, int] = {}

    def close_piece() -> None:
        if entries:
            pieces.append((b"".join(bodies), list(entries)))
            bodies.clear()
            entries.clear()

    try:
        for name, index in order:
            found = where.get(name, {}).get(index)
            if found is None or found[2] in seen:
                continue
            offset, length, sha = found
            if name not in fds:
                fds[name] = os.open(Path(source_dir) / name, os.O_RDONLY | os.O_CLOEXEC)
            data = os.pread(fds[name], length, offset)
            if len(data) != length or digest(data) != sha:
                log.warning("prefetch pieces: %s chunk %d does not match its digest; left out", name, index)
                continue
            body, metadata = encode(data, codec)
            if total + len(body) > LIMIT_BYTES:
                break
            seen.add(sha)
            total += len(body)
            bodies.append(body)
            entries.append([sha, length, len(body), metadata.get(META_KEY, "")])
            if len(entries) >= PIECE_CHUNKS or sum(map(len, bodies)) >= PIECE_BYTES:
                close_piece()
        close_piece()
    finally:
        for fd in fds.values():
            os.close(fd)
    return pieces
