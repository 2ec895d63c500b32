"""``aenv exec`` (on envd_client) against a real envd on the host: the API lookup of the
sandbox's token is faked, the envd side is real. Through the stack: tests/integration/test_cli.py."""
from unittest import mock

import httpx
import pytest

from aenv_cli import main as cli


@pytest.fixture
def exec_cli(envd):
    def run(*argv, token=None):
        info = httpx.Response(200, json={"sandboxID": "sb1", "envdAccessToken": token},
                              request=httpx.Request("GET", "http://api/sandboxes/sb1"))
        with mock.patch.object(cli.httpx, "get", return_value=info), \
                mock.patch.object(cli, "_config", return_value=("http://api", envd.url, "key")):
            return cli.main(["exec", *argv])

    return run


def test_exec_streams_both_outputs_and_returns_the_exit_code(exec_cli, capfdbinary):
    assert exec_cli("sb1", "--", "echo", "out;", "echo", "err", ">&2;", "exit", "4") == 4
    out, err = capfdbinary.readouterr()
    assert (out, err) == (b"out\n", b"err\n")


def test_exec_as_user_in_cwd(exec_cli, capfdbinary):
    assert exec_cli("--user", "root", "--cwd", "/tmp", "sb1", "pwd;", "whoami") == 0
    assert capfdbinary.readouterr().out == b"/tmp\nroot\n"
    assert exec_cli("sb1", "kill -9 $$") == 128  # killed by a signal


def test_exec_errors_are_reported(exec_cli, capfd):
    assert exec_cli("--cwd", "/does/not/exist", "sb1", "true") == 1
    assert "aenv: invalid_argument: cwd '/does/not/exist'" in capfd.readouterr().err
    assert exec_cli("--user", "ghost", "sb1", "true") == 1
    assert "aenv: 401: user 'ghost' not found" in capfd.readouterr().err


def test_exec_without_envd_says_so(capfd):
    info = httpx.Response(200, json={"sandboxID": "sb1"}, request=httpx.Request("GET", "http://api/sandboxes/sb1"))
    with mock.patch.object(cli.httpx, "get", return_value=info), \
            mock.patch.object(cli, "_config", return_value=("http://api", "http://127.0.0.1:9", "key")):
        assert cli.main(["exec", "sb1", "true"]) == 1
    assert "aenv: cannot reach the sandbox: ConnectError" in capfd.readouterr().err
