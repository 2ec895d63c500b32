"""A stand-in for the API's node routes the node egress proxy asks (``POST /nodes/secrets/resolve``,
``POST /nodes/egress-proxy/resolve``), for its tests and benchmarks without an API: a subclass
says what each ask gets (``answer``); ``served`` runs it on a loopback port and gives the
``{"url", "headers"}`` the proxy is configured with (``secrets=`` of proxy_world)."""
from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class StandIn(BaseHTTPRequestHandler):
    """Each POST's JSON body goes to ``answer``, whose ``(status, JSON)`` is the reply; a subclass
    with an ``asked`` list gets every ask recorded there (the body and its Authorization)."""

    asked: list | None = None

    def answer(self, body: dict) -> tuple[int, dict]:
        raise NotImplementedError

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.asked is not None:
            self.asked.append({**body, "auth": self.headers.get("Authorization")})
        status, answer = self.answer(body)
        raw = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args):
        pass


@contextmanager
def served(handler: type[StandIn], bearer: str = "node-cred"):
    """``handler`` on 127.0.0.1 (a free port) for the block; yields what the proxy is told to ask
    it with: its URL and a node's bearer ``bearer``."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield {"url": f"http://127.0.0.1:{server.server_address[1]}", "headers": {"Authorization": f"Bearer {bearer}"}}
    finally:
        server.shutdown()
