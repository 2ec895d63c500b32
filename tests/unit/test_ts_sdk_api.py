"""The unchanged TypeScript SDKs (npm ``e2b`` from scripts/setup_ts_sdk.sh, npm
``@e2b/code-interpreter`` from scripts/setup_ts_code_interpreter.sh) for the calls that need no
guest, without a VM: the API served by uvicorn on 127.0.0.1 with a mock node, and Node's test
runner on tests/ts/api/*.test.mjs (network options and updateNetwork, volumes, the E2B client,
ApiClient's teams and team metrics, the code interpreter package) plus tests/ts/secrets.test.mjs.
Node must report passes and no failures or skips; what the node was told is checked here."""
import asyncio
import os
import re
import shutil
import subprocess
from pathlib import Path
from unittest import mock

import httpx
import pytest
from asgiref.sync import sync_to_async
from django.contrib.auth import get_user_model

from sandboxes.models import AccessToken
from tests.unit.asgi_server import served

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
SDK_DIR = ROOT / "var" / "node" / "e2b-ts"
CI_DIR = ROOT / "var" / "node" / "code-interpreter-ts"
FILES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "ts" / "api").glob("*.test.mjs")) + [
    "tests/ts/secrets.test.mjs"]
SUMMARY = re.compile(r"^\s*(?:ℹ|#)\s*(tests|pass|fail|cancelled|skipped|todo)\s+(\d+)\s*$", re.MULTILINE)
NODE_TIMEOUT = 300  # s


@pytest.fixture(scope="module")
def node_bin():
    """Node.js with both SDKs installed (the scripts return at once when they are)."""
    path = shutil.which("node")
    if path is None:
        pytest.skip("node is not installed (scripts/setup_ts_sdk.sh installs it with apt-get)")
    for script, env in (("setup_ts_sdk.sh", {"AENV_TS_SDK_DIR": str(SDK_DIR)}),
                        ("setup_ts_code_interpreter.sh", {"AENV_TS_CODE_INTERPRETER_DIR": str(CI_DIR)})):
        done = subprocess.run([str(ROOT / "scripts" / script)], cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, **env}, timeout=600)
        assert done.returncode == 0, f"scripts/{script} failed:\n{done.stdout}\n{done.stderr}"
    return path


async def test_the_typescript_sdks_without_a_vm(node_bin, asgi_app, base_template, raw_key, team, nodes_mock, settings,
                                                tmp_path):
    settings.AENV_VOLUMES_DIR = tmp_path / "volumes"
    nodes_mock.client.update_network = mock.AsyncMock(return_value={"timings": {"total_ms": 1.0}})
    user = await sync_to_async(get_user_model().objects.create_user)("ts-sdk", password="pw-ts-sdk-12345")
    await sync_to_async(team.members.add)(user)
    _, token = await sync_to_async(AccessToken.generate)(user, "ts")
    async with served(asgi_app) as url:
        async with httpx.AsyncClient(base_url=url, headers={"X-API-Key": raw_key}) as api:
            # one running sandbox for the team metrics of tests/ts/api/teams.test.mjs
            running = (await api.post("/v2/sandboxes", json={"templateID": "base"})).json()["sandboxID"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
        env.update(E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_API_KEY=raw_key, AENV_E2B_TS_DIR=str(SDK_DIR),
                   AENV_CI_TS_DIR=str(CI_DIR), AENV_TEST_TEAM_ID=str(team.pk), AENV_TEST_ACCESS_TOKEN=token,
                   NO_COLOR="1")
        proc = await asyncio.create_subprocess_exec(
            node_bin, "--test", "--test-reporter=spec", "--test-concurrency=1", *FILES, cwd=ROOT, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        try:
            out = (await asyncio.wait_for(proc.communicate(), NODE_TIMEOUT))[0].decode(errors="replace")
        except TimeoutError:
            proc.kill()
            pytest.fail(f"node --test did not finish in {NODE_TIMEOUT} s")
    print(out)
    counts = {k: int(v) for k, v in SUMMARY.findall(out)}
    assert {"pass", "fail"} <= counts.keys(), f"no summary from node --test:\n{out}"
    assert counts["fail"] == 0 and counts.get("cancelled", 0) == 0, out
    assert counts.get("skipped", 0) == 0 and counts.get("todo", 0) == 0, out
    assert counts["pass"] >= 10, out
    assert proc.returncode == 0, out

    # what the mock node was told: the rules with the secret's marker only, the mounts
    boots = [c.kwargs for c in nodes_mock.client.boot_sandbox.await_args_list]
    rules = [b["network"]["rules"] for b in boots if b.get("network") and b["network"].get("rules")]
    assert {"api.example.com": [{"Authorization": "Bearer ${e2b.secrets.tok}"}],
            "*.example.org": [{"X-From": "callback"}]} in rules
    assert any(b.get("volumes") and [v["path"] for v in b["volumes"]] == ["/mnt/a", "/mnt/b"] for b in boots)
    updates = [c.kwargs["network"] for c in nodes_mock.client.update_network.await_args_list]
    assert {"api.example.com": [{"X-Key": "${e2b.secrets.tok}"}]} in [u.get("rules") for u in updates]
    assert running
