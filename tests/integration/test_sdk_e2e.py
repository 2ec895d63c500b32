"""End to end with real VMs: the unchanged official E2B SDK (newest 2.x, in process)
drives daphne + the node worker + QEMU microVMs through the data plane."""
import json
import os
import platform
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from e2b import CommandExitException, Sandbox, SandboxQuery
from e2b.exceptions import (
    FileNotFoundException,
    NotFoundException,
    SandboxException,
    TimeoutException,
)

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def sandbox(stack):
    """One sandbox shared by the module's read-mostly tests (cold boots are slow under TCG)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("E2B_API_URL", stack.api_url)
        mp.setenv("E2B_SANDBOX_URL", stack.sandbox_url)
        mp.setenv("E2B_API_KEY", stack.api_key)
        mp.delenv("E2B_DEBUG", raising=False)
        sbx = Sandbox.create(metadata={"suite": "e2e"}, envs={"SANDBOX_WIDE": "from-create"})
        yield sbx
        sbx.kill()


def test_runs_in_the_guest_kernel(sandbox):
    out = sandbox.commands.run("uname -r; head -1 /etc/os-release")
    kernel, os_release = out.stdout.strip().splitlines()
    assert kernel != platform.release(), "command ran on the host, not in the guest"
    assert "cloud-amd64" in kernel
    assert "Debian GNU/Linux 12" in os_release
    assert out.exit_code == 0


def test_stdout_stderr_and_exit_code(sandbox):
    ok = sandbox.commands.run("echo out; echo err >&2")
    assert (ok.stdout, ok.stderr, ok.exit_code) == ("out\n", "err\n", 0)
    with pytest.raises(CommandExitException) as exc:
        sandbox.commands.run("echo partial; exit 7")
    assert exc.value.exit_code == 7
    assert exc.value.stdout == "partial\n"


def test_envs_cwd_and_user(sandbox):
    out = sandbox.commands.run("echo $SANDBOX_WIDE $ONLY_HERE; pwd; whoami", envs={"ONLY_HERE": "x1"}, cwd="/tmp")
    assert out.stdout.splitlines() == ["from-create x1", "/tmp", "user"]
    # request envs do not leak into later commands
    assert sandbox.commands.run("echo -n ${ONLY_HERE:-unset}").stdout == "unset"
    assert sandbox.commands.run("whoami; echo $HOME", user="root").stdout.split() == ["root", "/root"]
    assert sandbox.commands.run("pwd").stdout.strip() == "/home/user"


def test_background_command_and_kill(sandbox):
    handle = sandbox.commands.run("sleep 300", background=True)
    assert handle.pid in [p.pid for p in sandbox.commands.list()]
    assert sandbox.commands.kill(handle.pid) is True
    with pytest.raises(CommandExitException):
        handle.wait()
    assert handle.pid not in [p.pid for p in sandbox.commands.list()]
    assert sandbox.commands.kill(handle.pid) is False


def test_command_timeout(sandbox):
    started = time.monotonic()
    with pytest.raises(TimeoutException):
        sandbox.commands.run("sleep 30", timeout=2)
    assert time.monotonic() - started < 20


def test_stdin_send_and_stream(sandbox):
    handle = sandbox.commands.run("head -n 2", background=True, stdin=True)
    sandbox.commands.send_stdin(handle.pid, "first\n")
    sandbox.commands.send_stdin(handle.pid, "second\n")
    assert handle.wait().stdout == "first\nsecond\n"

    handle = sandbox.commands.run("head -n 3", background=True, stdin=True)
    sandbox.commands.stream_input(handle.pid, iter(["a\n", "b\n", b"c\n"]))
    assert handle.wait().stdout == "a\nb\nc\n"


def test_files_roundtrip(sandbox):
    info = sandbox.files.write("/home/user/hello.txt", "hi")
    assert info.path == "/home/user/hello.txt"
    assert sandbox.files.read("/home/user/hello.txt") == "hi"
    assert "hello.txt" in [e.name for e in sandbox.files.list("/home/user")]
    entry = sandbox.files.get_info("/home/user/hello.txt")
    assert (entry.owner, entry.size) == ("user", 2)

    assert sandbox.files.make_dir("/home/user/d1/d2") is True
    assert sandbox.files.make_dir("/home/user/d1/d2") is False
    sandbox.files.write("d1/d2/nested.bin", b"\x00\x01\x02")
    assert sandbox.files.read("/home/user/d1/d2/nested.bin", format="bytes") == b"\x00\x01\x02"
    names = [e.path for e in sandbox.files.list("/home/user/d1", depth=2)]
    assert names == ["/home/user/d1/d2", "/home/user/d1/d2/nested.bin"]
    assert sandbox.files.exists("/home/user/d1/d2/nested.bin")
    sandbox.files.remove("/home/user/d1")
    assert not sandbox.files.exists("/home/user/d1")
    # the file written through /files is visible to commands in the guest
    assert sandbox.commands.run("cat /home/user/hello.txt").stdout == "hi"


def test_large_file_streams_through_the_data_plane(sandbox, tmp_path):
    payload = os.urandom(8 * 1024 * 1024)
    sandbox.files.write("/tmp/big.bin", payload)
    assert sandbox.commands.run("stat -c %s /tmp/big.bin").stdout.strip() == str(len(payload))
    assert sandbox.files.read("/tmp/big.bin", format="bytes") == payload


def test_missing_file_and_pid(sandbox):
    with pytest.raises(FileNotFoundException):
        sandbox.files.read("/home/user/does-not-exist")
    with pytest.raises(NotFoundException):
        sandbox.commands.connect(999999)


def test_list_and_get_info(sandbox, stack):
    listed = Sandbox.list(query=SandboxQuery(metadata={"suite": "e2e"})).next_items()
    assert sandbox.sandbox_id in [s.sandbox_id for s in listed]
    info = sandbox.get_info()
    assert info.metadata == {"suite": "e2e"}
    assert info.template_id == "base"
    assert sandbox.is_running()


def test_kill_stops_vm_and_leaves_nothing(stack, sdk_env):
    sbx = Sandbox.create()
    assert sbx.commands.run("echo alive").stdout == "alive\n"
    handle = sbx.commands.run("sleep 120", background=True)
    before = stack.vm_leftovers()
    assert sbx.sandbox_id in before["state_dirs"]
    assert sbx.kill() is True
    assert sbx.is_running() is False
    with pytest.raises(SandboxException) as exc:
        handle.wait()
    assert "killed" in str(exc.value) or "not found" in str(exc.value).lower()
    with pytest.raises(SandboxException):
        sbx.commands.run("echo too late")
    after = stack.vm_leftovers()
    assert sbx.sandbox_id not in after["state_dirs"]
    assert Sandbox.kill(sbx.sandbox_id) is False
    assert not list(Path("/dev/shm").glob(f"*{sbx.sandbox_id}*"))


@pytest.mark.slow
def test_twelve_concurrent_creates(stack, sdk_env):
    """Twelve creates at once are all in flight together (async waits in the API)."""
    def create_and_run(i):
        t0 = time.monotonic()
        # Twelve cold boots share two cores under TCG: allow more than the SDK's 60 s default.
        sbx = Sandbox.create(metadata={"batch": "twelve", "i": str(i)}, timeout=600, request_timeout=600)
        created = time.monotonic() - t0
        out = sbx.commands.run(f"echo {i}").stdout.strip()
        return sbx, created, out

    t0 = time.monotonic()
    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(create_and_run, range(12)))
    wall = time.monotonic() - t0
    try:
        assert [r[2] for r in results] == [str(i) for i in range(12)]
        assert len({r[0].sandbox_id for r in results}) == 12
        slowest = max(r[1] for r in results)
        # Serialised creates would take the sum of boot times; concurrent ones about the slowest.
        assert wall < slowest * 1.5 + 10, (wall, [round(r[1], 1) for r in results])
        assert sum(r[1] for r in results) > wall * 2
    finally:
        for sbx, _, _ in results:
            sbx.kill()
    assert all(r[0].sandbox_id not in stack.vm_leftovers()["state_dirs"] for r in results)


def test_old_sdk_generation(stack):
    """SDK 2.45.1 (v1 POST /sandboxes, client-side key format check) in its own venv."""
    python = os.environ.get("AENV_OLD_SDK_PYTHON")
    if not python:
        pytest.skip("AENV_OLD_SDK_PYTHON not set: scripts/test.sh installs e2b==2.45.1 and sets it")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("E2B_")},
           "E2B_API_URL": stack.api_url, "E2B_SANDBOX_URL": stack.sandbox_url, "E2B_API_KEY": stack.api_key}
    out = subprocess.run([python, str(Path(__file__).with_name("old_sdk_flow.py"))], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["version"] == "2.45.1"
    assert result["stdout"] == "hello from 2.45\n"
    assert result["read"] == "hi"
    assert result["listed"] is True
    assert result["exit_code"] == 3
    assert result["killed"] is True and result["running_after_kill"] is False
