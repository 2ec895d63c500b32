"""envd stays asleep while its sandbox idles (issue 26): no uvicorn tick, listener scans slowed
down until someone uses the sandbox. Speeds are measured by bench/idle.py, not here."""
import asyncio
import threading
import time
from email.utils import parsedate_to_datetime

import httpx
import pytest
import uvicorn

from envd import port_forward as pf
from envd.app import EnvdApp
from envd.quiet_server import QuietServer
from envd.server import parse_args
from envd.state import Settings
from tests.envd.test_port_forward import ALIAS, _echo, _eventually, _free_port

pytestmark = pytest.mark.xdist_group("loopback-aliases")  # the forwarders mirror loopback onto ALIAS


async def _ok(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


class _Running:
    """A QuietServer serving ``app`` on its own thread and event loop."""

    def __init__(self, app):
        self.port = _free_port()
        self.server = QuietServer(uvicorn.Config(app, host="127.0.0.1", port=self.port, lifespan="off",
                                                 log_level="warning", access_log=False))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)

    def _serve(self):
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.server.serve())

    def scheduled(self):
        """Timers pending on the server's loop (asyncio's own list; read from this thread)."""
        return [h for h in list(self.loop._scheduled) if not h.cancelled()]


def test_quiet_server_has_no_timer_while_idle_and_exits_on_a_signal():
    running = _Running(_ok)
    try:
        r = httpx.get(f"http://127.0.0.1:{running.port}/", headers={"Connection": "close"}, timeout=10)
        assert r.status_code == 200 and r.text == "ok"
        date = parsedate_to_datetime(r.headers["date"])
        assert abs(date.timestamp() - time.time()) < 60  # current, not frozen at start
        assert len(r.headers.get_list("date")) == 1
        # stock uvicorn always has its 0.1 s sleep pending here; a closed connection leaves nothing
        deadline = time.monotonic() + 10
        while running.scheduled() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert running.scheduled() == []
    finally:
        running.server.handle_exit(15, None)  # what SIGTERM calls; must wake the sleeping loop
        running.thread.join(timeout=30)
    assert not running.thread.is_alive()


def test_quiet_server_refuses_what_needs_the_tick():
    with pytest.raises(ValueError):
        QuietServer(uvicorn.Config(_ok, limit_max_requests=10))


def test_date_header_follows_the_clock(monkeypatch):
    server = QuietServer(uvicorn.Config(_ok))
    server.config.load()
    monkeypatch.setattr(time, "time", lambda: 1_000_000_000.0)
    first = dict(server.server_state.default_headers)[b"date"]
    monkeypatch.setattr(time, "time", lambda: 1_000_000_061.0)
    later = dict(server.server_state.default_headers)[b"date"]
    assert first == b"Sun, 09 Sep 2001 01:46:40 GMT" and later == b"Sun, 09 Sep 2001 01:47:41 GMT"
    server.server_state.default_headers = []  # what uvicorn's tick would do: ignored
    assert dict(server.server_state.default_headers)[b"date"] == later


async def test_idle_forwarder_waits_for_a_poke():
    port = _free_port()
    server = await asyncio.start_server(_echo, "127.0.0.1", port)
    # an idle period no test run reaches, and the first minute of activity already over
    fwd = pf.PortForwarder(listen_address=ALIAS, interval=0.05, idle_interval=3600, active_for=3600)
    fwd._active_until = time.monotonic()
    fwd.start()
    try:
        await asyncio.sleep(0.5)  # ten fast periods: an active forwarder would have forwarded by now
        assert not fwd.active and fwd.forwards == {}
        fwd.poke()
        assert fwd.active
        await _eventually(lambda: _forwarded(fwd, port), what="the forward after a poke")
    finally:
        fwd.close()
        server.close()


async def _forwarded(fwd, port):
    return port in fwd.forwards


async def test_active_forwarder_scans_at_the_fast_period():
    port = _free_port()
    server = await asyncio.start_server(_echo, "127.0.0.1", port)
    fwd = pf.PortForwarder(listen_address=ALIAS, interval=0.05, idle_interval=3600)  # active for 60 s
    fwd.start()
    try:
        await _eventually(lambda: _forwarded(fwd, port), what="the forward while active")
    finally:
        fwd.close()
        server.close()


def test_forwarder_periods_are_checked():
    with pytest.raises(ValueError):
        pf.PortForwarder(interval=2, idle_interval=1)
    assert parse_args([]).forward_idle_interval == 10.0
    assert parse_args(["--forward-interval", "30"]).forward_idle_interval == 30.0
    assert parse_args(["--forward-idle-interval", "5"]).forward_idle_interval == 5.0
    with pytest.raises(SystemExit):
        parse_args(["--forward-interval", "5", "--forward-idle-interval", "2"])


class _CountingForwarder:
    def __init__(self):
        self.pokes = 0

    def start(self):
        pass

    def close(self):
        pass

    def poke(self):
        self.pokes += 1


async def _request(app, path, method="GET"):
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    await app({"type": "http", "path": path, "method": method, "headers": [], "query_string": b""}, receive, send)
    return sent[0]["status"]


async def test_only_someones_requests_poke_the_forwarder(tmp_path):
    fwd = _CountingForwarder()
    app = EnvdApp(Settings(default_user="root", default_workdir=str(tmp_path)), port_forwarder=fwd)
    assert await _request(app, "/health") == 204
    assert await _request(app, "/metrics") == 200
    assert fwd.pokes == 0  # the driver's and the node's polls are nobody's work
    assert await _request(app, "/envs") == 200
    assert await _request(app, "/nothing-here") == 404
    assert fwd.pokes == 2
