"""Nodes and metrics against the real stack (real VM): the official SDK's
``sandbox.get_metrics()`` reads the guest's CPU, memory and disk that the node sampled from
its envd; ``GET /nodes`` shows the node with the sandbox's reservation and its host; the
Prometheus endpoints of the API, the data plane and the node parse, and a create, a command,
a pause and a kill move their counters; all three want the stack's AENV_METRICS_TOKEN (401
without it). A pause stops the sandbox's sampling."""
import time
from datetime import datetime, timedelta, timezone

import httpx
import pytest
from e2b import Sandbox
from prometheus_client.parser import text_string_to_metric_families

from .conftest import METRICS_TOKEN

pytestmark = pytest.mark.vm

MIB = 2**20


@pytest.fixture(scope="module")
def metrics_stack(node_kill_stack):
    """The conftest's second stack: its node's /metrics on a port of its own, samples every
    second, AENV_METRICS_TOKEN (settings the session's stack must not have)."""
    s = node_kill_stack
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("E2B_API_URL", s.api_url)
        mp.setenv("E2B_SANDBOX_URL", s.sandbox_url)
        mp.setenv("E2B_API_KEY", s.api_key)
        mp.delenv("E2B_DEBUG", raising=False)
        yield s


def scrape(url: str) -> dict:
    assert httpx.get(url, timeout=10).status_code == 401  # no token, no metrics
    resp = httpx.get(url, headers={"Authorization": f"Bearer {METRICS_TOKEN}"}, timeout=10)
    assert resp.status_code == 200, resp.text
    out = {}
    for family in text_string_to_metric_families(resp.text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_for_metrics(sandbox, deadline_s: float = 30) -> list:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        found = sandbox.get_metrics()
        if found:
            return found
        time.sleep(0.5)
    raise AssertionError(f"no metrics for {sandbox.sandbox_id} within {deadline_s} s")


def test_metrics_nodes_and_prometheus_end_to_end(metrics_stack):
    s = metrics_stack
    node_before = scrape(s.node_metrics_url)
    sandbox = Sandbox.create()
    try:
        # -- the SDK reads the guest's own figures, sampled by the node
        first = wait_for_metrics(sandbox)[0]
        assert first.cpu_count == 2  # base: 2 vCPU / 512 MiB / 2048 MiB disk
        assert 256 * MIB < first.mem_total <= 512 * MIB and 0 < first.mem_used < first.mem_total
        assert 1024 * MIB < first.disk_total <= 2048 * MIB and 0 < first.disk_used < first.disk_total
        assert 0.0 <= first.cpu_used_pct <= 100.0
        assert abs((datetime.now(timezone.utc) - first.timestamp).total_seconds()) < 60
        past = datetime.now(timezone.utc) - timedelta(hours=2)
        assert sandbox.get_metrics(start=past, end=past + timedelta(minutes=10)) == []

        newest = httpx.get(f"{s.api_url}/sandboxes/metrics", params={"sandbox_ids": sandbox.sandbox_id},
                           headers=s.headers(), timeout=10).json()
        assert newest["sandboxes"][sandbox.sandbox_id]["memTotal"] == first.mem_total

        # -- the node, as GET /nodes shows it
        nodes = httpx.get(f"{s.api_url}/nodes", headers=s.admin_headers(), timeout=10).json()
        (node,) = [n for n in nodes if n["id"] == s.node_id]
        assert node["status"] == "ready" and node["sandboxCount"] == 1 and node["createSuccesses"] >= 1
        assert node["metrics"]["allocatedCPU"] == 2 and node["metrics"]["allocatedMemoryBytes"] == 512 * MIB
        assert node["metrics"]["memoryTotalBytes"] > 0 and node["metrics"]["disks"]
        assert node["metricsPort"] == int(s.node_metrics_url.split(":")[2].split("/")[0])
        detail = httpx.get(f"{s.api_url}/nodes/{s.node_id}", headers=s.admin_headers(), timeout=10)
        assert detail.status_code == 200 and detail.json()["cachedBuilds"] == []

        # -- Prometheus: a command goes through the data plane, the create ran on the node
        dp_before = scrape(f"{s.sandbox_url}/metrics")
        assert sandbox.commands.run("echo hi").stdout.strip() == "hi"
        dp_after = scrape(f"{s.sandbox_url}/metrics")
        name = "aenv_dataplane_http_requests_total"
        assert value(dp_after, name, route="envd", method="POST", status="200") \
            > value(dp_before, name, route="envd", method="POST", status="200")
        api = scrape(f"{s.api_url}/metrics")
        assert value(api, "aenv_cluster_sandboxes", state="running") == 1
        assert value(api, "aenv_cluster_node_allocated_vcpus", node=s.node_id) == 2
        assert value(api, "aenv_api_http_requests_total", route="nodes", method="GET", status="200") >= 1
        node_after = scrape(s.node_metrics_url)
        ops = "aenv_node_vm_operation_seconds_count"
        assert value(node_after, ops, operation="boot", outcome="ok") \
            == value(node_before, ops, operation="boot", outcome="ok") + 1
        assert value(node_after, "aenv_node_sandbox_metrics_stored_total") >= 1
        assert value(node_after, "aenv_node_vms", node=s.node_id) == 1

        # -- a pause stops the sampling; the samples stay readable
        sandbox.pause()
        time.sleep(1.5)  # a round that had begun before the pause has ended
        count = len(sandbox.get_metrics())
        time.sleep(3)
        assert len(sandbox.get_metrics()) == count
        paused = scrape(s.node_metrics_url)
        assert value(paused, ops, operation="pause", outcome="ok") \
            == value(node_after, ops, operation="pause", outcome="ok") + 1
    finally:
        sandbox.kill()
    killed = scrape(s.node_metrics_url)
    assert value(killed, "aenv_node_vm_operation_seconds_count", operation="kill", outcome="ok") >= 1
