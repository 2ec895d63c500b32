"""Prometheus /metrics of the API, the data plane and a node: each scrape parses with
prometheus_client's own parser, a known operation moves its counter, and the API's
exposition holds aggregates only (no team, no sandbox id)."""
import socket
from datetime import timedelta
from types import SimpleNamespace

import httpx
import pytest
from asgiref.sync import sync_to_async
from django.utils import timezone
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from sandboxes.models import Sandbox, SandboxEvent
from harness.ports import free_port as _free_port

pytestmark = pytest.mark.django_db(transaction=True)


def samples(text: str) -> dict[tuple, float]:
    """(sample name, sorted labels) → value, for every sample of an exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(scrape: dict, name: str, **labels) -> float:
    return scrape.get((name, tuple(sorted(labels.items()))), 0.0)


# --- the API --------------------------------------------------------------------------------

async def _scrape_api(client) -> dict:
    resp = await client.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    return samples(resp.text), resp.text


async def test_api_scrape_parses_and_counts_requests_by_route(api, anon, node):
    before, _ = await _scrape_api(anon)
    for _ in range(3):
        assert (await api.get("/nodes")).status_code == 200
    assert (await api.get("/nodes/nope")).status_code == 404
    after, _ = await _scrape_api(anon)
    key = dict(route="nodes", method="GET", status="200")
    assert value(after, "aenv_api_http_requests_total", **key) - value(before, "aenv_api_http_requests_total", **key) == 3
    miss = dict(route="nodes/<str:node_id>", method="GET", status="404")
    assert value(after, "aenv_api_http_requests_total", **miss) - value(before, "aenv_api_http_requests_total", **miss) == 1
    hist = dict(route="nodes", method="GET")
    assert (value(after, "aenv_api_http_request_duration_seconds_count", **hist)
            - value(before, "aenv_api_http_request_duration_seconds_count", **hist)) == 3


async def test_api_scrape_has_cluster_aggregates_and_no_team_data(anon, team, other_team, base_template, node):
    end = timezone.now() + timedelta(hours=1)

    def seed():
        made = [Sandbox.objects.create(team=t, template=base_template, node=node, state=s, end_at=end,
                                       metadata={"secret": "team-a-data"})
                for t, s in ((team, "running"), (other_team, "running"), (team, "paused"))]
        SandboxEvent.objects.create(sandbox=made[0], operation="create", outcome="ok", details={"node": node.pk})
        SandboxEvent.objects.create(sandbox=made[2], operation="create", outcome="error",
                                    details={"node": None, "kind": "NoNodeAvailable"})
        return made

    made = await sync_to_async(seed)()
    scrape, text = await _scrape_api(anon)
    assert value(scrape, "aenv_cluster_sandboxes", state="running") == 2
    assert value(scrape, "aenv_cluster_sandboxes", state="paused") == 1
    assert value(scrape, "aenv_cluster_sandbox_creates_total", outcome="ok") == 1
    assert value(scrape, "aenv_cluster_placement_failures_total") == 1
    assert value(scrape, "aenv_cluster_node_allocated_vcpus", node="n1") == 4
    assert value(scrape, "aenv_cluster_node_sandboxes", node="n1", kind="paused") == 1
    assert value(scrape, "aenv_cluster_node_status", node="n1", status="ready") == 1
    assert value(scrape, "aenv_cluster_node_creates_total", node="n1", outcome="ok") == 1
    for private in [*(s.id for s in made), team.slug, other_team.slug, "team-a-data"]:
        assert private not in text


# --- the data plane ---------------------------------------------------------------------------

class _Guest:
    """Stands in for the proxy: answers ``status`` (or raises before answering)."""

    def __init__(self, status=200, fail=False):
        self.status, self.fail, self.calls = status, fail, []

    async def __call__(self, scope, receive, send):
        self.calls.append(scope["path"])
        if self.fail:
            raise ConnectionError("upstream gone")
        await send({"type": "http.response.start", "status": self.status, "headers": []})
        await send({"type": "http.response.body", "body": b"guest"})


def _dataplane(guest):
    from config.prometheus import InstrumentedDataPlane  # noqa: PLC0415
    from dataplane.addressing import parse_target  # noqa: PLC0415

    return InstrumentedDataPlane(guest, parse_target)


async def _get(app, path, headers=None):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://dp") as client:
        return await client.get(path, headers=headers or {})


async def test_dataplane_serves_its_metrics_only_when_no_sandbox_is_named():
    guest = _Guest()
    app = _dataplane(guest)
    own = await _get(app, "/metrics")
    assert own.status_code == 200 and "aenv_dataplane_http_requests" in own.text and guest.calls == []
    samples(own.text)  # parses
    # a sandbox's envd /metrics (header or host routed) is the guest's, not ours
    assert (await _get(app, "/metrics", {"E2b-Sandbox-Id": "isb1"})).text == "guest"
    assert (await _get(app, "/metrics", {"Host": "49983-isb1.localhost"})).text == "guest"
    assert guest.calls == ["/metrics", "/metrics"]


async def test_dataplane_counts_by_route_and_status():
    app = _dataplane(_Guest(status=502))
    before = samples((await _get(app, "/metrics")).text)
    await _get(app, "/files", {"E2b-Sandbox-Id": "isb1"})
    await _get(app, "/", {"Host": "8080-isb1.localhost"})
    await _get(app, "/")  # names no sandbox: the proxy answers (here the stand-in)
    with pytest.raises(ConnectionError):
        await _get(_dataplane(_Guest(fail=True)), "/x", {"E2b-Sandbox-Id": "isb1"})
    after = samples((await _get(app, "/metrics")).text)

    def moved(**labels):
        name = "aenv_dataplane_http_requests_total"
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved(route="envd", method="GET", status="502") == 1
    assert moved(route="port", method="GET", status="502") == 1
    assert moved(route="unrouted", method="GET", status="502") == 1
    assert moved(route="envd", method="GET", status="none") == 1


def test_the_deployed_dataplane_is_instrumented(monkeypatch):
    from django.conf import settings  # noqa: PLC0415

    # Importing the entry point makes SQLite connections persistent (the data plane's own
    # process wants that): give the rest of this test process the API's setting back.
    for key in ("CONN_MAX_AGE", "CONN_HEALTH_CHECKS"):
        monkeypatch.setitem(settings.DATABASES["default"], key, settings.DATABASES["default"].get(key))
    from config import dataplane_asgi as dataplane  # noqa: PLC0415
    from config.prometheus import InstrumentedDataPlane  # noqa: PLC0415
    from dataplane.proxy import EnvdProxy  # noqa: PLC0415

    assert isinstance(dataplane.application, InstrumentedDataPlane)
    assert isinstance(dataplane.application.app, EnvdProxy)


# --- a node ------------------------------------------------------------------------------------


@pytest.fixture
def exporter():
    from agent.prometheus import NodeCollector, start_exporter  # noqa: PLC0415

    host = {"cpuPercent": 12.5, "cpuCount": 2, "memoryUsedBytes": 1000, "memoryTotalBytes": 4000,
            "disks": [{"mountPoint": "/", "usedBytes": 10, "totalBytes": 20}]}
    collector = NodeCollector("nx", lambda: 3, lambda: host, (128, 1024))
    port = start_exporter("127.0.0.1", _free_port(), collector)
    assert port
    yield f"http://127.0.0.1:{port}/metrics"
    REGISTRY.unregister(collector)


def _scrape(url) -> dict:
    resp = httpx.get(url, timeout=5)
    assert resp.status_code == 200
    return samples(resp.text)


def test_node_scrape_has_host_figures_and_vm_count(exporter):
    scrape = _scrape(exporter)
    assert value(scrape, "aenv_node_vms", node="nx") == 3
    assert value(scrape, "aenv_node_host_cpu_percent", node="nx") == 12.5
    assert value(scrape, "aenv_node_host_memory_total_bytes", node="nx") == 4000
    assert value(scrape, "aenv_node_host_disk_used_bytes", node="nx", mount_point="/") == 10
    assert value(scrape, "aenv_node_capacity_memory_bytes", node="nx") == 1024 * 2**20


def test_a_node_task_moves_its_operation_histogram(exporter, monkeypatch):
    from agent import tasks  # noqa: PLC0415

    class Driver:
        def kill(self, sandbox_id):
            if sandbox_id == "boom":
                raise RuntimeError("driver broke")
            return True

    monkeypatch.setattr(tasks, "get_driver", lambda: Driver())
    before = _scrape(exporter)
    assert tasks.kill_sandbox.apply(kwargs={"sandbox_id": "x"}).get() == {"killed": True}
    assert tasks.kill_sandbox.apply(kwargs={"sandbox_id": "boom"}).failed()
    after = _scrape(exporter)
    name = "aenv_node_vm_operation_seconds_count"
    assert value(after, name, operation="kill", outcome="ok") - value(before, name, operation="kill", outcome="ok") == 1
    assert (value(after, name, operation="kill", outcome="error")
            - value(before, name, operation="kill", outcome="error")) == 1


def test_template_builds_are_counted_by_their_outcome(exporter):
    from agent.prometheus import TaskTimer  # noqa: PLC0415

    timer, task = TaskTimer(), SimpleNamespace(name="nodes.build_template")
    before = _scrape(exporter)
    timer.started("t1", task=task)
    timer.finished("t1", task=task, retval={"status": "error", "step": "2"}, state="SUCCESS")
    timer.finished("never-started", task=task, retval={"status": "ready"}, state="SUCCESS")  # not counted
    after = _scrape(exporter)
    name = "aenv_node_template_builds_total"
    assert value(after, name, outcome="error") - value(before, name, outcome="error") == 1
    assert value(after, name, outcome="ready") == value(before, name, outcome="ready")


def test_a_taken_port_does_not_stop_the_node():
    from agent.prometheus import NodeCollector, start_exporter  # noqa: PLC0415

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        collector = NodeCollector("ny", lambda: 0, dict)
        try:
            assert start_exporter("127.0.0.1", s.getsockname()[1], collector) is None
        finally:
            REGISTRY.unregister(collector)
