"""``aenv auth`` against the real API on a port: the key is checked before it is stored,
the stored file then serves every command, ``status`` says what is in force and where
it comes from, ``logout`` forgets it; asked for on a terminal (pexpect), the key is not
echoed. Each ``aenv`` runs as a subprocess with a config dir of its own."""
import asyncio
import io
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pexpect
import pytest

from tests.unit.test_template_builds_sdk import server  # noqa: F401 - fixture

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]
ROOT = Path(__file__).resolve().parents[2]
NAMES = ("AENV_API_URL", "AENV_API_KEY", "AENV_SANDBOX_URL", "E2B_API_URL", "E2B_API_KEY", "E2B_SANDBOX_URL")


@pytest.fixture
def env(tmp_path):
    clean = {k: v for k, v in os.environ.items() if k not in NAMES}
    return {**clean, "XDG_CONFIG_HOME": str(tmp_path / "xdg")}


def aenv(env, *argv, input=None):
    return asyncio.to_thread(subprocess.run, [sys.executable, "-m", "aenv_cli", *argv], capture_output=True,
                             text=True, cwd=ROOT, env=env, input=input, timeout=60)


async def test_auth_checks_stores_and_serves_every_command(server, raw_key, env, tmp_path):  # noqa: F811
    path = tmp_path / "xdg" / "aenv" / "credentials"
    wrong = await aenv(env, "auth", "--url", server, "--api-key", "e2b_" + "0" * 40)
    assert wrong.returncode == 3 and "authentication failed (401)" in wrong.stderr and not path.exists()
    gone = await aenv(env, "auth", "--url", "http://127.0.0.1:9", "--api-key-stdin", input="k\n")
    assert gone.returncode == 6 and "--no-verify" in gone.stderr and not path.exists()
    empty = await aenv(env, "auth", "--url", server, "--api-key-stdin", input="\n")
    assert empty.returncode == 2 and "cannot be empty" in empty.stderr

    saved = await aenv(env, "auth", "--url", server + "/", "--api-key-stdin", input=raw_key + "\n")
    assert saved.returncode == 0 and saved.stdout == f"Credentials saved to {path}\n", saved.stderr
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    # The data plane defaults to the API's own URL (the test API is not on port 3000).
    assert path.read_text() == f'url = "{server}"\nsandbox_url = "{server}"\napi_key = "{raw_key}"\n'
    listed = await aenv(env, "ls")  # no variables: the file
    assert listed.returncode == 0 and json.loads(listed.stdout) == [], listed.stderr

    status = await aenv(env, "auth", "status", "-o", "json")
    report = json.loads(status.stdout)
    assert status.returncode == 0, status.stderr
    assert report["sources"] == {"api_url": "file", "sandbox_url": "file", "api_key": "file"}
    assert report["apiUrl"] == server and report["api"].startswith("ok (") and raw_key not in status.stdout
    overridden = await aenv({**env, "E2B_API_KEY": "e2b_" + "1" * 40}, "auth", "status")
    assert overridden.returncode == 3 and "(E2B_API_KEY)" in overridden.stdout
    warned = await aenv({**env, "E2B_SANDBOX_URL": "http://x"}, "auth", "--url", server, "--api-key", raw_key)
    assert warned.returncode == 0 and "the environment overrides the file for: sandbox_url (E2B_SANDBOX_URL)" in \
        warned.stderr

    out = await aenv(env, "auth", "logout")
    assert out.stdout == f"Removed {path}\n" and not path.exists()
    assert (await aenv(env, "ls")).returncode == 3


async def test_auth_asks_on_a_terminal_without_echoing_the_key(server, raw_key, env, tmp_path):  # noqa: F811
    def interact():
        child = pexpect.spawn(sys.executable, ["-m", "aenv_cli", "auth"], cwd=str(ROOT), env=env, timeout=30,
                              encoding="utf-8")
        child.logfile_read = transcript = io.StringIO()  # all the terminal showed
        child.expect_exact("aenv API URL [http://127.0.0.1:3000]: ")
        child.sendline(server)
        child.expect_exact(f"Data plane URL [{server}]: ")
        child.sendline("")
        child.expect_exact("API key: ")
        child.sendline(raw_key)
        child.expect_exact("Credentials saved to ")
        child.expect(pexpect.EOF)
        child.close()
        return child.exitstatus, transcript.getvalue()

    status, shown = await asyncio.to_thread(interact)
    assert status == 0 and server in shown and raw_key not in shown
    stored = (tmp_path / "xdg" / "aenv" / "credentials").read_text()
    assert f'api_key = "{raw_key}"' in stored and f'url = "{server}"' in stored
