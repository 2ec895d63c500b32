"""The terminal socket without a VM: who may open it (session auth, team isolation,
same-origin check), closing with a code and reason for non-running sandboxes, and a
refused, silent or garbage-speaking envd closing the socket promptly without leaking
the consumer's tasks. The real-VM bridge is tests/integration/test_terminal.py."""
import asyncio
import json
import socket
import threading
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.utils import timezone

from dashboard import terminal
from sandboxes.models import Sandbox

pytestmark = pytest.mark.django_db(transaction=True)


def make_sandbox(team, template, *, state="running", port=None, **fields):
    return Sandbox.objects.create(team=team, template=template, state=state, envd_host="127.0.0.1",
                                  envd_port=port or closed_port(), end_at=timezone.now() + timedelta(minutes=5),
                                  **fields)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def headers_for(client=None, origin=b"http://testserver"):
    headers = [(b"host", b"testserver")]
    if origin is not None:
        headers.append((b"origin", origin))
    if client is not None:
        headers.append((b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode()))
    return headers


def communicator(sandbox_id, headers, query=""):
    from config.asgi import application  # noqa: PLC0415

    path = f"/ws/sandboxes/{sandbox_id}/terminal" + (f"?{query}" if query else "")
    return WebsocketCommunicator(application, path, headers=headers)


async def expect_close(comm, code, text="", timeout=10.0):
    """Connects, then waits for the server's close (announced by a last JSON frame
    with the same code and reason); returns the reason."""
    connected, _ = await comm.connect(timeout=timeout)
    assert connected
    said = None
    while True:
        msg = await comm.receive_output(timeout=timeout)
        if msg["type"] == "websocket.close":
            break
        if msg.get("text"):
            said = json.loads(msg["text"])
    assert said == {"type": "close", "code": msg.get("code"), "reason": msg.get("reason")}, (said, msg)
    assert msg.get("code") == code, msg
    assert text in msg.get("reason", ""), msg
    await comm.disconnect(code=msg["code"], timeout=timeout)  # the browser's side of the close
    return msg.get("reason", "")


def leaked_terminal_tasks():
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("terminal-") and not t.done()]


@pytest.fixture
def mine(team, base_template):
    return make_sandbox(team, base_template)


@pytest.fixture
def theirs(other_team, base_template):
    return make_sandbox(other_team, base_template)


async def test_anonymous_is_closed_4401(db, mine):
    await expect_close(communicator(mine.id, headers_for()), terminal.CLOSE_UNAUTHENTICATED, "sign in")


async def test_other_teams_sandbox_looks_missing(dash, theirs):
    reason = await expect_close(communicator(theirs.id, headers_for(dash)), terminal.CLOSE_NOT_FOUND)
    assert reason == "sandbox not found"
    unknown = await expect_close(communicator("inope", headers_for(dash)), terminal.CLOSE_NOT_FOUND)
    assert unknown == reason  # a foreign id and an unknown id are indistinguishable


async def test_member_of_both_teams_uses_current_team(dash, user, other_team, theirs, mine):
    """Like every page, the socket acts for the dashboard's current team only."""
    await sync_to_async(other_team.members.add)(user)
    await expect_close(communicator(theirs.id, headers_for(dash)), terminal.CLOSE_NOT_FOUND)


@pytest.mark.parametrize("origin", [b"http://evil.example", b"null", None, b"https://testserver.evil.example"])
async def test_cross_origin_handshake_is_refused(dash, mine, origin):
    comm = communicator(mine.id, headers_for(dash, origin=origin))
    connected, _ = await comm.connect(timeout=5)
    assert not connected
    await comm.wait(timeout=5)


@pytest.mark.parametrize("state,text", [("paused", "sandbox is paused: resume it"), ("killed", "sandbox was killed"),
                                        ("error", "sandbox failed"), ("creating", "sandbox is creating")])
async def test_not_running_is_closed_with_reason(dash, team, base_template, state, text):
    sandbox = await sync_to_async(make_sandbox)(team, base_template, state=state)
    await expect_close(communicator(sandbox.id, headers_for(dash)), terminal.CLOSE_NOT_RUNNING, text)


async def test_unreachable_envd_closes_promptly(dash, mine):
    started = asyncio.get_running_loop().time()
    await expect_close(communicator(mine.id, headers_for(dash)), terminal.CLOSE_UNREACHABLE, "sandbox unreachable")
    assert asyncio.get_running_loop().time() - started < 8
    assert leaked_terminal_tasks() == []


