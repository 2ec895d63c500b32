"""An exclusive flock on a file, for the OCI stores shared by every process of a node.

Why: the node worker, template builds, the bench and the CLI may pull and build at once; the
layout's index.json, the disk cache and the image symlinks each have one writer at a time.
The lock file is never deleted (deleting a held flock file would let a second holder in).
"""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def locked(path: Path):
    """Holds an exclusive flock on `path` (created if missing) for the block."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
