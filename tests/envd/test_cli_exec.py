"""``aenv exec`` against a real envd on the host (the API's token lookup answered by
tests/envd/cli_api.py): argv passed exactly, both streams, the remote exit status (and
128+N for a signal), piped stdin, user, cwd, env, --shell, --timeout, Ctrl-C killing the
remote command. Through the stack with a VM: tests/integration/test_cli.py."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .cli_api import FakeApi, await_process

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def api():
    fake = FakeApi()
    yield fake
    fake.close()


@pytest.fixture
def aenv(envd, api):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("E2B_", "AENV_"))},
           "E2B_API_URL": api.url, "E2B_SANDBOX_URL": envd.url, "E2B_API_KEY": "k"}

    def run(*argv, input=None, stdin=subprocess.DEVNULL):
        return subprocess.run([sys.executable, "-m", "aenv_cli", *argv], env=env, cwd=ROOT, capture_output=True,
                              input=input, stdin=None if input is not None else stdin, timeout=60)

    run.env = env
    return run


def test_argv_is_passed_exactly_and_the_exit_status_is_the_commands(aenv):
    out = aenv("exec", "sb", "--", "printf", "[%s]\n", "a  b", "$HOME", "it's", "")
    assert out.returncode == 0 and out.stdout == b"[a  b]\n[$HOME]\n[it's]\n[]\n", out.stderr
    out = aenv("exec", "sb", "sh", "-c", "echo out; echo err >&2; exit 7")
    assert (out.returncode, out.stdout, out.stderr) == (7, b"out\n", b"err\n")
    out = aenv("exec", "sb", "ls -la")  # one word, no shell: no such program
    assert out.returncode == 2 and b"ls -la" in out.stderr


def test_shell_user_cwd_env_and_signals(aenv):
    out = aenv("exec", "--shell", "--user", "root", "--cwd", "/tmp", "-e", "X=1 2", "sb", "pwd;", "whoami;",
               "echo", "$X")
    assert out.returncode == 0 and out.stdout == b"/tmp\nroot\n1 2\n", out.stderr
    assert aenv("exec", "sb", "sh", "-c", "kill -9 $$").returncode == 137
    assert aenv("exec", "sb", "sh", "-c", "kill -TERM $$").returncode == 143
    started = time.monotonic()
    out = aenv("exec", "--timeout", "1", "sb", "sleep", "30")  # killed at its deadline
    assert out.returncode == 124 and b"timed out after 1s" in out.stderr
    assert time.monotonic() - started < 15


def test_piped_stdin_reaches_the_command_and_ends(aenv):
    data = b"".join(b"line %d\n" % i for i in range(20000))  # > 64 KiB: several chunks
    out = aenv("exec", "sb", "sh", "-c", "wc -l; exit 3", input=data)
    assert out.returncode == 3 and out.stdout.strip() == b"20000", out.stderr
    out = aenv("exec", "-n", "sb", "cat")  # --no-stdin: cat sees no input at all and ends
    assert out.returncode == 0 and out.stdout == b""


def test_errors_say_what_went_wrong(aenv, envd, api):
    out = aenv("exec", "--cwd", "/does/not/exist", "sb", "true")
    assert out.returncode == 2 and b"aenv: invalid_argument: cwd '/does/not/exist'" in out.stderr
    out = aenv("exec", "--user", "ghost", "sb", "true")
    assert out.returncode == 3 and b"aenv: 401: user 'ghost' not found" in out.stderr
    assert aenv("exec", "nope", "true").returncode == 4
    assert aenv("exec", "sb").returncode == 2
    env = {**aenv.env, "E2B_SANDBOX_URL": "http://127.0.0.1:9"}
    out = subprocess.run([sys.executable, "-m", "aenv_cli", "exec", "sb", "true"], env=env, cwd=ROOT,
                         capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
    assert out.returncode == 6 and b"aenv: cannot reach the sandbox: ConnectError" in out.stderr


def test_ctrl_c_kills_the_remote_command(aenv, envd):
    marker = f"aenv-cli-ctrl-c-{os.getpid()}"
    spelled = f'"{marker[:8]}""{marker[8:]}"'  # the CLI's own command line must not match
    proc = subprocess.Popen([sys.executable, "-m", "aenv_cli", "exec", "sb", "bash", "-c",
                             f"exec -a {spelled} sleep 300"], env=aenv.env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    assert await_process(marker, running=True, timeout=20)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 130 and b"the command was killed" in proc.stderr.read()
    assert await_process(marker, running=False)


def test_the_token_is_sent(envd):
    """A sandbox's envdAccessToken goes with every envd call (checked on the wire here:
    the host envd has no token of its own)."""
    seen = []
    api = FakeApi(token="tok-123")
    transport_env = {**os.environ, "E2B_API_URL": api.url, "E2B_API_KEY": "k"}
    try:
        from aenv_cli.execute import cmd_exec  # noqa: PLC0415
        from aenv_cli.commands import build_parser  # noqa: PLC0415
        from aenv_cli.config import resolve  # noqa: PLC0415
        from envd_client import EnvdClient  # noqa: PLC0415

        real = EnvdClient.through_proxy

        def spy(url, sandbox_id, token=None, **kwargs):
            seen.append(token)
            return real(url, sandbox_id, token, **kwargs)

        args = build_parser().parse_args(["exec", "-n", "sb", "true"])
        config = resolve({"api_url": api.url, "sandbox_url": envd.url, "api_key": "k"}, transport_env)
        EnvdClient.through_proxy = staticmethod(spy)
        try:
            assert cmd_exec(args, config) == 0
        finally:
            EnvdClient.through_proxy = real
    finally:
        api.close()
    assert seen == ["tok-123", "tok-123"]
