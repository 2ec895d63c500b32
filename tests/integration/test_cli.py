"""The `aenv` CLI end to end against the real stack (API, data plane, node, QEMU VMs),
every command as a user runs it (a subprocess; `connect` and an attached `start` on a
pseudo-terminal through pexpect). One sandbox, `sb`, is shared by the module; the few
others (a batch for `rm --all` and pagination, a snapshot's, fork children, an attached
`start --rm`) are killed by the tests that make them."""
import json
import os
import re
import subprocess
import sys
import time
import uuid
from datetime import datetime, timezone

import pexpect
import pytest

from tests.envd.cli_api import Relay

from harness.stack import ROOT

pytestmark = pytest.mark.vm
RUN = uuid.uuid4().hex[:6]  # this module's sandboxes carry metadata cli=RUN
PROMPT = "PROMPT> "
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _env(stack, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("E2B_", "AENV_API", "AENV_SANDBOX"))}
    return {**env, "E2B_API_URL": stack.api_url, "E2B_SANDBOX_URL": stack.sandbox_url, "E2B_API_KEY": stack.api_key,
            "XDG_CONFIG_HOME": str(stack.home / "cli-config"), **extra}


def aenv(stack, *args, input=None, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "aenv_cli", *args], env=env or _env(stack), capture_output=True,
                          text=True, timeout=timeout, input=input, stdin=None if input is not None else subprocess.DEVNULL,
                          cwd=ROOT)


