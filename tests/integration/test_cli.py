"""The `aenv` CLI against the real stack: create, exec, list, kill."""
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.vm


def aenv(stack, *args):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("E2B_", "AENV_API"))}, "E2B_API_URL": stack.api_url, "E2B_SANDBOX_URL": stack.sandbox_url,
           "E2B_API_KEY": stack.api_key}
    return subprocess.run([sys.executable, "-m", "aenv_cli", *args], env=env, capture_output=True, text=True,
                          timeout=300)


def test_cli_lifecycle(stack):
    created = aenv(stack, "create", "--metadata", "via=cli")
    assert created.returncode == 0, created.stderr
    sid = created.stdout.strip()
    try:
        out = aenv(stack, "exec", sid, "--", "echo", "from-cli;", "exit", "4")
        assert out.stdout == "from-cli\n"
        assert out.returncode == 4
        assert sid in aenv(stack, "list").stdout
    finally:
        assert aenv(stack, "kill", sid).returncode == 0
    gone = aenv(stack, "kill", sid)
    assert gone.returncode == 1 and "404" in gone.stderr


def test_cli_without_key_explains():
    env = {k: v for k, v in os.environ.items() if k not in ("E2B_API_KEY", "AENV_API_KEY")}
    out = subprocess.run([sys.executable, "-m", "aenv_cli", "list"], env=env, capture_output=True, text=True)
    assert out.returncode == 1 and "E2B_API_KEY" in out.stderr
