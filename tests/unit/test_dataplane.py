"""The data plane as deployed — `python -m dataplane.serve` (uvicorn serving
`config.dataplane_asgi:application`, its hot path beside it) in its own process on the test database — in front of a real envd on the host, driven by the
official e2b SDK (debug mode: no control plane; E2B_SANDBOX_URL = the data plane)."""
import os
import subprocess
import sys
import time
from datetime import timedelta

import httpx
import pytest
from django.db import connection
from django.utils import timezone

from envd import ENVD_PORT
from harness.processes import stop
from sandboxes.models import Sandbox, Team, Template
from tests.envd.conftest import ROOT, EnvdServer, sandbox_user  # noqa: F401 (fixture)
from harness.ports import free_port as _free_port

pytestmark = pytest.mark.django_db(transaction=True)

SANDBOX_ID = "debug_sandbox_id"  # what the SDK sends in debug mode


def _test_database_url() -> str:
    db = connection.settings_dict
    if db["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{db['NAME']}"
    return f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"


@pytest.fixture
def dataplane(tmp_path):
    port = _free_port()
    log = open(tmp_path / "dataplane.log", "wb")
    env = {**os.environ, "DATABASE_URL": _test_database_url(), "AENV_HOME": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "dataplane.serve", "--host", "127.0.0.1", "--port", str(port),
         "--", "--log-level", "warning"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 400:  # up; no routing headers
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"data plane did not start:\n{(tmp_path / 'dataplane.log').read_text()}")
        time.sleep(0.1)
    yield url
    stop(proc)
    log.close()


@pytest.fixture
def envd(sandbox_user):
    server = EnvdServer()
    yield server
    server.stop()


@pytest.fixture
def sandbox_row(envd):
    team = Team.objects.create(name="t", slug="t")
    template = Template.objects.create(id="base")
    return Sandbox.objects.create(id=SANDBOX_ID, team=team, template=template, state="running",
                                  envd_host="127.0.0.1", envd_port=envd.port,
                                  end_at=timezone.now() + timedelta(minutes=5))


@pytest.fixture
def sdk(dataplane, sandbox_row, monkeypatch):
    monkeypatch.setenv("E2B_DEBUG", "true")
    monkeypatch.setenv("E2B_SANDBOX_URL", dataplane)
    from e2b import Sandbox as E2BSandbox

    return E2BSandbox.create()


def test_commands_and_files_through_the_data_plane(sdk):
    result = sdk.commands.run("echo hello; echo oops >&2")
    assert result.exit_code == 0 and result.stdout == "hello\n" and result.stderr == "oops\n"
    payload = os.urandom(512 * 1024)
    sdk.files.write("/tmp/aenv-dataplane.bin", payload)
    assert sdk.files.read("/tmp/aenv-dataplane.bin", format="bytes") == payload
    assert sdk.is_running()


def test_streamed_output_arrives_while_the_command_runs(sdk):
    seen = []
    result = sdk.commands.run("echo first; sleep 1.5; echo second",
                              on_stdout=lambda data: seen.append((time.monotonic(), data)))
    assert result.stdout == "first\nsecond\n", seen
    assert [d for _, d in seen] == ["first\n", "second\n"]
    assert seen[1][0] - seen[0][0] > 1.0  # "first" was delivered before the command ended


def test_killed_sandbox_breaks_the_stream_and_reads_as_not_running(sdk, sandbox_row, envd):
    from e2b.exceptions import TimeoutException

    handle = sdk.commands.run("sleep 60", background=True)
    Sandbox.objects.filter(pk=sandbox_row.pk).update(state="killed")
    envd.stop()  # the VM and its envd are gone
    with pytest.raises(TimeoutException, match="sandbox was killed"):
        handle.wait()
    assert sdk.is_running() is False


def test_unknown_sandbox_is_not_running(dataplane):
    r = httpx.get(dataplane + "/health", headers={"E2b-Sandbox-Id": "inope", "E2b-Sandbox-Port": str(ENVD_PORT)})
    assert r.status_code == 502 and "was not found" in r.json()["message"]
