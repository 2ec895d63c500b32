"""envd_client (sync and async) against a real envd on the host: health, /init with a
token and the token handoff, commands with streamed output and exit codes, PTYs
(start with size and tag, input, resize, disconnect and reconnect by pid), /files round
trips, guest sync, and its errors (a Connect code from envd, EnvdUnavailable when nothing
answers)."""
import asyncio
import contextlib
import secrets
import socket
import threading
import time

import pytest

from envd_client import AsyncEnvdClient, EnvdClient, EnvdError, EnvdUnavailable

from .conftest import EnvdServer


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def client(envd):
    with EnvdClient(envd.url) as c:
        yield c


@pytest.fixture
async def aclient(envd):
    async with AsyncEnvdClient(envd.url) as c:
        yield c


@pytest.fixture
def fresh_envd(sandbox_user):
    """An envd of its own: /init changes its token, which must not leak into other tests."""
    server = EnvdServer()
    yield server
    server.stop()


def read_until(events, needle: bytes, timeout: float = 20.0) -> bytes:
    """PTY output from ``events`` until ``needle`` shows up."""
    out, deadline = b"", time.monotonic() + timeout
    while needle not in out:
        assert time.monotonic() < deadline, f"no {needle!r} in {out[-300:]!r}"
        ev = next(events)
        if ev.kind == "data":
            out += ev.data
        assert ev.kind != "end", f"process ended before {needle!r}: {out[-300:]!r}"
    return out


async def aread_until(events, needle: bytes, timeout: float = 20.0) -> bytes:
    out = b""

    async def collect():
        nonlocal out
        async for ev in events:
            assert ev.kind != "end", f"process ended before {needle!r}: {out[-300:]!r}"
            if ev.kind == "data":
                out += ev.data
                if needle in out:
                    return

    await asyncio.wait_for(collect(), timeout)
    return out


# ------------------------------------------------------------------ sync

def test_health(client):
    assert client.health() is True
    with EnvdClient.at("127.0.0.1", closed_port()) as nobody:
        assert nobody.health() is False


def test_init_installs_the_token_then_calls_need_it(fresh_envd):
    token, other = secrets.token_hex(16), secrets.token_hex(16)
    with EnvdClient(fresh_envd.url) as envd:
        envd.init({"SANDBOX_WIDE": "yes"}, access_token=token)
        assert envd.access_token == token
        assert envd.run("echo $SANDBOX_WIDE $USER").stdout == b"yes user\n"
        envd.init({"SANDBOX_WIDE": "again"}, access_token=token)  # a re-init must show the token: it does
        assert envd.run("echo $SANDBOX_WIDE").stdout == b"again\n"
    for wrong in (None, "nope"):
        with EnvdClient(fresh_envd.url, wrong) as stranger:
            assert stranger.health()  # /health needs no token
            for call in (lambda: stranger.run("true"), stranger.list, lambda: stranger.read_file("/etc/hostname"),
                         lambda: stranger.init({}, access_token="mine")):
                with pytest.raises(EnvdError) as exc:
                    call()
                assert exc.value.code == "unauthenticated" and exc.value.status == 401
    with EnvdClient(fresh_envd.url, token) as envd:  # a restore: hand the source's token over
        envd.handoff_token(other)
        assert envd.access_token == other and envd.list() is not None
    with EnvdClient(fresh_envd.url, token) as stale, pytest.raises(EnvdError) as exc:
        stale.list()
    assert exc.value.code == "unauthenticated"


def test_run_streams_stdout_and_stderr_with_the_exit_code(client):
    seen = []
    result = client.run("echo first; echo oops >&2; sleep 1; echo second; exit 3",
                        on_stdout=lambda b: seen.append((time.monotonic(), "out", b)),
                        on_stderr=lambda b: seen.append((time.monotonic(), "err", b)))
    assert (result.exit_code, result.ok, result.status) == (3, False, "exit status 3")
    assert result.stdout == b"first\nsecond\n" and result.stderr == b"oops\n" and result.pid > 0
    assert b"".join(b for _, kind, b in seen if kind == "out") == result.stdout
    first = next(t for t, _, b in seen if b"first" in b)
    second = next(t for t, _, b in seen if b"second" in b)
    assert second - first > 0.5  # streamed as it came, not at the end


