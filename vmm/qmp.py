"""Minimal synchronous QMP client over a VM's unix socket.

Why: quit now; stop/cont/migrate/blockdev-snapshot for pause and fork later. One short-lived
connection per use keeps it safe across worker restarts.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path


class QMPError(Exception):
    """QMP returned an error or the socket failed."""


class QMP:
    def __init__(self, path: Path, timeout: float = 5.0):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(str(path))
        except OSError as e:
            self.sock.close()
            raise QMPError(f"cannot connect to {path}: {e}") from e
        self.file = self.sock.makefile("rb")
        self._read()  # greeting
        self.execute("qmp_capabilities")

    def _read(self) -> dict:
        while True:
            line = self.file.readline()
            if not line:
                raise QMPError("QMP connection closed")
            msg = json.loads(line)
            if "event" not in msg:
                return msg

    def execute(self, command: str, **arguments) -> object:
        req = {"execute": command}
        if arguments:
            req["arguments"] = arguments
        self.sock.sendall(json.dumps(req).encode() + b"\n")
        reply = self._read()
        if "error" in reply:
            raise QMPError(f"{command}: {reply['error'].get('desc', reply['error'])}")
        return reply.get("return")

    def close(self) -> None:
        try:
            self.file.close()
        finally:
            self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
