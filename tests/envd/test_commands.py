"""commands.* through the official e2b SDK against a host envd."""
import time

import pytest
from e2b import CommandExitException, NotFoundException, TimeoutException
from e2b.exceptions import AuthenticationException, InvalidArgumentException


def test_run_stdout_stderr_exit_zero(sandbox):
    r = sandbox.commands.run("echo hello; echo err >&2; printf 'no newline'")
    assert r.exit_code == 0
    assert r.stdout == "hello\nno newline"
    assert r.stderr == "err\n"
    assert r.error is None


def test_nonzero_exit_raises_with_details(sandbox):
    with pytest.raises(CommandExitException) as exc:
        sandbox.commands.run("echo out; echo bad >&2; exit 3")
    assert exc.value.exit_code == 3
    assert exc.value.stdout == "out\n"
    assert exc.value.stderr == "bad\n"
    assert exc.value.error == "exit status 3"


def test_large_output_is_chunked_and_complete(sandbox):
    r = sandbox.commands.run("head -c 300000 /dev/zero | tr '\\0' 'x'")
    assert len(r.stdout) == 300000 and set(r.stdout) == {"x"}


def test_default_user_home_and_root(sandbox):
    assert sandbox.commands.run("whoami; pwd; echo $HOME $USER $LOGNAME").stdout == \
        "user\n/home/user\n/home/user user user\n"
    assert sandbox.commands.run("whoami; pwd", user="root").stdout == "root\n/root\n"
    assert sandbox.commands.run("id -u", user="user").stdout.strip() != "0"


def test_unknown_user_is_authentication_error(sandbox):
    with pytest.raises(AuthenticationException):
        sandbox.commands.run("true", user="nobody-such")


def test_cwd_absolute_relative_and_missing(sandbox, workdir):
    assert sandbox.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
    name = workdir.rsplit("/", 1)[1]
    assert sandbox.commands.run("pwd", cwd=name).stdout == workdir + "\n"
    with pytest.raises(InvalidArgumentException):
        sandbox.commands.run("pwd", cwd="/definitely/missing")


def test_envs_apply_and_do_not_leak(sandbox):
    assert sandbox.commands.run("echo $FOO", envs={"FOO": "bar"}).stdout == "bar\n"
    assert sandbox.commands.run("echo ${FOO:-unset}").stdout == "unset\n"
    assert sandbox.commands.run("echo $HOME", envs={"HOME": "/override"}).stdout == "/override\n"


def test_background_list_connect_kill(sandbox):
    h = sandbox.commands.run("echo started; sleep 30", background=True)
    pids = [p.pid for p in sandbox.commands.list()]
    assert h.pid in pids
    info = next(p for p in sandbox.commands.list() if p.pid == h.pid)
    assert info.cmd == "/bin/bash" and info.args[-1] == "echo started; sleep 30"
    h2 = sandbox.commands.connect(h.pid)
    assert sandbox.commands.kill(h.pid) is True
    with pytest.raises(CommandExitException) as exc:
        h2.wait()
    assert exc.value.exit_code == -1
    assert exc.value.error == "signal: killed"
    with pytest.raises(CommandExitException):
        h.wait()
    assert h.pid not in [p.pid for p in sandbox.commands.list()]
    assert sandbox.commands.kill(h.pid) is False


def test_disconnect_does_not_kill_and_reconnect_sees_new_output(sandbox):
    h = sandbox.commands.run("sleep 1; echo late", background=True)
    h.disconnect()
    h2 = sandbox.commands.connect(h.pid)
    r = h2.wait()
    assert r.exit_code == 0 and "late" in r.stdout


def test_connect_unknown_pid_not_found(sandbox):
    with pytest.raises(NotFoundException):
        sandbox.commands.connect(999999)
    with pytest.raises(Exception):
        sandbox.commands.send_stdin(999999, "x")


def test_timeout_raises_and_kills_process(sandbox):
    start = time.monotonic()
    with pytest.raises(TimeoutException):
        sandbox.commands.run("sleep 20; echo done", timeout=1)
    assert time.monotonic() - start < 10
    # envd used connect-timeout-ms as the process lifetime: nothing left running.
    time.sleep(0.5)
    assert not [p for p in sandbox.commands.list() if "sleep 20" in " ".join(p.args)]


def test_stdin_send_and_close(sandbox):
    h = sandbox.commands.run("cat", background=True, stdin=True)
    sandbox.commands.send_stdin(h.pid, "hi\n")
    sandbox.commands.send_stdin(h.pid, b"there\n")
    sandbox.commands.close_stdin(h.pid)
    assert h.wait().stdout == "hi\nthere\n"


def test_stdin_false_gets_dev_null(sandbox):
    r = sandbox.commands.run("cat; echo eof")  # SDK sends stdin=false -> /dev/null
    assert r.stdout == "eof\n"


def test_stream_input(sandbox):
    h = sandbox.commands.run("cat", background=True, stdin=True)
    sandbox.commands.stream_input(h.pid, ["a\n", b"b\n", "c" * 70000 + "\n"])
    sandbox.commands.close_stdin(h.pid)
    out = h.wait().stdout
    assert out.startswith("a\nb\nccc") and len(out) == 4 + 70001


def test_stream_input_unknown_pid(sandbox):
    with pytest.raises(NotFoundException):
        sandbox.commands.stream_input(999999, ["x"])


async def test_async_run_and_stream_input_handle(async_sandbox):
    r = await async_sandbox.commands.run("echo async")
    assert r.stdout == "async\n"
    h = await async_sandbox.commands.run("cat", background=True, stdin=True)
    ih = async_sandbox.commands.stream_input(h.pid)
    await ih.send("x\n")
    await ih.send(b"y\n")
    await ih.close()
    await async_sandbox.commands.close_stdin(h.pid)
    assert (await h.wait()).stdout == "x\ny\n"
