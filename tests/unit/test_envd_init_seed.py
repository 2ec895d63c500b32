"""The node sends every envd /init a fresh 64-byte entropySeed (restored guests share RNG
state), its clock and, when there is one, the sandbox's token (shown as X-Access-Token
too: a re-init reaches an envd that already requires it)."""
import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from agent.guest import EnvdInitFailed, handoff_token, init_envd


@pytest.fixture
def fake_envd():
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.path, dict(self.headers), body))
            self.send_response(204 if body.get("accessToken") != "refuse" else 401)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1], seen
    server.shutdown()


def test_init_envd_sends_a_fresh_seed_clock_and_token(fake_envd):
    port, seen = fake_envd
    init_envd("127.0.0.1", port, {"A": "1"}, None)
    init_envd("127.0.0.1", port, {}, "tok")
    (p1, h1, b1), (p2, h2, b2) = seen
    assert p1 == p2 == "/init"
    seeds = [base64.b64decode(b["entropySeed"], validate=True) for b in (b1, b2)]
    assert [len(s) for s in seeds] == [64, 64] and seeds[0] != seeds[1]
    assert b1["envVars"] == {"A": "1"} and "accessToken" not in b1 and "X-Access-Token" not in h1
    assert b2["accessToken"] == "tok" and h2["X-Access-Token"] == "tok"
    assert b1["timestamp"].endswith("Z") and "defaultUser" not in b1 and "defaultWorkdir" not in b1


def test_token_handoff_shows_the_source_token(fake_envd):
    port, seen = fake_envd
    handoff_token("127.0.0.1", port, "source", "own")
    (_, headers, body), = seen
    assert body == {"accessToken": "own"} and headers["X-Access-Token"] == "source"
    with pytest.raises(EnvdInitFailed, match="401"):
        handoff_token("127.0.0.1", port, "source", "refuse")


def test_nothing_listening_is_envd_init_failed():
    with pytest.raises(EnvdInitFailed, match="127.0.0.1:1"):
        init_envd("127.0.0.1", 1, {}, None)
