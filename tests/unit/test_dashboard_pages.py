"""Dashboard pages: sign-in, team scoping, rendering, filters, the live JSON list."""
import re
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from sandboxes.models import Sandbox, SandboxEvent, Team

PAGES = ["/dashboard/", "/dashboard/sandboxes/", "/dashboard/api/sandboxes.json", "/dashboard/snapshots/",
         "/dashboard/templates/", "/dashboard/nodes/", "/dashboard/api-keys/"]


def make_sandbox(team, template, *, state="running", node=None, metadata=None, **fields):
    now = timezone.now()
    return Sandbox.objects.create(team=team, template=template, node=node, state=state, metadata=metadata or {},
                                  end_at=now + timedelta(minutes=5), **fields)


@pytest.fixture
def mine(team, base_template, node):
    sb = make_sandbox(team, base_template, node=node, metadata={"env": "prod", "owner": "ann"})
    SandboxEvent.objects.create(sandbox=sb, operation="create", outcome="ok", to_state="running", duration_ms=812.5)
    return sb


@pytest.fixture
def theirs(other_team, base_template, node):
    sb = make_sandbox(other_team, base_template, node=node, metadata={"env": "prod"})
    SandboxEvent.objects.create(sandbox=sb, operation="create", outcome="ok", to_state="running")
    return sb


@pytest.mark.parametrize("path", PAGES + ["/dashboard/sandboxes/ixxxxxxxxxxxxxxxxxxx/"])
def test_pages_require_login(client, db, path):
    resp = client.get(path)
    assert resp.status_code == 302
    assert resp["Location"].startswith("/dashboard/login/?next=")


@pytest.mark.parametrize("path", ["/dashboard/sandboxes/x/kill", "/dashboard/sandboxes/x/timeout",
                                  "/dashboard/sandboxes/x/pause", "/dashboard/sandboxes/x/resume",
                                  "/dashboard/sandboxes/x/snapshot", "/dashboard/sandboxes/x/fork",
                                  "/dashboard/sandboxes/create", "/dashboard/snapshots/s1/delete",
                                  "/dashboard/api-keys/create", "/dashboard/api-keys/1/revoke", "/dashboard/team/"])
def test_actions_require_login(client, db, path):
    resp = client.post(path)
    assert resp.status_code == 302 and resp["Location"].startswith("/dashboard/login/")


def test_root_redirects_to_dashboard_and_api_still_works(client, db):
    resp = client.get("/")
    assert resp.status_code == 302 and resp["Location"] == "/dashboard/"
    assert client.get("/health").status_code == 204


def test_login_and_logout(client, user):
    page = client.get("/dashboard/login/")
    assert page.status_code == 200 and b"Sign in" in page.content
    bad = client.post("/dashboard/login/", {"username": "alice", "password": "nope"})
    assert bad.status_code == 200 and b"Wrong username or password" in bad.content
    ok = client.post("/dashboard/login/", {"username": "alice", "password": "pw-alice-123"})
    assert ok.status_code == 302 and ok["Location"] == "/dashboard/"
    assert client.get("/dashboard/").status_code == 200
    out = client.post("/dashboard/logout/")
    assert out.status_code == 302
    assert client.get("/dashboard/").status_code == 302


def test_user_without_team_sees_explanation(client, db):
    loner = get_user_model().objects.create_user("bob", password="x")
    client.force_login(loner)
    resp = client.get("/dashboard/")
    assert resp.status_code == 403 and b"not a member of any team" in resp.content


@pytest.mark.parametrize("path", PAGES)
def test_every_page_renders(dash, mine, theirs, path):
    resp = dash.get(path)
    assert resp.status_code == 200, resp.content[:500]


def test_overview_shows_team_data_only(dash, user, mine, theirs, node):
    html = dash.get("/dashboard/").content.decode()
    assert mine.id in html and theirs.id not in html  # recent events
    assert node.id in html and "<svg" in html and "<polyline" in html
    # not staff: the node with the team's own sandbox, not both teams' load (issue 21, item 11)
    assert "4 / 64" not in html
    row = html.split(f'<td class="mono">{node.id}</td>')[1].split("</tr>")[0]
    assert '<td class="num">1</td>' in row
    # staff (an operator): node usage counts both teams' VMs (capacity is shared), by number only
    user.is_staff = True
    user.save()
    assert "4 / 64" in dash.get("/dashboard/").content.decode()