class SilentServer:
    """Accepts TCP connections and never answers (a hung envd)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.conns = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)

    def close(self):
        for c in self.conns:
            c.close()
        self.sock.close()


async def test_silent_envd_times_out_and_leaks_nothing(dash, team, base_template, monkeypatch):
    monkeypatch.setattr(terminal, "ENVD_STREAM_IDLE_TIMEOUT", 1.0)
    monkeypatch.setattr(terminal, "ENVD_TIMEOUT", 1.0)
    server = SilentServer()
    try:
        sandbox = await sync_to_async(make_sandbox)(team, base_template, port=server.port)
        await expect_close(communicator(sandbox.id, headers_for(dash)), terminal.CLOSE_UNREACHABLE, "unreachable")
    finally:
        server.close()
    assert leaked_terminal_tasks() == []


async def test_kill_while_hung_closes_with_reason(dash, team, base_template, monkeypatch):
    """A VM that stops answering without closing the connection: the state watcher,
    not the envd stream, ends the terminal once the sandbox is killed."""
    monkeypatch.setattr(terminal, "STATE_POLL_SECONDS", 0.2)
    server = SilentServer()
    try:
        sandbox = await sync_to_async(make_sandbox)(team, base_template, port=server.port)
        comm = communicator(sandbox.id, headers_for(dash))
        connected, _ = await comm.connect(timeout=5)
        assert connected
        await asyncio.sleep(0.5)
        await Sandbox.objects.filter(pk=sandbox.pk).aupdate(state="killed")
        said = await comm.receive_json_from(timeout=5)
        assert said == {"type": "close", "code": terminal.CLOSE_NOT_RUNNING, "reason": "sandbox was killed"}
        msg = await comm.receive_output(timeout=5)
        assert msg == {"type": "websocket.close", "code": terminal.CLOSE_NOT_RUNNING, "reason": "sandbox was killed"}
        await comm.disconnect(code=msg["code"], timeout=5)
    finally:
        server.close()
    assert leaked_terminal_tasks() == []


async def test_browser_leaving_cancels_the_bridge(dash, team, base_template):
    server = SilentServer()
    try:
        sandbox = await sync_to_async(make_sandbox)(team, base_template, port=server.port)
        comm = communicator(sandbox.id, headers_for(dash))
        assert (await comm.connect(timeout=5))[0]
        await asyncio.sleep(0.3)
        names = {t.get_name() for t in leaked_terminal_tasks()}
        assert names == {f"terminal-{sandbox.id}", f"terminal-{sandbox.id}-pump", f"terminal-{sandbox.id}-watch"}
        await comm.disconnect()
        await asyncio.sleep(0.1)
    finally:
        server.close()
    assert leaked_terminal_tasks() == []


@pytest.mark.parametrize("frame", ['{"type": "bogus"}', "not json", '["input"]', '{"type": "resize", "cols": 80}'])
async def test_garbage_from_the_browser_closes_4400(dash, team, base_template, frame):
    server = SilentServer()
    try:
        sandbox = await sync_to_async(make_sandbox)(team, base_template, port=server.port)
        comm = communicator(sandbox.id, headers_for(dash))
        assert (await comm.connect(timeout=5))[0]
        await comm.send_to(text_data=frame)
        assert await comm.receive_json_from(timeout=5) == {"type": "close", "code": 4400,
                                                           "reason": "bad terminal message"}
        assert (await comm.receive_output(timeout=5))["code"] == terminal.CLOSE_BAD_MESSAGE
        await comm.disconnect(code=terminal.CLOSE_BAD_MESSAGE)
        await asyncio.sleep(0.1)
    finally:
        server.close()
    assert leaked_terminal_tasks() == []


def test_detail_page_wires_the_terminal(dash, mine, team, base_template):
    html = dash.get(f"/dashboard/sandboxes/{mine.id}/").content.decode()
    assert f'data-ws-path="/ws/sandboxes/{mine.id}/terminal"' in html
    assert "vendor/xterm/xterm.js" in html and "dashboard/terminal.js" in html
    assert 'data-status="connecting">connecting…</span>' in html
    paused = make_sandbox(team, base_template, state="paused")
    html = dash.get(f"/dashboard/sandboxes/{paused.id}/").content.decode()
    assert 'data-status="closed">closed: sandbox is paused: resume it to use the terminal</span>' in html


def test_page_retries_only_closes_that_may_heal(dash, mine):
    """The page learns from the server which close codes are final ("closed"); after any
    other (a drop, envd unreachable) it says "reconnecting" and tries again."""
    html = dash.get(f"/dashboard/sandboxes/{mine.id}/").content.decode()
    assert 'data-final-codes="4000 4400 4401 4404 4409"' in html
    assert terminal.FINAL_CLOSE_CODES == {terminal.CLOSE_EXITED, terminal.CLOSE_BAD_MESSAGE,
                                          terminal.CLOSE_UNAUTHENTICATED, terminal.CLOSE_NOT_FOUND,
                                          terminal.CLOSE_NOT_RUNNING}
    assert terminal.CLOSE_UNREACHABLE not in terminal.FINAL_CLOSE_CODES


@pytest.mark.parametrize("origin,host,ok", [
    ("http://dash.example:8000", "dash.example:8000", True),
    ("https://dash.example", "dash.example:443", True),
    ("https://dash.example", "dash.example", True),
    ("http://dash.example", "dash.example:8000", False),    # another port is another origin
    ("http://dash.example.evil.io", "dash.example", False),
    ("file://dash.example", "dash.example", False),
    ("https://proxy.example", "127.0.0.1:3000", True),      # listed in CSRF_TRUSTED_ORIGINS
    ("", "dash.example", False),
])
def test_origin_rule(settings, origin, host, ok):
    from dashboard.origin import origin_allowed

    settings.CSRF_TRUSTED_ORIGINS = ["https://proxy.example"]
    assert origin_allowed({b"origin": origin.encode(), b"host": host.encode()}) is ok
