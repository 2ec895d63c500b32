"""The data plane's hot path as deployed (``python -m dataplane.serve``: uvicorn + HAProxy) on
the test database, in front of a host-side HTTP server standing in for a guest port.

What is shown, each on a keep-alive connection after its first answer: the connection is
served by HAProxy (its ``guest`` backend's counters) with the routing headers and the token
kept from the guest; a wrong or missing traffic token never reaches the guest and gets the
data plane's answer; a token changed in the database is the one HAProxy checks; a sandbox
that stops running loses its route (and its streams) at once; the guest's cookies are
confined as ``dataplane.cookies`` says; a closed port gets E2B's 502 body. A pause and a
resume on one keep-alive connection: tests/unit/test_hotpath_keepalive.py.
"""
import glob
import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import httpx
import pytest
from django.utils import timezone

from dataplane.steer import token_digest
from envd import ENVD_PORT
from sandboxes import route_nudge
from sandboxes.models import Sandbox, SandboxEvent, Team, Template
from sandboxes.states import S
from sandboxes.transitions import transition_sync
from tests.unit.test_dataplane import _free_port, _test_database_url

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SID = "hotpathsbx"
TOKEN = "the-traffic-token"


class Guest:
    """A user port: answers ``/`` with "ok" and two cookies (one with a Domain), streams
    ``/stream`` until the client goes, and records every request's headers (``peers``: the
    connection each came on; ``open``: the connections open now). Once ``paused`` is set, a
    request gets no answer (as from a paused VM)."""

    def __init__(self, protocol_version: str = "HTTP/1.1", host: str = "127.0.0.1", port: int = 0):
        seen, peers, opened = self.seen, self.peers, self.open = [], [], set()
        self.paused, self._stopped = threading.Event(), threading.Event()
        paused, stopped = self.paused, self._stopped

        class Handler(http.server.BaseHTTPRequestHandler):

            def setup(self):
                super().setup()
                opened.add(self.client_address)

            def finish(self):
                opened.discard(self.client_address)
                super().finish()

            def do_GET(self):
                if paused.is_set():  # no answer, the connection kept, until the test ends
                    stopped.wait()
                    self.close_connection = True
                    return
                seen.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
                peers.append(self.client_address)
                if self.path == "/stream":
                    self.send_response(200)
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    try:
                        for _ in range(300):
                            self.wfile.write(b"1\r\nx\r\n")
                            self.wfile.flush()
                            time.sleep(0.1)
                    except OSError:
                        pass
                    return
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.send_header("Set-Cookie", "a=1; Domain=example.test; Path=/")
                self.send_header("Set-Cookie", "b=2; Path=/")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args):
                pass

        Handler.protocol_version = protocol_version
        self.server = http.server.ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self):
        self._stopped.set()
        self.server.shutdown()
        self.server.server_close()