def test_sandbox_list_and_detail_are_team_scoped(dash, mine, theirs):
    html = dash.get("/dashboard/sandboxes/").content.decode()
    assert mine.id in html and theirs.id not in html
    data = dash.get("/dashboard/api/sandboxes.json").json()
    assert [s["id"] for s in data["sandboxes"]] == [mine.id]
    detail = dash.get(f"/dashboard/sandboxes/{mine.id}/")
    body = detail.content.decode()
    assert detail.status_code == 200 and "env=prod" in body and "812 ms" in body
    assert f'data-ws-path="/ws/sandboxes/{mine.id}/terminal"' in body
    for action in ("pause", "timeout", "kill"):  # what a running sandbox offers
        assert f'data-action="{action}"' in body
    assert 'data-action="resume"' not in body
    assert dash.get(f"/dashboard/sandboxes/{theirs.id}/").status_code == 404
    assert dash.get("/dashboard/sandboxes/inope/").status_code == 404


def test_filters(dash, team, base_template, mine):
    from sandboxes.models import Template

    other_tpl = Template.objects.create(id="py", alias="python", team=team, public=False)
    killed = make_sandbox(team, base_template, state="killed", metadata={"env": "dev"}, killed_at=timezone.now())
    py = make_sandbox(team, other_tpl, metadata={"env": "dev", "owner": "ann"})

    def ids(query):
        html_ids = dash.get("/dashboard/sandboxes/" + query).content.decode()
        json_ids = {s["id"] for s in dash.get("/dashboard/api/sandboxes.json" + query).json()["sandboxes"]}
        assert {i for i in (mine.id, killed.id, py.id) if i in html_ids} == json_ids
        return json_ids

    assert ids("") == {mine.id, killed.id, py.id}
    assert ids("?state=killed") == {killed.id}
    assert ids("?state=live") == {mine.id, py.id}
    assert ids("?template=py") == {py.id}
    assert ids("?metadata=env%3Ddev") == {killed.id, py.id}
    assert ids("?metadata=env%3Ddev%2C+owner%3Dann") == {py.id}
    assert ids("?state=running&metadata=owner%3Dann&template=base") == {mine.id}
    assert ids("?metadata=owner%3Dnobody") == set()
    bad = dash.get("/dashboard/api/sandboxes.json?metadata=justakey").json()
    assert "key=value" in bad["error"] and len(bad["sandboxes"]) == 3
    assert ids("?state=bogus") == {mine.id, killed.id, py.id}


def test_json_endpoint_fields(dash, mine):
    row = dash.get("/dashboard/api/sandboxes.json").json()["sandboxes"][0]
    assert row["url"] == f"/dashboard/sandboxes/{mine.id}/"
    assert row["state"] == "running" and row["template"] == "base" and row["node"] == "n1"
    assert row["metadata"] == {"env": "prod", "owner": "ann"} and 0 < row["expires_in_s"] <= 300


def test_team_switcher(dash, user, team, other_team, mine, theirs):
    third = Team.objects.create(name="Team C", slug="team-c")
    assert b"team-switcher" not in dash.get("/dashboard/").content  # one team: no switcher
    other_team.members.add(user)
    html = dash.get("/dashboard/sandboxes/").content.decode()
    assert 'class="team-switcher"' in html and mine.id in html and theirs.id not in html

    resp = dash.post("/dashboard/team/", {"team": "team-b", "next": "/dashboard/sandboxes/"})
    assert resp.status_code == 302 and resp["Location"] == "/dashboard/sandboxes/"
    html = dash.get("/dashboard/sandboxes/").content.decode()
    assert theirs.id in html and mine.id not in html
    assert dash.get(f"/dashboard/sandboxes/{mine.id}/").status_code == 404
    assert dash.get(f"/dashboard/sandboxes/{theirs.id}/").status_code == 200

    # not a member of team C: 404, current team unchanged; open redirects refused
    assert dash.post("/dashboard/team/", {"team": third.slug}).status_code == 404
    resp = dash.post("/dashboard/team/", {"team": "team-a", "next": "https://evil.example/"})
    assert resp["Location"] == "/dashboard/"
    assert mine.id in dash.get("/dashboard/sandboxes/").content.decode()

    # removed from the team in the session: falls back to a team the user is in
    dash.post("/dashboard/team/", {"team": "team-b"})
    other_team.members.remove(user)
    assert mine.id in dash.get("/dashboard/sandboxes/").content.decode()


