"""A network instance number (0–99) for each test process, claimed host-wide.

Why: every pytest process that makes drivers or stacks is an aenv network instance of its own
(`at<N>`, `10.<100+N>.0.0/16`: tests/conftest.py). The number came from the pid (mod 100) and,
for pytest-xdist workers, the controller's plus one plus the worker's index, so two sessions at
once (scripts/test.sh runs the VM pass beside the pass without VMs) could take the same number:
two resolvers on one address ("dnsmasq: failed to create listening socket ... Address already
in use"). A number is now held with an exclusive lock on a file of its own, kept open for the
life of the process (it is not inherited by children), so the kernel gives it back when the
process ends, however it ends.
"""
from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path

LOCKS = Path(tempfile.gettempdir()) / "aenv-test-net-sessions"
SESSIONS = 100
_held: dict[Path, tuple[int, int]] = {}  # lock directory -> (this process's number, its locked descriptor)


def claim(locks: Path = LOCKS, preferred: int | None = None) -> int:
    """This process's number: the one it holds already, else the first free from ``preferred``
    (default: the pid's), wrapping round."""
    if locks in _held:
        return _held[locks][0]
    try:
        locks.mkdir(mode=0o1777, exist_ok=True)
    except OSError:
        pass
    start = os.getpid() % SESSIONS if preferred is None else preferred % SESSIONS
    for step in range(SESSIONS):
        number = (start + step) % SESSIONS
        try:
            fd = os.open(locks / f"{number}.lock", os.O_CREAT | os.O_RDWR, 0o666)
        except OSError:  # another user's file, or no such directory: try the next
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        _held[locks] = (number, fd)
        return number
    raise RuntimeError(f"every test network instance (0–{SESSIONS - 1}) is held by a running process ({locks})")
