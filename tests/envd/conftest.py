"""Run a real envd on the host (subprocess) and point the official e2b SDK at it in debug mode.

Set ``ENVD_TEST_BINARY=/path/to/frozen/envd`` to run the same suite against a
PyInstaller build instead of ``python -m envd``.
"""
import os
import pwd
import subprocess
import sys
import time

import httpx
import pytest

from harness.ports import free_port as _free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class EnvdServer:
    """A running ``python -m envd`` subprocess."""

    def __init__(self, *extra_args):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = f"/tmp/envd-test-{self.port}.log"
        self._log = open(self.log_path, "wb")
        command = [os.environ["ENVD_TEST_BINARY"]] if os.environ.get("ENVD_TEST_BINARY") else [sys.executable, "-m", "envd"]
        self.proc = subprocess.Popen(
            [*command, "--host", "127.0.0.1", "--port", str(self.port),
             "--set-clock", "never", "--credit-entropy", "never", "--log-level", "warning", *extra_args],
            cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"envd exited early:\n{open(self.log_path).read()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 204:
                    return
            except httpx.HTTPError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("envd did not become healthy")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.fixture(scope="session")
def sandbox_user():
    """The guest image's ``user`` account (uid != 0, home /home/user)."""
    if os.geteuid() != 0:
        pytest.skip("envd host tests need root (they run commands as 'user' and 'root')")
    try:
        pw = pwd.getpwnam("user")
    except KeyError:
        subprocess.run(["useradd", "-m", "-s", "/bin/bash", "user"], check=True)
        pw = pwd.getpwnam("user")
    _own_home(pw)
    return pw


def _own_home(pw):
    """The home is the account's own, as in the guest image. ``useradd -m`` leaves a directory
    that is already there as it was (a machine image with a leftover /home/user owned by root:
    every write into the home was then refused), so the fixture makes it so itself."""
    os.makedirs(pw.pw_dir, mode=0o755, exist_ok=True)
    st = os.stat(pw.pw_dir)
    if (st.st_uid, st.st_gid) != (pw.pw_uid, pw.pw_gid):
        os.chown(pw.pw_dir, pw.pw_uid, pw.pw_gid)
    if st.st_mode & 0o700 != 0o700:
        os.chmod(pw.pw_dir, st.st_mode | 0o700)


@pytest.fixture(scope="session")
def envd(sandbox_user):
    server = EnvdServer()
    yield server
    server.stop()


@pytest.fixture
def sdk_env(envd, monkeypatch):
    """Debug mode: Sandbox.create() makes no API call and talks to our envd. Set per
    test, so later suites (the end-to-end ones) never inherit debug mode."""
    monkeypatch.setenv("E2B_DEBUG", "true")
    monkeypatch.setenv("E2B_SANDBOX_URL", envd.url)
    return envd


@pytest.fixture
def sandbox(sdk_env):
    from e2b import Sandbox

    return Sandbox.create()


@pytest.fixture
async def async_sandbox(sdk_env):
    from e2b import AsyncSandbox

    return await AsyncSandbox.create()


@pytest.fixture
def workdir(sandbox_user):
    """A fresh directory under /home/user owned by 'user', removed afterwards."""
    import shutil
    import uuid

    path = os.path.join(sandbox_user.pw_dir, f"t-{uuid.uuid4().hex[:8]}")
    os.mkdir(path)
    os.chown(path, sandbox_user.pw_uid, sandbox_user.pw_gid)
    yield path
    shutil.rmtree(path, ignore_errors=True)
