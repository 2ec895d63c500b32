"""PTY create / input / resize / kill / reconnect through the SDK."""
import re
import time

import pytest
from e2b import CommandExitException
from e2b.sandbox.commands.command_handle import PtySize


def _collect(handle, out):
    return handle.wait(on_pty=lambda data: out.append(bytes(data)))


def test_pty_env_size_resize_and_exit(sandbox):
    h = sandbox.pty.create(PtySize(rows=24, cols=80), envs={"ABC": "xyz"})
    sandbox.pty.send_stdin(h.pid, b"echo val=$ABC; tput cols; tty\n")
    time.sleep(0.5)
    sandbox.pty.resize(h.pid, PtySize(rows=30, cols=123))
    time.sleep(0.2)
    sandbox.pty.send_stdin(h.pid, b"tput cols; exit\n")
    out = []
    r = _collect(h, out)
    text = b"".join(out).decode()
    assert r.exit_code == 0
    assert "val=xyz" in text
    assert re.search(r"[\r\n]80\r\n", text)
    assert re.search(r"[\r\n]123\r\n", text)
    assert "/dev/pts/" in text


def test_pty_kill(sandbox):
    h = sandbox.pty.create(PtySize(rows=24, cols=80))
    assert sandbox.pty.kill(h.pid) is True
    with pytest.raises(CommandExitException) as exc:
        h.wait(on_pty=lambda d: None)
    assert exc.value.exit_code == -1
    assert sandbox.pty.kill(h.pid) is False


def test_pty_reconnect_sees_new_output(sandbox):
    h = sandbox.pty.create(PtySize(rows=24, cols=80))
    h.disconnect()
    h2 = sandbox.pty.connect(h.pid)
    sandbox.pty.send_stdin(h.pid, b"echo again-$((40+2)); exit\n")
    out = []
    h2.wait(on_pty=lambda d: out.append(bytes(d)))
    assert "again-42" in b"".join(out).decode()


def test_pty_rejects_stdin_kind_and_close(sandbox):
    h = sandbox.pty.create(PtySize(rows=24, cols=80))
    try:
        with pytest.raises(Exception):
            sandbox.commands.send_stdin(h.pid, "x")  # stdin to a pty process
        with pytest.raises(Exception):
            sandbox.commands.close_stdin(h.pid)
    finally:
        sandbox.pty.kill(h.pid)
