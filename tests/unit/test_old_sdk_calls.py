"""The pre-2.51 Python SDK generation (e2b 2.45.1, its own venv: ``AENV_OLD_SDK_PYTHON``, which
scripts/test.sh installs and sets) against the real API under uvicorn, no VM: its ``Secret``,
``Volume`` and content methods, and the v1 create (``POST /sandboxes``) with network rules,
``allow_public_traffic`` and volume mounts, ``update_network`` (instance and class) and
``get_info``. tests/unit/old_sdk_calls.py makes the calls; this test judges what it printed
and what the (mock) node was told."""
import asyncio
import json
import os
from pathlib import Path
from unittest import mock

import pytest

from tests.unit.asgi_server import served

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("old_sdk_calls.py")


def old_python() -> str:
    python = os.environ.get("AENV_OLD_SDK_PYTHON") or str(ROOT / "var" / "venvs" / "e2b-2.45.1" / "bin" / "python")
    if not Path(python).exists():
        pytest.skip("AENV_OLD_SDK_PYTHON not set: scripts/test.sh installs e2b==2.45.1 and sets it")
    return python


async def test_the_old_generations_calls(asgi_app, base_template, raw_key, nodes_mock, settings, tmp_path):
    python = old_python()
    settings.AENV_VOLUMES_DIR = tmp_path / "volumes"
    nodes_mock.client.update_network = mock.AsyncMock(return_value={"timings": {"total_ms": 1.0}})
    async with served(asgi_app) as url:
        env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
        env.update(E2B_API_URL=url, E2B_VOLUME_API_URL=url, E2B_API_KEY=raw_key)
        proc = await asyncio.create_subprocess_exec(python, str(SCRIPT), env=env, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
        stdout, stderr = await asyncio.wait_for(proc.communicate(), 150)
    assert proc.returncode == 0, stderr.decode()
    out = json.loads(stdout.decode().strip().splitlines()[-1])
    assert out["version"] == "2.45.1"
    assert out["secret"] == ["old-sdk", 1, 2, True]
    assert out["secret_listed"] == ["old-sdk"]
    assert out["fill"] == "${e2b.secrets.old-sdk}"
    assert out["secret_destroyed"] == [True, False] and out["secret_gone"] is True
    assert out["volume"] == ["from 2.45", True, 0o640, ["/dir", "/dir/f.txt"], "old-sdk-vol", ["old-sdk-vol"]]
    assert out["volume_path_gone"] is True

    marker = "Bearer ${e2b.secrets.tok}"
    assert out["created"] == {
        "network": {"allow_out": ["api.example.com"], "deny_out": ["0.0.0.0/0"], "allow_public_traffic": False,
                    "mask_request_host": "${PORT}-old.example", "rules": {"api.example.com": [{"transform": {"headers": {"Authorization": marker}}}]}},
        "volume_mounts": [{"name": "old-sdk-vol", "path": "/home/user/v"}],
        "allow_internet_access": True, "traffic_token": True}
    boot = nodes_mock.client.boot_sandbox.await_args.kwargs
    assert boot["network"]["rules"] == {"api.example.com": [{"Authorization": marker}]}
    assert [v["path"] for v in boot["volumes"]] == ["/home/user/v"]
    told = [c.kwargs["network"] for c in nodes_mock.client.update_network.await_args_list]
    assert [(t["allow_out"], t["deny_out"]) for t in told] == [([], ["8.8.8.8/32"]), (["1.1.1.1/32"], ["0.0.0.0/0"])]
    assert out["updated"] == {"allow_out": ["1.1.1.1"], "allow_public_traffic": False,
                              "mask_request_host": "${PORT}-old.example"}
    assert out["killed"] is True and out["volume_destroyed"] is True
