"""A hostile envd on loopback: what a guest that replaced envd could answer on its port.

Why: the node reads envd's answers (``/metrics`` every few seconds, ``/init``, process
output); tests play the guest that sends an endless body, drips a byte a second (headers
or body), or sends numbers no column holds, and check the host stays bounded. Raw
sockets, so every byte and every pause is the test's.

    with HostileEnvd("drip") as bad:          # bad.host, bad.port, bad.sent (bytes written)
        ...

Modes: ``good`` (a valid /metrics answer), ``endless`` (a 200 whose body never ends),
``drip`` (a 200 whose body comes a byte a second), ``drip_headers`` (the status line a
byte a second), ``body`` (``HostileEnvd("body", body=b'...')``: that body, as JSON), or
``repeat`` (a 200 that sends ``body`` every ``interval`` seconds, forever: e.g. a process
stream's keepalive envelope).
"""
from __future__ import annotations

import json
import socket
import threading

GOOD = {"ts": 1700000000, "cpu_count": 2, "cpu_used_pct": 12.5, "mem_total": 512 << 20, "mem_used": 100 << 20,
        "mem_cache": 10 << 20, "disk_used": 300 << 20, "disk_total": 2048 << 20}


def metrics_body(**fields) -> bytes:
    """A /metrics answer: the good one with ``fields`` replaced."""
    return json.dumps({**GOOD, **fields}).encode()


def json_with(field: str, raw: str) -> bytes:
    """The good answer with ``field``'s value replaced by the raw JSON text ``raw``
    (``1e999``, ``NaN``: what json.dumps would not write)."""
    parts = [f'"{k}": {raw if k == field else json.dumps(v)}' for k, v in GOOD.items()]
    return ("{" + ", ".join(parts) + "}").encode()


class HostileEnvd:
    def __init__(self, mode: str, body: bytes | None = None, interval: float = 1.0):
        self.mode, self.body, self.interval = mode, body, interval
        self.sent = 0
        self.requests = 0
        self._stop = threading.Event()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.host, self.port = self._sock.getsockname()
        self._thread = threading.Thread(target=self._accept, daemon=True, name=f"hostile-envd-{mode}")

    def __enter__(self) -> "HostileEnvd":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() (a close alone does not)
        except OSError:
            pass
        self._sock.close()
        self._thread.join(5)

    def row(self, sandbox_id: str) -> dict:
        """The sampler's view of a sandbox whose envd this is."""
        return {"id": sandbox_id, "envd_host": self.host, "envd_port": self.port, "envd_access_token": ""}

    # -- serving ---------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True, name="hostile-envd-conn").start()

    def _send(self, conn: socket.socket, data: bytes) -> bool:
        try:
            conn.sendall(data)
        except OSError:
            return False
        self.sent += len(data)
        return True

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5)
            try:
                request = b""
                while b"\r\n\r\n" not in request:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    request += chunk
            except OSError:
                return
            self.requests += 1
            conn.settimeout(None)
            if self.mode == "drip_headers":
                for byte in b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n":
                    if self._stop.wait(self.interval) or not self._send(conn, bytes([byte])):
                        return
                return
            head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
            if self.mode in ("good", "body"):
                body = self.body if self.mode == "body" else metrics_body()
                self._send(conn, head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
                return
            if not self._send(conn, head + b"\r\n"):  # no length: the body ends when the connection does
                return
            if self.mode == "endless":
                block = b" " * 65536
                while not self._stop.is_set() and self._send(conn, block):
                    pass
            elif self.mode in ("drip", "repeat"):
                data = self.body if self.mode == "repeat" else b" "
                while not self._stop.wait(self.interval) and self._send(conn, data):
                    pass
