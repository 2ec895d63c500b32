"""Listen ports for the servers a test or a bench starts in another process.

Why: the usual trick (bind port 0, close, hand the number to a child) takes the port from the
kernel's ephemeral range, where any outgoing connection of any process may take it before the
child binds it. With the passes of scripts/test.sh side by side (hundreds of PostgreSQL, Redis
and HTTP connections a second) a cluster's data plane lost its port that way ("address already
in use"). The ports here come from below the ephemeral range, which outgoing connections never
use, handed out in turn under a lock file every process of the host shares, so two allocations
meet only after the whole block has gone round; each port also passes a bind probe.
"""
from __future__ import annotations

import fcntl
import os
import socket
import tempfile
from pathlib import Path

BLOCK = 12000  # ports handed out in turn before one comes round again
COUNTER = Path(tempfile.gettempdir()) / "aenv-test-ports"


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux's default if unreadable)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def port_block() -> tuple[int, int]:
    """Up to BLOCK ports just below the ephemeral range (above it if too little room below)."""
    low, high = ephemeral_range()
    if low - 1024 >= 2000:
        return max(1024, low - BLOCK), low - 1
    return high + 1, min(65535, high + BLOCK)


def bindable(port: int, host: str = "127.0.0.1") -> bool:
    """True if nothing listens on (or holds) host:port right now."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(counter: Path = COUNTER) -> int:
    """The next port of the block that passes the bind probe; the counter lives in ``counter``."""
    first, last = port_block()
    size = last - first + 1
    try:
        fd = os.open(counter, os.O_CREAT | os.O_RDWR, 0o666)
    except PermissionError:  # another user's counter: one of this user's own
        fd = os.open(counter.with_name(f"{counter.name}-{os.getuid()}"), os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            os.fchmod(fd, 0o666)  # other users' test processes share it (the umask took bits)
        except PermissionError:
            pass
        try:
            following = int(os.pread(fd, 16, 0).decode() or first)
        except ValueError:
            following = first
        for step in range(size):
            port = first + (following - first + step) % size
            if bindable(port):
                os.ftruncate(fd, 0)
                os.pwrite(fd, str(first + (port - first + 1) % size).encode(), 0)
                return port
        raise RuntimeError(f"no free port in {first}-{last}")
    finally:
        os.close(fd)  # closing releases the lock