def test_start_yields_events_in_order(client):
    with contextlib.closing(client.start("/bin/sh", ["-c", "printf a; printf b >&2"], envs={"Z": "1"})) as events:
        kinds = [(ev.kind, ev.stream) for ev in events]
    assert kinds[0] == ("start", "") and kinds[-1] == ("end", "")
    assert ("data", "stdout") in kinds and ("data", "stderr") in kinds


def test_failing_commands(client):
    assert client.run("exit 7").error == "exit status 7"
    killed = client.run("kill -9 $$")
    assert killed.exit_code == -1 and killed.status == "signal: killed"
    with pytest.raises(EnvdError) as exc:
        client.run("true", cwd="/does/not/exist")
    assert exc.value.code == "invalid_argument"
    with pytest.raises(EnvdError) as exc:
        client.run("true", user="nobody-such")
    assert exc.value.code == "unauthenticated"


def test_run_as_user_with_env_and_cwd(client, workdir):
    assert client.run("whoami", user="root").stdout == b"root\n"
    out = client.run("echo $(whoami) $V $PWD", envs={"V": "v1"}, cwd=workdir).stdout.decode()
    assert out == f"user v1 {workdir}\n"


def test_pty_start_input_resize_and_reconnect(client):
    tag = "t-" + secrets.token_hex(4)
    events = client.start_pty(90, 30, tag=tag, envs={"MARK": "m1"})
    first = next(events)
    assert first.kind == "start" and first.pid > 0
    pid = first.pid
    assert client.tag_of(pid) == tag
    assert any(p.pid == pid and p.cmd == "/bin/bash" for p in client.list())
    client.send_input(pid, b"echo val=$MARK-$((6*7)); stty size\n")
    read_until(events, b"30 90")
    client.resize(pid, 123, 41)
    client.send_input(pid, b"stty size\n")
    read_until(events, b"41 123")
    events.close()  # the page went away: the shell lives on

    again = client.connect(pid)
    assert next(again).pid == pid
    client.send_input(pid, b"echo back-$((2+3))\n")
    read_until(again, b"back-5")
    client.send_input(pid, b"exit 3\n")
    end = next(ev for ev in again if ev.kind == "end")
    assert end.exit_code == 3 and end.status == "exit status 3"
    assert client.tag_of(pid) is None
    with pytest.raises(EnvdError) as exc:
        next(client.connect(pid))
    assert exc.value.code == "not_found"


def test_kill_by_tag_before_the_pid_is_known(client):
    """What ``aenv exec`` does on a Ctrl-C that beats the start event: the tag it started with
    finds the command."""
    tag = "k-" + secrets.token_hex(4)
    events = client.start("/bin/sleep", ["300"], tag=tag)
    pid = next(events).pid
    assert client.tag_of(pid) == tag
    assert client.kill(None, tag=tag) is True
    end = next(ev for ev in events if ev.kind == "end")
    assert end.status == "signal: killed" and client.tag_of(pid) is None
    assert client.kill(None, tag=tag) is False


def test_files_round_trip(client, workdir):
    data = bytes(range(256)) * 1000 + b"\x00end"
    entry = client.write_file(f"{workdir}/sub/dir/blob.bin", data)
    assert entry["path"] == f"{workdir}/sub/dir/blob.bin" and entry["type"] == "file"
    assert client.read_file(f"{workdir}/sub/dir/blob.bin") == data
    assert client.run(f"stat -c %U {workdir}/sub/dir/blob.bin").stdout == b"user\n"
    root_only = f"/root/.envd-client-{secrets.token_hex(4)}"
    try:
        client.write_file(root_only, b"r", user="root")
        assert client.read_file(root_only, user="root") == b"r"
        with pytest.raises(EnvdError) as exc:
            client.read_file(root_only)  # as 'user'
    finally:
        client.run(f"rm -f {root_only}", user="root")
    assert (exc.value.code, exc.value.status) == ("permission_denied", 403)
    with pytest.raises(EnvdError) as exc:
        client.read_file(f"{workdir}/missing")
    assert (exc.value.code, exc.value.status) == ("not_found", 404)
    with pytest.raises(EnvdError) as exc:
        client.write_file(workdir, b"x")
    assert exc.value.code == "invalid_argument" and "is a directory" in exc.value.message


def test_guest_sync(client):
    client.sync()


