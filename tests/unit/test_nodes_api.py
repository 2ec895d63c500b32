"""GET /nodes and GET /nodes/{id} (AgentENV's node API): status, what placement reserves,
sandbox counts, create outcomes from the events, the host figures of the last heartbeat,
team-scoped cachedBuilds, and the dashboard's nodes page showing the same figures. Who
sees what (issue 21, item 11): the operator (X-Admin-Token; staff on the dashboard) every
figure; a team's key (a dashboard user who is not staff) only each node's id, status and
its own team's sandbox counts — no address, port, host figures or other teams' load."""
from datetime import timedelta

import httpx
import pytest
from asgiref.sync import sync_to_async
from django.utils import timezone

from nodes import placement
from nodes.models import Node
from sandboxes.models import Sandbox, SandboxEvent
from template_builds.models import BuildStatus, TemplateBuild

pytestmark = pytest.mark.django_db(transaction=True)

ADMIN_TOKEN = "op-" + "x" * 40
# What a team's key may see of a node; everything else is the operators'.
TENANT_FIELDS = {"id", "status", "sandboxCount", "sandboxStartingCount", "sandboxPausedCount"}

MIB = 2**20
HOST = {"cpuPercent": 37.5, "cpuCount": 2, "memoryUsedBytes": 3 * 2**30, "memoryTotalBytes": 24 * 2**30,
        "disks": [{"mountPoint": "/", "device": "/dev/vda1", "filesystemType": "ext4",
                   "usedBytes": 10 * 2**30, "totalBytes": 100 * 2**30}],
        "machineInfo": {"cpuFamily": "6", "cpuModel": "85", "cpuModelName": "Xeon", "cpuArchitecture": "x86_64"},
        "metricsPort": 9464}


@pytest.fixture
async def admin(asgi_app, settings, base_template):
    """httpx client on the real ASGI app with the operators' X-Admin-Token."""
    settings.AENV_ADMIN_TOKEN = ADMIN_TOKEN
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi_app), base_url="http://testserver",
                                 headers={"X-Admin-Token": ADMIN_TOKEN}, timeout=30) as client:
        yield client


def _sandbox(team, template, node, state, cpu=2, memory=512):
    return Sandbox.objects.create(team=team, template=template, node=node, state=state, cpu_count=cpu,
                                  memory_mb=memory, end_at=timezone.now() + timedelta(hours=1))


@pytest.fixture
def cluster(team, other_team, base_template, node):
    """n1 (ready, host figures) with sandboxes of both teams in many states and a
    running build; n2 draining; n3 dead."""
    Node.objects.filter(pk=node.pk).update(host=HOST)
    _sandbox(team, base_template, node, "running")
    _sandbox(other_team, base_template, node, "running", cpu=4, memory=1024)
    _sandbox(team, base_template, node, "creating")
    _sandbox(team, base_template, node, "paused", cpu=1, memory=256)
    _sandbox(other_team, base_template, node, "pausing")
    _sandbox(team, base_template, node, "killed", cpu=8, memory=8192)  # holds nothing
    TemplateBuild.objects.create(template=base_template, status=BuildStatus.BUILDING, node=node, cpu_count=2,
                                 memory_mb=1024)
    Node.objects.create(id="n2", address="10.0.0.2", vcpu_capacity=8, memory_mb_capacity=4096, draining=True,
                        last_heartbeat_at=timezone.now())
    Node.objects.create(id="n3", address="10.0.0.3", vcpu_capacity=8, memory_mb_capacity=4096,
                        last_heartbeat_at=timezone.now() - timedelta(minutes=10))
    return node


def _events(sandbox, node_id, outcomes):
    for outcome in outcomes:
        SandboxEvent.objects.create(sandbox=sandbox, operation="create", outcome=outcome,
                                    details={"node": node_id} if node_id else {"node": None})


