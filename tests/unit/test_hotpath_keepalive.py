"""The hot path keeps its guest connections alive between requests, and a request is never
written on one that HAProxy opened to an earlier VM of the sandbox (issue 26's regression: a
keep-alive client hung for ``timeout server``, 24 h, after a pause and a resume).

No VM: the data plane as deployed (``python -m dataplane.serve``: uvicorn + HAProxy, the
steering reading the test database) in front of a tiny HTTP server per VM generation, all on
one port and on 127.0.0.1 (a resume at the same address) or on 127.0.0.<n> (a new slot's).
A "paused" generation stops listening and never answers again on the connections it had (a
stopped VM keeps them, silent); the next one listens on the same port. One keep-alive client
talks to every generation in turn, its route removed and added again through the data
plane's own code path (the database row, ``dataplane.steer``'s rounds, the handoff's
``ensure_port``). Each request must be answered by its own generation within
``ANSWER_TIMEOUT``, and no connection HAProxy holds may lead to a server it has freed.

What failed before: HAProxy 2.6 keeps a client's private guest connection (``http-reuse
never``, or a guest's NTLM / Negotiate answer in any mode) in the client's session, bound to
the server object; ``del server`` does not always close it, and a server added later at the
same place in memory picks it up: the request went to the paused generation and waited.
"""
import glob
import os
import re
import socket
import threading

import pytest

from harness.polling import until
from harness.ports import free_port
from sandboxes.models import Sandbox
from tests.unit.test_dataplane_hotpath import SID, TOKEN, Conn, admin, guest, hot, map_has, sandbox  # noqa: F401

pytestmark = pytest.mark.django_db(transaction=True)

ROUNDS = 8
# What "hung" means here: a small GET on loopback takes a few ms, even on a loaded host.
ANSWER_TIMEOUT = 8.0


class Generation:
    """One VM generation's user port: answers ``/`` with ``gen <n>`` and ``/ntlm`` with a 401
    asking for NTLM (what makes HAProxy keep the guest connection private to the client's
    session). ``pause()``: stops listening; every request after that, on any connection it
    accepted, gets no answer."""

    def __init__(self, number: int, port: int, host: str = "127.0.0.1"):
        self.number, self.port, self.host = number, port, host
        self.paused, self.stopped = threading.Event(), threading.Event()
        self.requests = 0
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((host, port))
        self.listener.listen(64)
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.paused.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket):
        buf = b""
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                head, buf = buf.split(b"\r\n\r\n", 1)
                if self.paused.is_set():  # a stopped VM: silence, the connection kept
                    self.stopped.wait()
                    return
                self.requests += 1
                path = head.split(b" ", 2)[1]
                body = f"gen {self.number}".encode()
                status = b"200 OK"
                extra = b""
                if path == b"/ntlm":
                    status, extra = b"401 Unauthorized", b"WWW-Authenticate: NTLM\r\n"
                conn.sendall(b"HTTP/1.1 " + status + b"\r\n" + extra +
                             b"Content-Length: %d\r\n\r\n" % len(body) + body)
        except OSError:
            return
        finally:
            conn.close()

    def pause(self):
        self.paused.set()
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread: no listener left
        except OSError:
            pass
        self.listener.close()

    def stop(self):
        self.pause()
        self.stopped.set()
        for conn in self.conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _port_free_for_generations() -> int:
    """A port free on 127.0.0.1 … 127.0.0.ROUNDS."""
    for _ in range(50):
        port = free_port()
        try:
            for n in range(2, ROUNDS + 1):
                with socket.socket() as s:
                    s.bind((f"127.0.0.{n}", port))
        except OSError:
            continue
        return port
    raise AssertionError("no port free on every address")


def _get(conn: Conn, path: str, port: int) -> tuple[int, bytes]:
    try:
        status, _, body = conn.get(path, **routed_to(port))
    except TimeoutError:
        raise AssertionError(f"GET {path}: no answer in {ANSWER_TIMEOUT} s (the request went to a paused VM)")
    return status, body


def routed_to(port: int) -> dict:
    return {"E2b-Sandbox-Id": SID, "E2b-Sandbox-Port": str(port), "E2b-Traffic-Access-Token": TOKEN}


def guest_servers(home: str) -> dict[str, str]:
    """HAProxy's guest servers now: name → address (``show servers conn``)."""
    out = {}
    for line in admin(home, "show servers conn guest").splitlines():
        parts = line.split()
        if len(parts) > 3 and parts[0].startswith("guest/"):
            out[parts[0].split("/", 1)[1]] = parts[2]
    return out


def connected(home: str) -> set[str]:
    """The guest servers HAProxy's open connections lead to (``show fd``)."""
    return set(re.findall(r" sv=guest/(\S+) ", admin_bytes(home, "show fd").decode("latin-1")))


def admin_bytes(home: str, command: str) -> bytes:
    path = os.path.realpath(glob.glob(os.path.join(home, "dataplane-hotpath-*", "admin.sock"))[0])
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)
        s.sendall(command.encode() + b"\n")
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


@pytest.mark.parametrize("moved", [False, True], ids=["same-address", "new-address"])
@pytest.mark.parametrize("ntlm", [False, True], ids=["plain", "ntlm-private"])
def test_a_keepalive_client_never_waits_on_a_paused_generation(hot, ntlm, moved):
    port, home = hot
    guest_port = _port_free_for_generations()
    key = f"{SID}_{guest_port}"
    gens: list[Generation] = []
    stale = []
    conn = Conn(port)
    conn.sock.settimeout(ANSWER_TIMEOUT)
    try:
        for n in range(1, ROUNDS + 1):
            host = f"127.0.0.{n}" if moved else "127.0.0.1"
            gen = Generation(n, guest_port, host)
            gens.append(gen)
            if n > 1:  # resumed: a new VM generation, at the same address or a new slot's
                Sandbox.objects.filter(pk=SID).update(state="running", vm_generation=n, guest_host=host)
                until(lambda: map_has(home, "tokens.map", SID), "the resumed sandbox published", 10, 0.05)
            for _ in range(3):  # the first may be the data plane's (it adds the port's server)
                assert _get(conn, "/", guest_port) == (200, f"gen {n}".encode()), n
                if ntlm:
                    assert _get(conn, "/ntlm", guest_port) == (401, f"gen {n}".encode()), n
            until(lambda: map_has(home, "ports.map", key), "the port on the hot path", 5, 0.05)
            gen.pause()
            Sandbox.objects.filter(pk=SID).update(state="paused")
            until(lambda: map_has(home, "ports.map", key) is None, "the paused sandbox's port gone", 5, 0.05)
            until(lambda: map_has(home, "tokens.map", SID) is None, "the paused sandbox's token gone", 5, 0.05)
            # no connection HAProxy holds leads to a server it has freed (its name would be
            # whatever the memory holds now); said at the end, after the hang it leads to
            freed = connected(home) - set(guest_servers(home))
            if freed:
                stale.append((n, freed))
        assert not stale, f"connections to freed servers (round, names): {stale}"
        # every generation answered only its own requests (none reached a paused one)
        per_request = 2 if ntlm else 1
        assert [g.requests for g in gens] == [3 * per_request] * ROUNDS
        conn.close()
        # once the client is gone, no guest connection holds a server back: every retired
        # server is deleted (how many may wait in the meantime is bounded by the sessions)
        until(lambda: not guest_servers(home), "the retired servers deleted", 15, 0.1)
    finally:
        conn.close()
        for g in gens:
            g.stop()
