"""The code interpreter's server (``python -m code_interpreter``) on the host, with real
Jupyter kernels, driven by the unchanged ``e2b-code-interpreter`` SDK in debug mode
(``E2B_DEBUG=true`` makes ``Sandbox.create()`` call no API; ``E2B_SANDBOX_URL`` points its
port-49999 calls at the server). A stub stands in for envd's ``GET /envs`` (the
sandbox-wide env vars), recording the access tokens it was asked with."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from harness.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
SANDBOX_ENV = {"SBX_VAR": "from-the-sandbox", "QUOTED": "it's \"quoted\""}


class EnvdStub:
    """``GET /envs`` like envd: the sandbox's env vars as a JSON object."""

    def __init__(self, env: dict):
        self.tokens: list = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's naming
                stub.tokens.append(self.headers.get("X-Access-Token"))
                body = json.dumps(env if self.path == "/envs" else {}).encode()
                self.send_response(200 if self.path == "/envs" else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


class Server:
    """A running ``python -m code_interpreter`` and its log."""

    def __init__(self, cwd: Path, envd_url: str, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cwd = cwd
        self.log_path = log
        self._log = open(log, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "code_interpreter", "--host", "127.0.0.1", "--port", str(self.port),
             "--cwd", str(cwd), "--envd-url", envd_url, "--runtime-dir", str(cwd.parent / "runtime")],
            cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited early:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the server did not become healthy:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self._log.close()


@pytest.fixture(scope="session")
def envd_stub():
    stub = EnvdStub(SANDBOX_ENV)
    yield stub
    stub.close()


@pytest.fixture(scope="session")
def server(tmp_path_factory, envd_stub):
    if not __import__("shutil").which("node"):
        pytest.skip("the JavaScript kernel needs node on PATH")
    root = tmp_path_factory.mktemp("code-interpreter")
    (root / "home").mkdir()
    s = Server(root / "home", envd_stub.url, root / "server.log")
    yield s
    s.stop()


@pytest.fixture
def sbx(server, monkeypatch):
    """The SDK's Sandbox in debug mode, talking to the server."""
    from e2b_code_interpreter import Sandbox

    monkeypatch.setenv("E2B_DEBUG", "true")
    monkeypatch.setenv("E2B_SANDBOX_URL", server.url)
    for name in ("E2B_API_URL", "E2B_API_KEY", "E2B_DOMAIN"):
        monkeypatch.delenv(name, raising=False)
    return Sandbox.create()