class Conn:
    """One keep-alive client connection, read by hand (what a browser or SDK keeps open)."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=15)
        self.buf = b""

    def _until(self, marker: bytes) -> bytes:
        while marker not in self.buf:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("closed")
            self.buf += data
        head, self.buf = self.buf.split(marker, 1)
        return head

    def _exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("closed")
            self.buf += data
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def send(self, path: str, headers: dict):
        lines = [f"GET {path} HTTP/1.1", *(f"{k}: {v}" for k, v in headers.items())]
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())

    def head(self):
        head = self._until(b"\r\n\r\n").decode("latin-1").split("\r\n")
        status = int(head[0].split(" ", 2)[1])
        fields = [tuple(p.strip() for p in line.split(":", 1)) for line in head[1:]]
        return status, [(k.lower(), v) for k, v in fields]

    def get(self, path: str = "/", **headers):
        self.send(path, {"Host": headers.pop("host", "127.0.0.1"), **headers})
        status, fields = self.head()
        length = int(dict(fields).get("content-length", "0"))
        return status, fields, self._exactly(length)

    def close(self):
        self.sock.close()


def admin(home, command: str) -> str:
    path = glob.glob(os.path.join(home, "dataplane-hotpath-*", "admin.sock"))[0]
    path = os.path.realpath(path)
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)
        s.sendall(command.encode() + b"\n")
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out.decode()


def served(home, backend: str) -> int:
    """Requests HAProxy has sent to ``backend`` (``show stat``'s stot of its BACKEND row: counted
    when the request is assigned, so a stream still relayed counts too)."""
    lines = admin(home, "show stat").splitlines()
    names = lines[0].lstrip("# ").split(",")
    for line in lines[1:]:
        fields = dict(zip(names, line.split(",")))
        if fields.get("pxname") == backend and fields.get("svname") == "BACKEND":
            return int(fields.get("stot") or 0)
    raise AssertionError(f"no backend {backend}")


def map_has(home, name: str, key: str) -> str | None:
    path = os.path.realpath(glob.glob(os.path.join(home, "dataplane-hotpath-*", name))[0])
    for line in admin(home, f"show map {path}").splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] == key:
            return parts[2]
    return None


def wait_for(predicate, what: str, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def guest():
    g = Guest()
    yield g
    g.stop()


@pytest.fixture
def sandbox(guest):
    team = Team.objects.create(name="t", slug="t")
    template = Template.objects.create(id="base")
    return Sandbox.objects.create(id=SID, team=team, template=template, state="running", envd_host="127.0.0.1",
                                  envd_port=1, guest_host="127.0.0.1", traffic_access_token=TOKEN,
                                  end_at=timezone.now() + timedelta(minutes=5))


@pytest.fixture
def hot(tmp_path, sandbox):
    """The data plane with its hot path; yields (port, AENV_HOME) once HAProxy routes the sandbox."""
    port = _free_port()
    log = open(tmp_path / "dataplane.log", "wb")
    env = {**os.environ, "DATABASE_URL": _test_database_url(), "AENV_HOME": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "dataplane.serve", "--host", "127.0.0.1", "--port", str(port),
                             "--hotpath", "on", "--", "--log-level", "warning"],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: _answers(port) or proc.poll() is not None, "the data plane", 60)
        assert proc.poll() is None, (tmp_path / "dataplane.log").read_text()
        wait_for(lambda: map_has(str(tmp_path), "tokens.map", SID), "the sandbox published to HAProxy")
        yield port, str(tmp_path)
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _answers(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 400
    except httpx.HTTPError:
        return False


def routed(guest, token=TOKEN, **extra):
    headers = {"E2b-Sandbox-Id": SID, "E2b-Sandbox-Port": str(guest.port), **extra}
    if token is not None:
        headers["E2b-Traffic-Access-Token"] = token
    return headers


def test_a_keepalive_connection_moves_to_the_hot_path(hot, guest):
    port, home = hot
    conn = Conn(port)
    before = served(home, "guest")
    for _ in range(5):
        status, _, body = conn.get("/", **routed(guest))
        assert (status, body) == (200, b"ok")
    # the first answer is the data plane's, the next four HAProxy's
    assert served(home, "guest") - before == 4
    assert len(guest.seen) == 5
    for _, headers in guest.seen:
        assert not {"e2b-sandbox-id", "e2b-sandbox-port", "e2b-traffic-access-token", "x-aenv-via-hotpath"} & set(headers)
    # a Python-only client (a new connection, its first request) is still answered by the data plane
    assert httpx.get(f"http://127.0.0.1:{port}/", headers=routed(guest)).text == "ok"
    conn.close()


def test_traffic_tokens_are_enforced_on_the_hot_path(hot, guest):
    port, home = hot
    conn = Conn(port)
    assert conn.get("/", **routed(guest))[0] == 200  # handed off after this
    hot_before, seen_before = served(home, "guest"), len(guest.seen)
    wrong = conn.get("/", **routed(guest, token="not-the-token"))
    missing = conn.get("/", **routed(guest, token=None))
    assert wrong[0] == 403 and "is invalid" in json.loads(wrong[2])["message"]
    assert missing[0] == 403 and "is missing" in json.loads(missing[2])["message"]
    assert served(home, "guest") == hot_before and len(guest.seen) == seen_before  # none reached the guest
    assert conn.get("/", **routed(guest))[0] == 200 and served(home, "guest") == hot_before + 1

    # a new token in the database is the one HAProxy checks next
    Sandbox.objects.filter(pk=SID).update(traffic_access_token="a-new-token")
    wait_for(lambda: map_has(home, "tokens.map", SID) == token_digest("a-new-token"), "the new token's digest")
    assert conn.get("/", **routed(guest))[0] == 403
    assert conn.get("/", **routed(guest, token="a-new-token"))[0] == 200
    # made public: no token needed
    Sandbox.objects.filter(pk=SID).update(traffic_access_token="")
    wait_for(lambda: map_has(home, "tokens.map", SID) is None, "the token's removal")
    assert conn.get("/", **routed(guest, token=None))[0] == 200
    conn.close()


def test_what_the_hot_path_leaves_to_the_data_plane_goes_there(hot, guest):
    port, home = hot
    conn = Conn(port)
    assert conn.get("/", **routed(guest))[0] == 200
    back = served(home, "dataplane")
    envd = conn.get("/health", **{"E2b-Sandbox-Id": SID, "E2b-Sandbox-Port": str(ENVD_PORT)})
    unknown = conn.get("/", **{"E2b-Sandbox-Id": "nosuchsandbox", "E2b-Sandbox-Port": str(guest.port)})
    bad_port = conn.get("/", **routed(guest, **{"E2b-Sandbox-Port": "0x50"}))
    assert envd[0] == 502  # envd's port: the data plane tried (nothing listens on the row's envd_port)
    assert unknown[0] == 502 and "was not found" in json.loads(unknown[2])["message"]
    assert bad_port[0] == 400
    assert served(home, "dataplane") - back == 3


def test_a_sandbox_that_stops_running_loses_its_route_at_once(hot, guest):
    port, home = hot
    conn, streaming = Conn(port), Conn(port)
    assert conn.get("/", **routed(guest))[0] == 200
    assert streaming.get("/", **routed(guest))[0] == 200
    streaming.send("/stream", {"Host": "127.0.0.1", **routed(guest)})
    assert streaming.head()[0] == 200 and streaming._exactly(4)  # the stream flows, through HAProxy
    assert served(home, "guest") == 1
    assert map_has(home, "ports.map", f"{SID}_{guest.port}").startswith(f"{SID}_{guest.port}.")  # its server

    Sandbox.objects.filter(pk=SID).update(state="killed")
    started = time.monotonic()
    wait_for(lambda: map_has(home, "ports.map", f"{SID}_{guest.port}") is None, "the route's removal", 5)
    removed_after = time.monotonic() - started
    seen = len(guest.seen)
    status, _, body = conn.get("/", **routed(guest))
    assert status == 502 and "was not found" in json.loads(body)["message"]
    assert len(guest.seen) == seen
    # the relayed stream is cut too
    streaming.sock.settimeout(10)
    with pytest.raises((ConnectionError, OSError)):
        for _ in range(200):
            streaming._exactly(len(streaming.buf) + 1)
    assert removed_after < 3.0, removed_after


def test_the_guest_cookies_are_confined_on_the_hot_path(hot, guest):
    port, home = hot
    by_header = Conn(port)
    for _ in range(2):
        _, fields, _ = by_header.get("/", **routed(guest))
        assert not [v for k, v in fields if k == "set-cookie"]
    host = f"{guest.port}-{SID}.example.test"
    by_host = Conn(port)
    before = served(home, "guest")
    for _ in range(2):
        status, fields, _ = by_host.get("/", host=host, **{"E2b-Traffic-Access-Token": TOKEN})
        assert status == 200
        assert sorted(v for k, v in fields if k == "set-cookie") == ["a=1; Path=/", "b=2; Path=/"]
    assert served(home, "guest") - before == 1  # the second one was HAProxy's
    assert guest.seen[-1][1]["host"] == host  # the client's Host, as the data plane forwards it


def test_a_closed_port_is_answered_as_the_data_plane_does(hot, guest):
    port, home = hot
    conn = Conn(port)
    assert conn.get("/", **routed(guest))[0] == 200
    closed = _free_port()
    status, fields, body = conn.get("/", **routed(guest, **{"E2b-Sandbox-Port": str(closed)}))
    assert status == 502
    assert json.loads(body) == {"sandboxId": SID, "message": "The sandbox is running but port is not open",
                                "code": 502, "port": closed}
    assert ("access-control-allow-origin", "*") in fields


def test_a_guest_speaking_http_1_0_keeps_its_clients_on_the_data_plane(hot, guest):
    """``python -m http.server`` answers in HTTP/1.0 and closes: HAProxy would pass that status
    line on, where the data plane answers in HTTP/1.1, so such connections are not handed off."""
    port, home = hot
    old = Guest("HTTP/1.0")
    try:
        conn = Conn(port)
        for _ in range(3):
            conn.send("/", {"Host": "127.0.0.1", **routed(old)})
            status, fields = conn.head()
            assert status == 200 and conn._exactly(int(dict(fields)["content-length"])) == b"ok"
        assert served(home, "guest") == 0 and len(old.seen) == 3
        # the data plane's answer was HTTP/1.1 on one kept connection
        assert conn.sock.getpeername()[1] == port
    finally:
        old.stop()


def test_a_state_write_nudges_the_data_plane(hot, guest, monkeypatch):
    """The data plane as deployed listens where ``sandboxes.route_nudge`` sends (its run
    directory), and a state write through ``sandboxes.transitions`` (in this process, as in the
    API's) sends once committed. That the steering reads again at once on a datagram is
    tests/unit/test_dataplane_hotpath_nudge.py's (here the 0.1 s poll would hide it)."""
    port, home = hot
    monkeypatch.setenv("AENV_HOME", home)
    paths = route_nudge.sockets()
    assert len(paths) == 1 and os.path.realpath(os.path.dirname(paths[0])) == os.path.realpath(
        os.path.dirname(glob.glob(os.path.join(home, "dataplane-hotpath-*", "admin.sock"))[0]))
    conn = Conn(port)
    for _ in range(2):
        assert conn.get("/", **routed(guest))[0] == 200
    key = f"{SID}_{guest.port}"
    assert map_has(home, "ports.map", key)
    sent = []
    real = route_nudge.nudge
    monkeypatch.setattr(route_nudge, "nudge", lambda sid: (sent.append(sid), real(sid)))
    assert transition_sync(SID, [S.RUNNING], S.KILLING, SandboxEvent(sandbox_id=SID, operation="kill"))
    assert sent == [SID]
    wait_for(lambda: map_has(home, "ports.map", key) is None, "the route's removal", 5)
    status, _, body = conn.get("/", **routed(guest))
    assert status == 502
