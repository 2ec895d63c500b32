"""A stand-in for the few API calls ``aenv exec / connect / upload / download`` make
besides envd (the sandbox's token and state, connect, refreshes), so the CLI runs against
a real envd on the host without the control plane; and a TCP relay between the CLI and
envd that a test can cut, as a data plane restart would."""
import json
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeApi:
    """One sandbox ``sb``: ``state`` (running | paused | gone) is what the API reports."""

    def __init__(self, token: str | None = None):
        self.state = "running"
        self.token = token
        self.calls: list[tuple[str, str, dict]] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, status: int, body=None):
                data = b"" if body is None else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method: str):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}") if length else {}
                api.calls.append((method, self.path, body))
                self._answer(*api.answer(method, self.path.split("?")[0]))

            def do_GET(self):  # noqa: N802
                self._handle("GET")

            def do_POST(self):  # noqa: N802
                self._handle("POST")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def answer(self, method: str, path: str):
        if self.state == "gone" or not path.startswith("/sandboxes/sb"):
            return 404, {"code": 404, "message": "sandbox not found"}
        info = {"sandboxID": "sb", "templateID": "base", "state": self.state,
                **({"envdAccessToken": self.token} if self.token else {})}
        if path == "/sandboxes/sb" and method == "GET":
            return 200, info
        if path == "/sandboxes/sb/connect":
            return 200, info
        if path == "/sandboxes/sb/refreshes":
            return 204, None
        return 404, {"code": 404, "message": f"no route {method} {path}"}

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


class Relay:
    """Forwards TCP connections from a port of its own to ``target_port``; ``cut()``
    breaks every open connection (new ones are still accepted)."""

    def __init__(self, target_port: int):
        self.target = ("127.0.0.1", target_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.open: list[socket.socket] = []
        self.lock = threading.Lock()
        self.accepted = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            with self.lock:
                self.accepted += 1
                self.open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket):
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self):
        with self.lock:
            conns, self.open = self.open, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self):
        self.listener.close()
        self.cut()


def process_running(marker: str) -> bool:
    """Whether a process whose command line holds ``marker`` runs on this host."""
    return subprocess.run(["pgrep", "-f", marker], capture_output=True).returncode == 0


def await_process(marker: str, running: bool, timeout: float = 10.0) -> bool:
    """Until a process with ``marker`` runs (or has gone); whether it did in time."""
    deadline = time.monotonic() + timeout
    while process_running(marker) != running and time.monotonic() < deadline:
        time.sleep(0.05)
    return process_running(marker) == running
