"""Writes that keep a file sparse: only the pieces of a buffer that are not all zeros.

Why: a guest's RAM copied into the sandbox's own file (on tmpfs) must hold only what the
guest uses; a lazily filled file reports no holes, so its zeros are found by looking. Both
copies of a lazy RAM file use this: the chunkfs daemon's ``copy_out``
(``LazyFile.copy_into``) and the VM driver's FUSE readers (``vmm.qemu.ramfile``). It lives
here, in the package that imports nothing else of the project, so both can."""
from __future__ import annotations

import os

ZERO_PIECE = 64 << 10  # all-zero pieces of this size are not written
_ZEROS = bytes(ZERO_PIECE)


def pwrite_nonzero(fd: int, data: bytes, offset: int, piece: int = ZERO_PIECE) -> int:
    """Writes ``data`` into ``fd`` at ``offset`` except its all-zero ``piece``-sized pieces
    (counted from ``offset``; the file must read as zeros there already, e.g. a hole).
    Returns the bytes written."""
    if piece <= 0:
        raise ValueError("the piece size must be positive")
    zero = _ZEROS if piece == ZERO_PIECE else bytes(piece)
    written = 0
    for i in range(0, len(data), piece):
        part = data[i:i + piece]
        if part != zero[:len(part)]:
            os.pwrite(fd, part, offset + i)
            written += len(part)
    return written