async def test_list_nodes_has_agentenv_fields_and_placements_figures(admin, cluster, team):
    sb = await Sandbox.objects.filter(node=cluster).afirst()
    await sync_to_async(_events)(sb, "n1", ["ok", "ok", "ok", "error", "started", "aborted"])
    await sync_to_async(_events)(sb, "n2", ["error"])
    await sync_to_async(_events)(sb, None, ["error"])  # no node had room: counts nowhere

    resp = await admin.get("/nodes")
    assert resp.status_code == 200, resp.text
    body = {n["id"]: n for n in resp.json()}
    assert list(body) == ["n1", "n2", "n3"]
    assert body["n1"]["address"] == "127.0.0.1" and body["n2"]["address"] == "10.0.0.2"
    n1 = body["n1"]
    assert n1["status"] == "ready" and body["n2"]["status"] == "draining" and body["n3"]["status"] == "dead"

    reserved = await sync_to_async(lambda: placement.with_reservations(Node.objects.filter(pk="n1")).get())()
    m = n1["metrics"]
    # running 2 + 4, creating 2, pausing 2, the build 2 (paused and killed hold nothing)
    assert m["allocatedCPU"] == reserved.cpu_reserved == 12
    assert m["allocatedMemoryBytes"] == reserved.memory_reserved * MIB == (512 + 1024 + 512 + 512 + 1024) * MIB
    assert m["pausedAllocatedCPU"] == 1 and m["pausedAllocatedMemoryBytes"] == 256 * MIB
    assert (n1["sandboxCount"], n1["sandboxStartingCount"], n1["sandboxPausedCount"]) == (2, 1, 2)
    assert (n1["createSuccesses"], n1["createFails"]) == (3, 1)
    assert (body["n2"]["createSuccesses"], body["n2"]["createFails"]) == (0, 1)
    assert m["cpuPercent"] == 37.5 and m["cpuCount"] == 2
    assert m["memoryUsedBytes"] == HOST["memoryUsedBytes"] and m["memoryTotalBytes"] == HOST["memoryTotalBytes"]
    assert m["disks"] == HOST["disks"]
    assert n1["machineInfo"] == HOST["machineInfo"] and n1["metricsPort"] == 9464
    assert n1["capacity"] == {"cpu": 64, "memoryBytes": 65536 * MIB}
    # a node that never reported its host answers zeros, not a crash
    assert body["n2"]["metrics"]["cpuCount"] == 0 and body["n2"]["metrics"]["disks"] == []
    assert body["n2"]["machineInfo"]["cpuModelName"] == "" and body["n2"]["metricsPort"] is None


async def test_node_detail_names_only_the_callers_builds(api, admin, cluster, team, other_team, base_template):
    from sandboxes.models import Template  # noqa: PLC0415

    mine = await Template.objects.acreate(id="tmine", team=team, alias="mine")
    theirs = await Template.objects.acreate(id="ttheirs", team=other_team, alias="theirs")
    ready = await TemplateBuild.objects.acreate(template=mine, status=BuildStatus.READY, node=cluster)
    await TemplateBuild.objects.acreate(template=mine, status=BuildStatus.ERROR, node=cluster)
    await TemplateBuild.objects.acreate(template=theirs, status=BuildStatus.READY, node=cluster)

    resp = await api.get("/nodes/n1")
    assert resp.status_code == 200, resp.text
    detail = resp.json()
    assert detail["cachedBuilds"] == [str(ready.pk)]
    assert "sandboxStartingCount" not in detail  # AgentENV's NodeDetail leaves it out
    assert detail["sandboxCount"] == 1  # the team's own running sandbox on n1
    assert set(detail) == TENANT_FIELDS - {"sandboxStartingCount"} | {"cachedBuilds"}

    resp = await admin.get("/nodes/n1")
    assert resp.status_code == 200, resp.text
    detail = resp.json()
    assert "sandboxStartingCount" not in detail
    assert detail["sandboxCount"] == 2 and detail["metrics"]["allocatedCPU"] == 12
    assert detail["address"] == "127.0.0.1" and detail["metricsPort"] == 9464
    theirs_ready = await TemplateBuild.objects.filter(template=theirs).afirst()
    assert set(detail["cachedBuilds"]) == {str(ready.pk), str(theirs_ready.pk)}  # an operator: every team's


async def test_a_teams_key_sees_no_address_port_host_or_other_teams_load(api, cluster, team):
    """A tenant's view: each node's id and status, and its own team's sandboxes there."""
    resp = await api.get("/nodes")
    assert resp.status_code == 200, resp.text
    body = {n["id"]: n for n in resp.json()}
    assert list(body) == ["n1", "n2", "n3"]
    for node in body.values():
        assert set(node) == TENANT_FIELDS, node
    assert [body[n]["status"] for n in body] == ["ready", "draining", "dead"]
    # team: running 1, creating 1, paused 1 (other_team's running and pausing ones are not counted)
    assert (body["n1"]["sandboxCount"], body["n1"]["sandboxStartingCount"], body["n1"]["sandboxPausedCount"]) == (
        1, 1, 1)
    text = resp.text
    assert "127.0.0.1" not in text and "10.0.0.2" not in text and "9464" not in text and "Xeon" not in text
    detail = (await api.get("/nodes/n1")).text
    assert "127.0.0.1" not in detail and "9464" not in detail and "allocatedCPU" not in detail


