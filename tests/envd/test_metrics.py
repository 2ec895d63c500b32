"""envd's GET /metrics (E2B's envd ``Metrics``) on a real envd on the host, read raw, through
envd_client (sync and async), behind an access token, and by the node's sampler
(agent.metrics) into SandboxMetric rows."""
import datetime
import os
import subprocess
import sys
import time
from datetime import timedelta

import httpx
import pytest
from django.utils import timezone

from envd import usage
from envd_client import AsyncEnvdClient, EnvdClient, EnvdError

from .conftest import EnvdServer

FIELDS = {"ts", "cpu_count", "cpu_used_pct", "mem_total", "mem_used", "mem_cache", "disk_used", "disk_total"}


def _host_memory_total() -> int:
    with open("/proc/meminfo") as f:
        return usage.parse_meminfo(f.read()).total


def test_metrics_answer_has_e2bs_fields_with_this_machines_figures(envd):
    r = httpx.get(envd.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    m = r.json()
    assert set(m) == FIELDS
    assert abs(m["ts"] - time.time()) < 5
    assert m["cpu_count"] == os.cpu_count()
    assert 0.0 <= m["cpu_used_pct"] <= 100.0
    assert m["mem_total"] == _host_memory_total() and 0 < m["mem_used"] < m["mem_total"]
    st = os.statvfs("/")
    assert m["disk_total"] == st.f_blocks * st.f_frsize and 0 < m["disk_used"] <= m["disk_total"]


def test_cpu_share_follows_a_busy_process(envd):
    """Between two calls the figure is the busy share since the previous one: a process
    spinning on one of the host's cores shows (other load may add to it, never remove it)."""
    httpx.get(envd.url + "/metrics")
    spin = subprocess.Popen([sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<1.5: pass"])
    spin.wait()
    busy = httpx.get(envd.url + "/metrics").json()["cpu_used_pct"]
    assert busy >= 100.0 / os.cpu_count() * 0.6, busy


def test_client_reads_metrics_sync_and_async(envd):
    with EnvdClient(envd.url) as client:
        m = client.metrics()
    assert m.mem_total == _host_memory_total() and m.cpu_count == os.cpu_count()

    import asyncio  # noqa: PLC0415

    async def read():
        async with AsyncEnvdClient(envd.url) as client:
            return await client.metrics()

    am = asyncio.run(read())
    assert am.disk_total == m.disk_total


@pytest.fixture(scope="module")
def secured(sandbox_user):
    server = EnvdServer()
    now = datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")
    assert httpx.post(server.url + "/init", json={"accessToken": "tok-metrics", "timestamp": now}).status_code == 204
    yield server
    server.stop()


def test_a_secured_envd_wants_its_token(secured):
    r = httpx.get(secured.url + "/metrics")
    assert r.status_code == 401 and r.json()["code"] == 401
    with EnvdClient(secured.url) as client, pytest.raises(EnvdError) as err:
        client.metrics()
    assert err.value.code == "unauthenticated"
    with EnvdClient(secured.url, "tok-metrics") as client:
        assert client.metrics().mem_total == _host_memory_total()


# --- the node's sampler against real envds ------------------------------------------------

@pytest.fixture
def sampled(db, envd, secured):
    from nodes.models import Node  # noqa: PLC0415
    from sandboxes.models import Sandbox, Team, Template  # noqa: PLC0415

    team = Team.objects.create(name="T", slug="t")
    template = Template.objects.create(id="base", alias="base")
    node = Node.objects.create(id="sampler-node", address="127.0.0.1", last_heartbeat_at=timezone.now())
    other = Node.objects.create(id="other-node", address="127.0.0.2", last_heartbeat_at=timezone.now())
    end = timezone.now() + timedelta(hours=1)

    def make(state, port, token="", on=node):
        return Sandbox.objects.create(team=team, template=template, node=on, state=state, envd_host="127.0.0.1",
                                      envd_port=port, envd_access_token=token, end_at=end)

    return {"open": make("running", envd.port), "secure": make("running", secured.port, "tok-metrics"),
            "paused": make("paused", envd.port), "elsewhere": make("running", envd.port, on=other),
            "dead_envd": make("running", 9)}  # nothing listens on port 9: skipped, the round goes on


def test_sampler_stores_one_sample_per_running_sandbox_of_its_node(sampled):
    from agent.metrics import MetricsSampler  # noqa: PLC0415
    from sandboxes.models import SandboxMetric  # noqa: PLC0415

    rounds = []
    # interval 10 s: a 2 s round (the most a round waits), which a loaded host's envd answers within
    sampler = MetricsSampler("sampler-node", 10.0, 3600, on_round=lambda asked, stored: rounds.append((asked, stored)))
    assert sampler.sample_once() == 2
    assert rounds == [(3, 2)]  # asked: open, secure, dead_envd; stored: the two that answered
    rows = {m.sandbox_id: m for m in SandboxMetric.objects.all()}
    assert set(rows) == {sampled["open"].id, sampled["secure"].id}
    m = rows[sampled["secure"].id]
    assert m.mem_total == _host_memory_total() and m.cpu_count == os.cpu_count() and m.disk_total > 0
    assert abs((timezone.now() - m.timestamp).total_seconds()) < 10


def test_a_sandbox_paused_or_killed_meanwhile_keeps_no_sample(sampled):
    from agent.metrics import collect, store  # noqa: PLC0415
    from sandboxes.models import Sandbox, SandboxMetric  # noqa: PLC0415

    rows = [{"id": s.id, "envd_host": s.envd_host, "envd_port": s.envd_port, "envd_access_token": s.envd_access_token}
            for s in (sampled["open"], sampled["secure"])]
    samples = collect(rows, 2.0)
    assert len(samples) == 2
    Sandbox.objects.filter(pk=sampled["open"].id).update(state="pausing")  # the pause began mid-round
    assert store(samples) == 1
    assert list(SandboxMetric.objects.values_list("sandbox_id", flat=True)) == [sampled["secure"].id]


def test_retention_deletes_old_samples(sampled):
    from agent.metrics import prune  # noqa: PLC0415
    from sandboxes.models import SandboxMetric  # noqa: PLC0415

    sb = sampled["open"]
    for age in (10, 100, 4000):
        SandboxMetric.objects.create(sandbox=sb, timestamp=timezone.now() - timedelta(seconds=age), cpu_count=1,
                                     cpu_used_pct=0, mem_used=1, mem_total=2, disk_used=1, disk_total=2)
    assert prune(3600) == 1
    assert SandboxMetric.objects.count() == 2
