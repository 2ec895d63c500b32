"""Host port allocation for guest port forwards (envd's and any other a NetworkSpec asks for).

Why: many boots run concurrently (threads and processes); a port is chosen under an exclusive
file lock, must not be claimed by any sandbox state dir, and must pass a bind probe. The claim
is a file written into the state dir before the lock is released (`port` for envd's forward,
`port-<guest port>` for others), so it lasts exactly as long as the sandbox's state dir.
"""

from __future__ import annotations

import fcntl
import os
import random
import socket
from pathlib import Path

PORT_RANGE = (40000, 49999)


class PortsExhausted(Exception):
    """No free port in the range."""


def bind_free(host: str, port: int) -> bool:
    """True if nothing listens on host:port right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def claimed_ports(sandboxes_dir: Path) -> set[int]:
    """Ports recorded by existing sandbox state dirs."""
    ports = set()
    if sandboxes_dir.exists():
        for f in [*sandboxes_dir.glob("*/port"), *sandboxes_dir.glob("*/port-*")]:
            try:
                ports.add(int(f.read_text().strip()))
            except (OSError, ValueError):
                pass
    return ports


def allocate(sandboxes_dir: Path, state_dir: Path, host: str = "127.0.0.1",
             port_range: tuple[int, int] = PORT_RANGE, avoid: set[int] = frozenset(), claim: str = "port") -> int:
    """Picks a free port and records it as state_dir/<claim> (state_dir is created)."""
    sandboxes_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(sandboxes_dir.parent / "ports.lock", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        taken = claimed_ports(sandboxes_dir) | set(avoid)
        lo, hi = port_range
        start = random.randint(lo, hi)
        for i in range(hi - lo + 1):
            port = lo + (start - lo + i) % (hi - lo + 1)
            if port in taken or not bind_free(host, port):
                continue
            state_dir.mkdir(parents=True, exist_ok=True)
            tmp = state_dir / f"{claim}.tmp"
            tmp.write_text(f"{port}\n")
            os.replace(tmp, state_dir / claim)
            return port
        raise PortsExhausted(f"no free port in {lo}-{hi}")
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