def test_unknown_pid_is_not_found(client):
    for call in (lambda: client.send_input(999_999, b"x"), lambda: client.resize(999_999, 10, 10),
                 lambda: next(client.connect(999_999))):
        with pytest.raises(EnvdError) as exc:
            call()
        assert exc.value.code == "not_found" and "999999" in exc.value.message
    assert client.kill(999_999) is False
    assert client.tag_of(999_999) is None


def test_nothing_listening_is_unavailable():
    with EnvdClient.at("127.0.0.1", closed_port(), "tok") as envd:
        for call in (envd.list, lambda: envd.run("true"), lambda: envd.read_file("/x"), envd.sync,
                     lambda: envd.init({}, access_token="t"), lambda: next(envd.start_pty(80, 24))):
            with pytest.raises(EnvdUnavailable) as exc:
                call()
            assert exc.value.code == "unavailable" and "ConnectError" in exc.value.message


class SilentServer:
    """Accepts TCP connections and never answers (a frozen VM)."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.conns = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        with contextlib.suppress(OSError):
            while True:
                self.conns.append(self.sock.accept()[0])

    def close(self):
        for c in self.conns:
            c.close()
        self.sock.close()


def test_a_silent_envd_times_out_as_unavailable():
    server = SilentServer()
    try:
        with EnvdClient.at("127.0.0.1", server.port, timeout=0.5, stream_idle_timeout=0.5) as envd:
            started = time.monotonic()
            with pytest.raises(EnvdUnavailable, match="Timeout"):
                envd.list()
            with pytest.raises(EnvdUnavailable, match="Timeout"):
                next(envd.connect(1))
            assert envd.health(timeout=0.3) is False
            assert time.monotonic() - started < 5
    finally:
        server.close()


# ------------------------------------------------------------------ async

async def test_async_health_and_init_with_token(fresh_envd):
    token = secrets.token_hex(16)
    async with AsyncEnvdClient(fresh_envd.url) as envd:
        assert await envd.health()
        await envd.init({"W": "async"}, access_token=token)
        assert (await envd.run("echo $W")).stdout == b"async\n"
    async with AsyncEnvdClient(fresh_envd.url) as stranger:
        with pytest.raises(EnvdError) as exc:
            await stranger.list()
        assert exc.value.code == "unauthenticated"
    async with AsyncEnvdClient.at("127.0.0.1", closed_port()) as nobody:
        assert await nobody.health() is False


async def test_async_run_streams_and_fails(aclient):
    chunks = []
    result = await aclient.run("echo one; echo two >&2; exit 5", on_stdout=chunks.append, on_stderr=chunks.append)
    assert (result.exit_code, result.stdout, result.stderr) == (5, b"one\n", b"two\n")
    assert b"".join(chunks) in (b"one\ntwo\n", b"two\none\n")
    with pytest.raises(EnvdError) as exc:
        await aclient.run("true", cwd="/does/not/exist")
    assert exc.value.code == "invalid_argument"


async def test_async_pty_start_input_resize_and_reconnect(aclient):
    tag = "t-" + secrets.token_hex(4)
    events = aclient.start_pty(80, 24, tag=tag)
    first = await anext(events)
    assert first.kind == "start"
    pid = first.pid
    assert await aclient.tag_of(pid) == tag
    await aclient.resize(pid, 100, 33)
    await aclient.send_input(pid, b"stty size\n")
    await aread_until(events, b"33 100")
    await events.aclose()

    async with contextlib.aclosing(aclient.connect(pid)) as again:
        assert (await anext(again)).pid == pid
        await aclient.send_input(pid, b"echo re-$((1+1))\n")
        await aread_until(again, b"re-2")
        await aclient.send_input(pid, b"exit\n")
        end = [ev async for ev in again if ev.kind == "end"]
    assert end[0].exit_code == 0
    with pytest.raises(EnvdError) as exc:
        await anext(aclient.connect(pid))
    assert exc.value.code == "not_found"


async def test_async_files_and_errors(aclient, workdir):
    await aclient.write_file(f"{workdir}/a.txt", b"async bytes")
    assert await aclient.read_file(f"{workdir}/a.txt") == b"async bytes"
    with pytest.raises(EnvdError) as exc:
        await aclient.send_input(999_999, b"x")
    assert exc.value.code == "not_found"
    assert await aclient.kill(999_999) is False
    async with AsyncEnvdClient.at("127.0.0.1", closed_port()) as nobody:
        with pytest.raises(EnvdUnavailable):
            await nobody.list()
        with pytest.raises(EnvdUnavailable):
            await anext(nobody.connect(1))
