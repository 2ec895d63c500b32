"""Per-VM lock shared by every process on the host (node worker, bench, CLI).

Why: lifecycle verbs are multi-step (stop, migrate, quit, respawn); two processes running verbs
on one VM at once would corrupt it. flock() on `home/locks/<id>.lock` excludes other processes
and, because each acquisition opens its own file description, other threads of this process too.
kill() deletes the lock file while holding it; a waiter that then wins the old inode notices it
was unlinked and retries on a fresh file, so deleting never lets two holders in.
"""

from __future__ import annotations

import fcntl
import os
import time
from contextlib import contextmanager
from pathlib import Path

DEFAULT_TIMEOUT = 600.0


class LockTimeout(Exception):
    """Another process held the VM's lock for longer than the timeout."""


class VMLock:
    def __init__(self, path: Path, fd: int):
        self.path = path
        self.fd = fd

    def discard(self) -> None:
        """Removes the lock file (the VM is gone); the lock stays held until released."""
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


@contextmanager
def vm_lock(locks_dir: Path, sandbox_id: str, timeout: float = DEFAULT_TIMEOUT):
    locks_dir.mkdir(parents=True, exist_ok=True)
    path = locks_dir / f"{sandbox_id}.lock"
    deadline = time.monotonic() + timeout
    while True:
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise LockTimeout(f"sandbox {sandbox_id} is busy (lock {path} held > {timeout:.0f}s)") from None
                    time.sleep(0.005)
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
        except BaseException:
            os.close(fd)
            raise
        if same:
            break
        os.close(fd)  # unlinked by a kill() while we waited: lock the new file instead
    try:
        yield VMLock(path, fd)
    finally:
        os.close(fd)