def test_templates_and_nodes_pages(dash, user, team, other_team, base_template, node, mine):
    from sandboxes.models import Template

    Template.objects.create(id="mine-private", team=team, public=False)
    Template.objects.create(id="their-private", team=other_team, public=False)
    html = dash.get("/dashboard/templates/").content.decode()
    assert "base" in html and "mine-private" in html and "their-private" not in html
    html = dash.get("/dashboard/nodes/").content.decode()
    # not staff: the node and the team's sandbox on it, not its reservations (issue 21, item 11)
    assert node.id in html and "2 / 64" not in html and "(your team)" in html
    user.is_staff = True
    user.save()
    html = dash.get("/dashboard/nodes/").content.decode()
    assert node.id in html and "2 / 64" in html and "512 / 65536 MiB" in html


def test_nodes_page_shows_the_chunk_cache_to_operators(dash, user, node):
    """The heartbeat's host.chunkCache (lazy restores: agent.stores.lazy) is an operator's figure."""
    node.host = {"cpuPercent": 5.0, "cpuCount": 2, "memoryUsedBytes": 1 << 30, "memoryTotalBytes": 4 << 30, "disks": [],
                 "chunkCache": {"hits": 30, "misses": 10, "hitRatio": 0.75, "sizeBytes": 512 << 20,
                                                     "limitBytes": 2048 << 20, "entries": 128, "evictions": 7,
                                                     "fetchedBytes": 600 << 20, "corrupt": 1,
                                                     "peerChunks": 40, "peerBytes": 160 << 20, "peerErrors": 2,
                                                     "peerCorrupt": 1, "storeChunks": 110, "storeBytes": 400 << 20,
                                                     "storeWireBytes": 100 << 20, "servedChunks": 12,
                                                     "servedBytes": 48 << 20, "servedFileChunks": 5,
                                                     "servedRefused": 3}}
    node.save()
    html = dash.get("/dashboard/nodes/").content.decode()
    assert "chunk cache" not in html  # a team member sees no node figures
    user.is_staff = True
    user.save()
    html = dash.get("/dashboard/nodes/").content.decode()
    section = html[html.index(f"chunk-cache-{node.id}"):].replace("\xa0", " ")  # filesizeformat's spaces
    assert "75.0 %" in section and "512.0 MB (25 %)" in section
    assert "2.0 GB" in section and ">7<" in section and "600.0 MB" in section
    # peer fetch and the wire: per origin, the store's bytes as stored (compressed) beside plain
    wire = section[section.index(f"chunk-wire-{node.id}"):section.index("</table>", section.index("chunk-wire"))]
    rows = {cells[0]: cells[1:] for cells in ([c.strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", r, re.S)]
                                              for r in wire.split("<tr>")[2:])}
    assert rows["peer nodes"] == ["40", "160.0 MB", "160.0 MB", "2 / 1 lying"]
    assert rows["the store"] == ["110", "400.0 MB", "100.0 MB (25 %)", "–"]
    assert rows["together"][:3] == ["150", "560.0 MB", "260.0 MB"]
    assert rows["served to peers"] == ["12 (5 from files)", "48.0 MB", "48.0 MB", "3 refused"]
    # a node from before peer fetch reports no such figures: zeros, no ratio
    node.host["chunkCache"] = {"hits": 1, "misses": 1, "hitRatio": 0.5, "sizeBytes": 1, "limitBytes": 2}
    node.save()
    html = dash.get("/dashboard/nodes/").content.decode().replace("\xa0", " ")
    wire = html[html.index(f"chunk-wire-{node.id}"):]
    assert "0 bytes (" not in wire[:wire.index("</table>")] and ">0<" in wire