async def test_a_wrong_or_unconfigured_admin_token_is_401(anon, api, cluster, settings, assert_error):
    settings.AENV_ADMIN_TOKEN = ADMIN_TOKEN
    assert_error(await anon.get("/nodes", headers={"X-Admin-Token": ADMIN_TOKEN + "x"}), 401, "invalid admin token")
    # a team's key with a wrong admin token does not fall back to the team's view
    assert_error(await api.get("/nodes", headers={"X-Admin-Token": "nope"}), 401, "invalid admin token")
    settings.AENV_ADMIN_TOKEN = ""
    assert_error(await anon.get("/nodes/n1", headers={"X-Admin-Token": ""}), 401, "invalid admin token")
    # the admin token opens /nodes only, not a team's routes
    settings.AENV_ADMIN_TOKEN = ADMIN_TOKEN
    assert_error(await anon.get("/sandboxes", headers={"X-Admin-Token": ADMIN_TOKEN}), 401)


async def test_unknown_node_is_a_json_404(api, cluster, assert_error):
    assert_error(await api.get("/nodes/nope"), 404, 'node "nope" not found')


async def test_nodes_need_an_api_key(anon, cluster, assert_error):
    assert_error(await anon.get("/nodes"), 401)
    assert_error(await anon.get("/nodes/n1"), 401)


async def test_a_node_with_no_sandboxes_and_no_heartbeat(admin, db):
    await Node.objects.acreate(id="fresh", address="10.0.0.9")
    resp = await admin.get("/nodes")
    (only,) = resp.json()
    assert only["status"] == "dead" and only["lastHeartbeatAt"] is None
    assert only["metrics"]["allocatedCPU"] == 0 and only["sandboxCount"] == 0 and only["createFails"] == 0


@pytest.fixture
def staff(dash, user):
    """The dashboard user made staff: an operator."""
    user.is_staff = True
    user.save()
    return dash


def test_dashboard_nodes_page_shows_the_api_figures(staff, cluster):
    html = staff.get("/dashboard/nodes/").content.decode()
    assert "12 / 64" in html  # allocatedCPU of GET /nodes, of the capacity
    assert f"{512 + 1024 + 512 + 512 + 1024} / 65536 MiB" in html
    assert "37.5 % of 2 cores" in html and "3.0 / 24.0 GiB" in html
    assert ">dead<" in html and ">draining<" in html
    assert "10.0.0.2" in html


def test_dashboard_shows_a_non_staff_user_what_a_teams_key_sees(dash, cluster):
    now = int(timezone.now().timestamp())
    Node.objects.filter(pk=cluster.pk).update(host_history=[[now - 5, 5.0, 2**30], [now, 6.0, 2**30]])
    for page in ("/dashboard/nodes/", "/dashboard/"):
        html = dash.get(page).content.decode()
        assert ">dead<" in html and ">draining<" in html and "n2" in html
        assert "127.0.0.1" not in html and "10.0.0.2" not in html, page
        assert "/ 64" not in html and "65536 MiB" not in html and "cores" not in html, page
        assert "chart-line-cpu" not in html, page
        assert "(your team)" in html
    row = html.split('<td class="mono">n1</td>')[1].split("</tr>")[0]
    assert '<td class="num">1 <span class="muted small">+1 starting</span></td>' in row  # the team's: 1 running


def test_dashboard_charts_the_host_history(staff, cluster):
    now = int(timezone.now().timestamp())
    history = [[now - 55 + 5 * i, 5.0 * i, (i + 1) * 2**30] for i in range(12)]
    Node.objects.filter(pk=cluster.pk).update(host_history=history)
    html = staff.get("/dashboard/nodes/").content.decode()
    assert "chart-line-cpu" in html and "chart-line-memory" in html
    # the newest sample: CPU 55 %, memory 12 of 24 GiB
    assert "CPU 55.0 %" in html and "memory 50 %" in html and "last 1 min" in html
    points = html.split('class="chart-line chart-line-cpu" points="')[1].split('"')[0].split()
    assert len(points) == 12


def test_no_chart_before_two_samples(staff, cluster):
    Node.objects.filter(pk=cluster.pk).update(host_history=[[1, 2.0, 3]])
    assert "chart-line-cpu" not in staff.get("/dashboard/nodes/").content.decode()