def ok(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 0, (out.returncode, out.stdout[-2000:], out.stderr[-2000:])
    return out.stdout


def listed(stack, *filters) -> list[dict]:
    return json.loads(ok(aenv(stack, "ls", *filters)))


@pytest.fixture(scope="module")
def sb(stack):
    """The module's sandbox (started detached, as a script would)."""
    sid = ok(aenv(stack, "start", "-d", "-m", f"cli={RUN}", "-m", "role=main", "--timeout", "1800")).strip()
    assert re.fullmatch(r"[a-z0-9]+", sid), sid
    yield sid
    aenv(stack, "rm", sid)


def test_start_ls_info_timeout(stack, sb):
    rows = listed(stack, "-m", f"cli={RUN}", "-m", "role=main")
    assert [(r["sandboxID"], r["state"], r["metadata"]["role"]) for r in rows] == [(sb, "running", "main")]
    info = json.loads(ok(aenv(stack, "info", sb)))
    assert info["sandboxID"] == sb and info["templateID"] == "base"
    assert ok(aenv(stack, "timeout", sb, "1200")) == f"Timeout for {sb} set to 1200s\n"
    end = datetime.fromisoformat(json.loads(ok(aenv(stack, "info", sb)))["endAt"].replace("Z", "+00:00"))
    assert 1100 < (end - datetime.now(timezone.utc)).total_seconds() <= 1200
    assert aenv(stack, "info", "nosuchsandbox").returncode == 4


def test_exec_argv_streams_stdin_and_status(stack, sb):
    out = aenv(stack, "exec", sb, "--", "printf", "[%s]\n", "a  b", "$HOME", "")
    assert (out.returncode, out.stdout) == (0, "[a  b]\n[$HOME]\n[]\n"), out.stderr
    out = aenv(stack, "exec", sb, "sh", "-c", "echo out; echo err >&2; exit 7")
    assert (out.returncode, out.stdout, out.stderr) == (7, "out\n", "err\n")
    assert aenv(stack, "exec", sb, "sh", "-c", "kill -9 $$").returncode == 137
    out = aenv(stack, "exec", sb, "--", "sha256sum", input="x" * 200_000)
    assert out.returncode == 0 and out.stdout.split()[0] == \
        subprocess.run(["sha256sum"], input="x" * 200_000, capture_output=True, text=True).stdout.split()[0]
    out = aenv(stack, "exec", "--shell", "--user", "root", "--cwd", "/tmp", sb, "echo $(whoami) $(pwd)")
    assert out.stdout == "root /tmp\n"


def test_upload_and_download_a_directory(stack, sb, tmp_path):
    src = tmp_path / "proj"
    (src / "sub" / "deep").mkdir(parents=True)
    (src / "empty").mkdir()
    files = {"a.txt": b"alpha\n", "sub/b.bin": os.urandom(1_500_000), "sub/deep/.c": b"", "sub/deep/d": b"d" * 10}
    for rel, data in files.items():
        (src / rel).write_bytes(data)
    out = ok(aenv(stack, "upload", sb, str(src), "/home/user/up/"))
    assert out.startswith(f"Uploaded directory {src} to {sb}:/home/user/up/proj (4 files, ")
    listing = ok(aenv(stack, "exec", sb, "--", "sh", "-c", "cd /home/user/up/proj && find . | sort && sha256sum sub/b.bin"))
    assert listing.split()[:9] == [".", "./a.txt", "./empty", "./sub", "./sub/b.bin", "./sub/deep", "./sub/deep/.c",
                                   "./sub/deep/d", subprocess.run(["sha256sum", src / "sub/b.bin"], capture_output=True,
                                                                  text=True).stdout.split()[0]]
    down = tmp_path / "down"
    down.mkdir()
    ok(aenv(stack, "download", sb, "/home/user/up/proj", str(down)))
    got = {p.relative_to(down / "proj").as_posix(): p.read_bytes() for p in (down / "proj").rglob("*") if p.is_file()}
    assert got == files and (down / "proj" / "empty").is_dir()
    again = aenv(stack, "download", sb, "/home/user/up/proj/a.txt", str(down / "proj"))
    assert again.returncode == 5 and "--force" in again.stderr


def _shell(stack, argv, env, rows=30, cols=100):
    child = pexpect.spawn(sys.executable, ["-m", "aenv_cli", *argv], cwd=str(ROOT), env=env, dimensions=(rows, cols),
                          timeout=120, encoding="utf-8", codec_errors="replace")
    child.expect(r"[$#] ")
    child.sendline(f"export PS1='{PROMPT}'")
    child.expect_exact(PROMPT)
    return child


def _run(child, command: str) -> str:
    child.sendline(command)
    child.expect_exact(command)
    child.expect_exact(PROMPT)
    return ANSI.sub("", child.before).strip()


def test_connect_is_an_interactive_shell_that_resizes_reconnects_and_exits_with_its_status(stack, sb):
    relay = Relay(int(stack.sandbox_url.rsplit(":", 1)[1]))  # between the CLI and the data plane
    child = _shell(stack, ["connect", sb], _env(stack, E2B_SANDBOX_URL=relay.url, TERM="xterm-ghostty"))
    try:
        assert _run(child, "stty size") == "30 100"
        assert _run(child, "echo $TERM $(whoami)") == "xterm-256color user"
        child.setwinsize(45, 132)
        deadline, size = time.monotonic() + 20, ""
        while size != "45 132" and time.monotonic() < deadline:
            size = _run(child, "stty size")
        assert size == "45 132"
        child.sendline("sleep 300")
        time.sleep(2)
        child.sendcontrol("c")
        child.expect_exact(PROMPT, timeout=30)
        assert _run(child, "export KEPT=yes; echo $KEPT") == "yes"
        relay.cut()  # the connections to the data plane break, as on its restart
        time.sleep(1)
        assert _run(child, "echo $KEPT again") == "yes again"  # the same shell
        child.sendline("exit 3")
        child.expect(pexpect.EOF)
    finally:
        child.close()
        relay.close()
    assert child.exitstatus == 3


def test_an_attached_start_with_rm_kills_its_sandbox_when_the_shell_ends(stack):
    child = _shell(stack, ["start", "--rm", "-m", f"cli={RUN}", "-m", "role=attached"], _env(stack))
    try:
        assert _run(child, "echo inside") == "inside"
        child.sendline("exit")
        child.expect_exact("Killed sandbox")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
    assert listed(stack, "-m", f"cli={RUN}", "-m", "role=attached") == []


def test_pause_then_resume_keeps_memory_and_processes(stack, sb):
    ok(aenv(stack, "exec", sb, "--", "sh", "-c", "echo 4242 > /tmp/mark; nohup sleep 100000 >/dev/null 2>&1 &"))
    assert ok(aenv(stack, "pause", sb)) == f"Paused {sb}\n"
    assert [r["sandboxID"] for r in listed(stack, "-s", "paused", "-m", f"cli={RUN}")] == [sb]
    assert aenv(stack, "pause", sb).returncode == 5
    assert ok(aenv(stack, "resume", sb, "--timeout", "1800")) == f"Resumed {sb}\n"
    out = ok(aenv(stack, "exec", sb, "--", "sh", "-c", "cat /tmp/mark; pgrep -x sleep >/dev/null && echo alive"))
    assert out == "4242\nalive\n"


def test_snapshot_create_ls_start_rm(stack, sb):
    ok(aenv(stack, "exec", sb, "--", "sh", "-c", "echo snap-content > /home/user/snapfile"))
    name = f"cli-snap-{RUN}"
    snap = ok(aenv(stack, "snapshot", "create", sb, "--name", name)).strip()
    rows = json.loads(ok(aenv(stack, "snapshot", "ls", "--sandbox", sb)))
    assert [(r["snapshotID"], r["names"]) for r in rows] == [(snap, [name])]
    child = ok(aenv(stack, "start", "-d", name, "-m", f"cli={RUN}", "-m", "role=from-snapshot")).strip()
    try:
        assert ok(aenv(stack, "exec", child, "cat", "/home/user/snapfile")) == "snap-content\n"
    finally:
        ok(aenv(stack, "rm", child))
    assert ok(aenv(stack, "snapshot", "rm", snap)) == f"Deleted snapshot {snap}\n"
    assert json.loads(ok(aenv(stack, "snapshot", "ls", "--sandbox", sb))) == []


def test_fork_ls_pages_and_rm_all_with_a_filter(stack, sb):
    ok(aenv(stack, "exec", sb, "--", "sh", "-c", "echo parent-state > /home/user/forkfile"))
    kids = ok(aenv(stack, "fork", sb, "-n", "2", "--timeout", "600")).split()
    assert len(kids) == 2 and sb not in kids
    for kid in kids:
        assert ok(aenv(stack, "exec", kid, "cat", "/home/user/forkfile")) == "parent-state\n"
    batch = [ok(aenv(stack, "create", "-m", f"cli={RUN}", "-m", "role=batch")).strip() for _ in range(2)]
    # Five sandboxes of this run, one a page: ls follows the pages to the end.
    every = listed(stack, "-m", f"cli={RUN}", "--limit", "1")
    assert sorted(r["sandboxID"] for r in every) == sorted([sb, *kids, *batch])
    out = ok(aenv(stack, "rm", "--all", "-m", f"cli={RUN}", "-m", "role=batch"))
    assert sorted(out.split()) == sorted(["Killed"] * 2 + batch)
    assert ok(aenv(stack, "kill", *kids)) == "".join(f"Killed {kid}\n" for kid in kids)
    assert [r["sandboxID"] for r in listed(stack, "-m", f"cli={RUN}")] == [sb]  # the filter spared it


def test_metrics_logs_and_nodes(stack):
    sid = ok(aenv(stack, "start", "-d", "-m", f"cli={RUN}", "-m", "role=observe")).strip()
    try:
        deadline, samples = time.monotonic() + 90, []
        while not samples and time.monotonic() < deadline:
            samples = json.loads(ok(aenv(stack, "metrics", sid)))
            time.sleep(2)
        assert samples and samples[0]["memTotal"] > 0 and samples[0]["cpuCount"] == 2
        ok(aenv(stack, "exec", sid, "true"))  # something for envd to log
        logs = aenv(stack, "logs", sid, "-o", "json")
        if logs.returncode == 0:
            entries = [json.loads(line) for line in logs.stdout.splitlines()]
            assert all(set(e) == {"timestamp", "level", "message", "fields"} for e in entries), entries[:3]
        else:  # a server from before the logs endpoints: said so, not a crash
            assert logs.returncode == 4 and "does not serve sandbox logs" in logs.stderr, logs.stderr
    finally:
        ok(aenv(stack, "rm", sid))
    nodes = json.loads(ok(aenv(stack, "nodes")))
    assert [(n["id"], n["status"]) for n in nodes if n["id"] == stack.node_id] == [(stack.node_id, "ready")]


def test_auth_stores_what_every_command_then_uses(stack, tmp_path):
    env = {**_env(stack), "XDG_CONFIG_HOME": str(tmp_path)}
    for name in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY"):
        env.pop(name)
    saved = aenv(stack, "auth", "--url", stack.api_url, "--sandbox-url", stack.sandbox_url, "--api-key-stdin",
                 input=stack.api_key + "\n", env=env)
    assert saved.returncode == 0 and (tmp_path / "aenv" / "credentials").is_file(), saved.stderr
    assert aenv(stack, "ls", env=env).returncode == 0
    wrong = aenv(stack, "auth", "--url", stack.api_url, "--api-key", "e2b_" + "0" * 40, env=env)
    assert wrong.returncode == 3


def test_cli_without_key_explains():
    env = {k: v for k, v in os.environ.items() if k not in ("E2B_API_KEY", "AENV_API_KEY")}
    env["XDG_CONFIG_HOME"] = "/nonexistent"
    out = subprocess.run([sys.executable, "-m", "aenv_cli", "list"], env=env, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 3 and "E2B_API_KEY" in out.stderr

