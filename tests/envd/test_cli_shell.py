"""``aenv connect`` driven through a pseudo-terminal (pexpect) against a real envd on the
host: a prompt, typed commands and their output, the window size at start and after a
resize, TERM, Ctrl-C reaching the remote shell, the shell's exit status as the CLI's;
the session surviving its connection being cut (a relay between the CLI and envd), and
ending with 130 when the API reports the sandbox paused or gone. With a VM through the
whole stack: tests/integration/test_cli.py."""
import os
import re
import sys
import time
from pathlib import Path

import pexpect
import pytest

from .cli_api import FakeApi, Relay, await_process

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "PROMPT> "
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # bash's bracketed-paste switches around each line


@pytest.fixture
def api():
    fake = FakeApi()
    yield fake
    fake.close()


def spawn(api: FakeApi, sandbox_url: str, *extra, rows=30, cols=100):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("E2B_", "AENV_"))},
           "E2B_API_URL": api.url, "E2B_SANDBOX_URL": sandbox_url, "E2B_API_KEY": "k", "TERM": "xterm-ghostty"}
    child = pexpect.spawn(sys.executable, ["-m", "aenv_cli", "connect", "sb", *extra], cwd=str(ROOT), env=env,
                          dimensions=(rows, cols), timeout=30, encoding="utf-8", codec_errors="replace")
    child.expect(r"[$#] ")  # the login shell's own prompt: it reads input from now on
    child.sendline(f"export PS1='{PROMPT}'")
    child.expect_exact(PROMPT)
    return child


def finish(child) -> None:
    """Closes the terminal once the CLI has exited by itself (bounded): pexpect's close()
    SIGKILLs a process still alive 0.1 s after, which on a loaded machine is one still
    cleaning up (killing its remote shell), and its exit status would be lost."""
    deadline = time.monotonic() + 15
    while child.isalive() and time.monotonic() < deadline:
        time.sleep(0.05)
    child.close()


def run(child, command: str) -> str:
    """Types ``command``; what it printed before the next prompt."""
    child.sendline(command)
    child.expect_exact(command)  # the echo of what was typed
    child.expect_exact(PROMPT)
    return ANSI.sub("", child.before).strip()


def test_a_shell_on_a_terminal_that_follows_the_window(api, envd):
    child = spawn(api, envd.url)
    try:
        assert run(child, "stty size") == "30 100"
        assert run(child, "echo $TERM") == "xterm-256color"  # a TERM every guest knows
        assert run(child, "whoami") == "user"
        child.setwinsize(50, 132)  # the kernel sends the CLI SIGWINCH
        deadline = time.monotonic() + 10
        size = run(child, "stty size")
        while size != "50 132" and time.monotonic() < deadline:
            time.sleep(0.2)
            size = run(child, "stty size")
        assert size == "50 132" and run(child, "tput cols") == "132"
        child.sendline("sleep 100")
        time.sleep(1)
        child.sendcontrol("c")  # to the remote shell: sleep ends, the session stays
        child.expect_exact(PROMPT, timeout=10)
        assert run(child, "echo still here") == "still here"
        child.sendline("exit 3")
        child.expect(pexpect.EOF)
    finally:
        finish(child)
    assert child.exitstatus == 3
    assert any(call[1] == "/sandboxes/sb/connect" for call in api.calls)


def test_the_session_survives_its_connection_being_cut(api, envd):
    relay = Relay(int(envd.url.rsplit(":", 1)[1]))
    child = spawn(api, relay.url)
    try:
        assert run(child, "export MARK=kept; echo $MARK") == "kept"
        before = relay.accepted
        relay.cut()  # as a data plane restart would
        time.sleep(1)
        assert run(child, "echo $MARK again") == "kept again"  # the same shell, re-attached
        assert relay.accepted > before
        child.sendline("exit")
        child.expect(pexpect.EOF)
    finally:
        finish(child)
        relay.close()
    assert child.exitstatus == 0


@pytest.mark.parametrize("state, words", [("paused", "has been paused"), ("gone", "no longer exists")])
def test_a_paused_or_killed_sandbox_ends_the_session_with_130(api, envd, state, words):
    child = spawn(api, envd.url)
    try:
        assert run(child, "echo up") == "up"
        api.state = state
        child.expect_exact(words, timeout=20)
        child.expect(pexpect.EOF)
    finally:
        finish(child)
    assert child.exitstatus == 130


def test_a_lost_shell_is_killed_when_the_terminal_closes(api, envd):
    marker = f"aenv-shell-{os.getpid()}"
    child = spawn(api, envd.url)
    try:
        child.sendline(f"exec -a {marker[:6]}''{marker[6:]} sleep 300")
        assert await_process(marker, running=True)
        child.kill(1)  # SIGHUP: the terminal window went away
        child.expect(pexpect.EOF)
    finally:
        finish(child)
    assert child.exitstatus == 129 or child.signalstatus == 1
    assert await_process(marker, running=False)
