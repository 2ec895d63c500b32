"""The API keeps an idle kept-alive connection as long as AENV_API_IDLE_TIMEOUT says
(config.daphne_idle), so the E2B SDKs, which pool connections for 300 s, close first: the API as
deployed (``daphne config.asgi:application``) is run with a short and a long setting, and one
kept-alive connection is left idle after an answer."""
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from harness.polling import until
from harness.processes import stop
from harness.stack import free_port
from tests.unit.test_dataplane import _test_database_url

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parents[2]
REQUEST = b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: keep-alive\r\n\r\n"


def _api(tmp_path, idle_seconds: str):
    port = free_port()
    env = {**os.environ, "DATABASE_URL": _test_database_url(), "AENV_HOME": str(tmp_path),
           "AENV_API_IDLE_TIMEOUT": idle_seconds}
    log = open(tmp_path / f"api-{idle_seconds}.log", "wb")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen([sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port),
                             "config.asgi:application"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)

    def answers():
        assert proc.poll() is None, (tmp_path / f"api-{idle_seconds}.log").read_text()
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code > 0

    until(answers, "the API to answer", 60, tolerate=(httpx.HTTPError,))
    return proc, port, log


def _stop(proc, log):
    stop(proc)
    log.close()


def _idle_connection(port: int) -> socket.socket:
    """One kept-alive connection that has had its answer and now waits."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(REQUEST)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, "closed before the answer"
        data += chunk
    assert data.startswith(b"HTTP/1.1 "), data[:80]
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(65536)
    return sock


def _closed_by_server(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    finally:
        sock.setblocking(True)


def test_an_idle_connection_is_closed_after_the_setting(tmp_path):
    proc, port, log = _api(tmp_path, "2")
    try:
        sock = _idle_connection(port)
        until(lambda: _closed_by_server(sock), "the API to close the idle connection", 30)
        sock.close()
    finally:
        _stop(proc, log)


def test_an_idle_connection_stays_open_under_a_long_setting(tmp_path):
    proc, port, log = _api(tmp_path, "600")
    try:
        sock = _idle_connection(port)
        time.sleep(4)  # twice what closed it above: a long setting keeps it
        assert not _closed_by_server(sock)
        sock.sendall(REQUEST)  # and it still serves the next request
        assert sock.recv(65536).startswith(b"HTTP/1.1 ")
        sock.close()
    finally:
        _stop(proc, log)


def test_the_default_outlasts_the_sdks_pool():
    from django.conf import settings
    assert settings.AENV_API_IDLE_TIMEOUT > 300  # e2b's connection pool keeps idle ones 300 s
