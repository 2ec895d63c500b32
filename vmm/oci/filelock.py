"""An exclusive flock on a file, for the OCI stores shared by every process of a node.

Why: the node worker, template builds, the bench and the CLI may pull and build at once; the
layout's index.json, the disk cache and the image symlinks each have one writer at a time.
The lock file is never deleted (deleting a held flock file would let a second holder in).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
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


def built_once(final: Path, marker: str, build, load):
    """``load(built)`` of the directory ``final``, which ``build(tmp, work)`` makes first unless it
    has its ``marker`` file already (``built``: whether this call made it). Idempotent and safe
    across processes: built under the parent's ``.build.lock`` (checked again once held) into a
    fresh ``.tmp-*`` beside ``final`` (``work``: a ``.work-*`` scratch directory, removed after),
    then renamed into place whole; a crashed build's leftovers are removed first."""
    if (final / marker).is_file():
        return load(False)
    parent = final.parent
    with locked(parent / ".build.lock"):
        if (final / marker).is_file():
            return load(False)
        for stale in list(parent.glob(".tmp-*")) + list(parent.glob(".work-*")):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=parent))
        work = Path(tempfile.mkdtemp(prefix=".work-", dir=parent))
        try:
            build(tmp, work)
            tmp.chmod(0o755)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(work, ignore_errors=True)
        return load(True)
