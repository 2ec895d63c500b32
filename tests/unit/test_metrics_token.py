"""``AENV_METRICS_TOKEN`` on every Prometheus ``/metrics``: the API's, the data plane's and a
node's answer 401 to a scrape without ``Authorization: Bearer <token>`` or with a wrong one and
200 with the right one; without a token a node's exporter listens on 127.0.0.1 only (read from
the kernel's socket table), whatever its AENV_NODE_ADDRESS; a short token is refused when the
settings load."""
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from django.test import override_settings
from prometheus_client import REGISTRY

from harness.ports import free_port as _free_port

TOKEN = "t0ken-" + "x" * 40
GOOD = {"Authorization": f"Bearer {TOKEN}"}
WRONG = [{}, {"Authorization": "Bearer " + "y" * 46}, {"Authorization": TOKEN}, {"Authorization": f"Basic {TOKEN}"},
         {"Authorization": f"Bearer {TOKEN[:-1]}"}]
ROOT = Path(__file__).resolve().parents[2]


def listening_addresses(port: int) -> set[str]:
    """The IPv4 addresses something listens on at ``port`` (/proc/net/tcp, state 0A)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, port_hex = local.split(":")
        if state == "0A" and int(port_hex, 16) == port:
            found.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    return found


@pytest.fixture
def node_exporter():
    from agent.prometheus import NodeCollector, start_exporter  # noqa: PLC0415

    collectors = []

    def start(address: str, token: str) -> int:
        collector = NodeCollector(f"n{len(collectors)}", lambda: 1, dict)
        collectors.append(collector)
        port = start_exporter(address, _free_port(), collector, token=token)
        assert port
        return port

    yield start
    for collector in collectors:
        REGISTRY.unregister(collector)


# --- a node ------------------------------------------------------------------------------------

def test_node_metrics_need_the_bearer_token(node_exporter):
    url = f"http://127.0.0.1:{node_exporter('127.0.0.1', TOKEN)}/metrics"
    for headers in WRONG:
        resp = httpx.get(url, headers=headers, timeout=5)
        assert resp.status_code == 401 and "aenv_node" not in resp.text, headers
        assert resp.headers["www-authenticate"].startswith("Bearer")
    resp = httpx.get(url, headers=GOOD, timeout=5)
    assert resp.status_code == 200 and "aenv_node_vms" in resp.text


def test_without_a_token_the_node_listens_on_loopback_only(node_exporter):
    port = node_exporter("0.0.0.0", "")  # the node's address asked for: not taken without a token
    assert listening_addresses(port) == {"127.0.0.1"}
    assert httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).status_code == 200


def test_with_a_token_the_node_listens_on_its_address(node_exporter):
    port = node_exporter("0.0.0.0", TOKEN)
    assert listening_addresses(port) == {"0.0.0.0"}
    assert httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).status_code == 401


# --- the API and the data plane --------------------------------------------------------------

@pytest.mark.django_db(transaction=True)
async def test_api_metrics_need_the_bearer_token_when_set(anon):
    with override_settings(AENV_METRICS_TOKEN=TOKEN):
        for headers in WRONG:
            resp = await anon.get("/metrics", headers=headers)
            assert resp.status_code == 401 and "aenv_" not in resp.text, headers
        resp = await anon.get("/metrics", headers=GOOD)
        assert resp.status_code == 200 and "aenv_api_http_requests" in resp.text
    assert (await anon.get("/metrics")).status_code == 200  # no token set: open (aggregates only)


async def test_dataplane_metrics_need_the_bearer_token_when_set():
    from config.prometheus import InstrumentedDataPlane  # noqa: PLC0415
    from dataplane.addressing import parse_target  # noqa: PLC0415

    async def guest(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"guest"})

    app = InstrumentedDataPlane(guest, parse_target)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://dp") as client:
        with override_settings(AENV_METRICS_TOKEN=TOKEN):
            for headers in WRONG:
                resp = await client.get("/metrics", headers=headers)
                assert resp.status_code == 401 and "aenv_" not in resp.text, headers
            assert (await client.head("/metrics")).status_code == 401
            resp = await client.get("/metrics", headers=GOOD)
            assert resp.status_code == 200 and "aenv_dataplane_http_requests" in resp.text
            # a sandbox's own /metrics is the guest's: not ours to guard
            assert (await client.get("/metrics", headers={"E2b-Sandbox-Id": "isb1"})).text == "guest"
        assert (await client.get("/metrics")).status_code == 200


# --- the setting -----------------------------------------------------------------------------

@pytest.mark.parametrize("token,ok", [("short-token", False), ("x" * 31, False), ("x" * 32, True), ("", True)])
def test_a_short_token_is_refused_when_the_settings_load(tmp_path, token, ok):
    env = {**os.environ, "AENV_METRICS_TOKEN": token, "AENV_HOME": str(tmp_path), "DJANGO_SETTINGS_MODULE": "config.settings"}
    done = subprocess.run([sys.executable, "-c", "from django.conf import settings; print(len(settings.AENV_METRICS_TOKEN))"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    if ok:
        assert done.returncode == 0 and done.stdout.strip() == str(len(token)), done.stderr
    else:
        assert done.returncode != 0 and "AENV_METRICS_TOKEN must be at least 32" in done.stderr
