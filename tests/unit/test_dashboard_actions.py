"""Dashboard actions: kill and timeout through the lifecycle service, API keys,
team isolation of every action, and the create_dashboard_user command."""
from datetime import timedelta
from io import StringIO

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from django.utils import timezone

from sandboxes.models import ApiKey, Sandbox, SandboxEvent, hash_api_key



def make_sandbox(team, template, *, state="running", node=None, **fields):
    return Sandbox.objects.create(team=team, template=template, node=node, state=state,
                                  end_at=timezone.now() + timedelta(minutes=5), **fields)


@pytest.fixture
def mine(team, base_template, node):
    return make_sandbox(team, base_template, node=node)


@pytest.fixture
def theirs(other_team, base_template, node):
    return make_sandbox(other_team, base_template, node=node)


def test_kill_calls_service_and_shows_result(dash, mine, nodes_mock):
    resp = dash.post(f"/dashboard/sandboxes/{mine.id}/kill", follow=True)
    assert resp.redirect_chain[-1][0] == f"/dashboard/sandboxes/{mine.id}/"
    assert f"Sandbox {mine.id} killed." in resp.content.decode()
    nodes_mock.client.kill_sandbox.assert_awaited_once_with(nodes_mock.node, sandbox_id=mine.id)
    mine.refresh_from_db()
    assert mine.state == "killed" and mine.killed_at is not None
    ops = list(SandboxEvent.objects.filter(sandbox=mine).order_by("id").values_list("operation", "outcome", "actor"))
    assert ops == [("kill", "started", "dashboard:alice"), ("kill", "ok", "dashboard:alice")]


def test_kill_unconfirmed_by_node_is_a_warning(dash, mine, nodes_mock):
    nodes_mock.client.kill_sandbox.side_effect = RuntimeError("broker down")
    html = dash.post(f"/dashboard/sandboxes/{mine.id}/kill", follow=True).content.decode()
    assert "killed, but" in html and "broker down" in html


def test_wrong_state_action_shows_service_error(dash, team, base_template, nodes_mock):
    dead = make_sandbox(team, base_template, state="killed", killed_at=timezone.now())
    for action, data in (("kill", {}), ("timeout", {"seconds": "300"})):
        resp = dash.post(f"/dashboard/sandboxes/{dead.id}/{action}", data, follow=True)
        assert resp.status_code == 200
        assert "not found" in resp.content.decode() and "message-error" in resp.content.decode()
    nodes_mock.client.kill_sandbox.assert_not_awaited()
    dead.refresh_from_db()
    assert dead.state == "killed"


def test_set_timeout(dash, mine):
    before = mine.end_at
    resp = dash.post(f"/dashboard/sandboxes/{mine.id}/timeout", {"seconds": "3600"}, follow=True)
    assert "now ends in 1h 0m" in resp.content.decode()
    mine.refresh_from_db()
    assert mine.end_at > before + timedelta(minutes=50)
    assert SandboxEvent.objects.filter(sandbox=mine, operation="set_timeout", actor="dashboard:alice").exists()

    for bad in ("abc", str(10 ** 9)):
        html = dash.post(f"/dashboard/sandboxes/{mine.id}/timeout", {"seconds": bad}, follow=True).content.decode()
        assert "message-error" in html


def test_actions_on_other_teams_sandbox_are_404(dash, theirs, nodes_mock):
    end_at = theirs.end_at
    assert dash.post(f"/dashboard/sandboxes/{theirs.id}/kill").status_code == 404
    assert dash.post(f"/dashboard/sandboxes/{theirs.id}/timeout", {"seconds": "60"}).status_code == 404
    assert dash.post("/dashboard/sandboxes/inope/kill").status_code == 404
    theirs.refresh_from_db()
    assert theirs.state == "running" and theirs.end_at == end_at
    assert not SandboxEvent.objects.filter(sandbox=theirs).exists()
    nodes_mock.client.kill_sandbox.assert_not_awaited()


def test_actions_need_post(dash, mine):
    assert dash.get(f"/dashboard/sandboxes/{mine.id}/kill").status_code == 405
    assert dash.get("/dashboard/api-keys/create").status_code == 405


def test_actions_need_csrf(client, user, mine):
    from django.test import Client

    strict = Client(enforce_csrf_checks=True)
    strict.force_login(user)
    assert strict.post(f"/dashboard/sandboxes/{mine.id}/kill").status_code == 403
    assert strict.post("/dashboard/api-keys/create", {"name": "x"}).status_code == 403


def test_create_key_shows_raw_key_once_and_stores_hash(dash, team, user):
    resp = dash.post("/dashboard/api-keys/create", {"name": "ci"})
    assert resp.status_code == 200 and resp["Cache-Control"] == "no-store"
    key = ApiKey.objects.get(team=team, name="ci")
    html = resp.content.decode()
    raw = html.split('data-secret>')[1].split("<")[0]
    assert raw.startswith("e2b_") and len(raw) == 44
    assert key.key_hash == hash_api_key(raw) and key.prefix == raw[:12] and key.created_by == user
    assert raw not in {getattr(key, f.attname) for f in ApiKey._meta.fields}
    listing = dash.get("/dashboard/api-keys/").content.decode()
    assert key.prefix in listing and raw not in listing


def test_created_key_works_against_the_api(dash, team, client):
    html = dash.post("/dashboard/api-keys/create", {"name": "sdk"}).content.decode()
    raw = html.split('data-secret>')[1].split("<")[0]
    assert client.get("/v2/sandboxes", HTTP_X_API_KEY=raw).status_code == 200


def test_revoke_key(dash, team, other_team):
    key, raw = ApiKey.generate(team, name="old")
    theirs, _ = ApiKey.generate(other_team)
    resp = dash.post(f"/dashboard/api-keys/{key.pk}/revoke", follow=True)
    assert "revoked" in resp.content.decode()
    key.refresh_from_db()
    assert key.revoked_at is not None
    first = key.revoked_at
    dash.post(f"/dashboard/api-keys/{key.pk}/revoke")
    key.refresh_from_db()
    assert key.revoked_at == first
    assert dash.get("/v2/sandboxes", HTTP_X_API_KEY=raw).status_code == 401

    assert dash.post(f"/dashboard/api-keys/{theirs.pk}/revoke").status_code == 404
    theirs.refresh_from_db()
    assert theirs.revoked_at is None
    assert theirs.prefix not in dash.get("/dashboard/api-keys/").content.decode()


def test_create_dashboard_user_command(team, client):
    out, err = StringIO(), StringIO()
    call_command("create_dashboard_user", "--username", "carol", "--team", team.slug, stdout=out, stderr=err)
    password = out.getvalue().strip().removeprefix("password: ")
    assert password and "created user carol" in err.getvalue()
    user = get_user_model().objects.get(username="carol")
    assert team.members.filter(pk=user.pk).exists() and user.check_password(password)
    assert client.post("/dashboard/login/", {"username": "carol", "password": password}).status_code == 302

    # existing user: attached again without touching the password, or given a new one
    out = StringIO()
    call_command("create_dashboard_user", "--username", "carol", "--team", team.slug, stdout=out, stderr=StringIO())
    assert out.getvalue() == ""
    user.refresh_from_db()
    assert user.check_password(password)
    call_command("create_dashboard_user", "--username", "carol", "--team", team.slug, "--password", "s3cret",
                 stdout=StringIO(), stderr=StringIO())
    user.refresh_from_db()
    assert user.check_password("s3cret") and team.members.filter(pk=user.pk).count() == 1

    with pytest.raises(CommandError, match="no team"):
        call_command("create_dashboard_user", "--username", "dave", "--team", "nope", stdout=StringIO(),
                     stderr=StringIO())
    assert not get_user_model().objects.filter(username="dave").exists()


@pytest.mark.django_db(transaction=True)
async def test_kill_through_the_asgi_stack(async_client, team, base_template, node, nodes_mock):
    """The action views are async (a kill waits for the node): exercise them on the ASGI handler."""
    from asgiref.sync import sync_to_async

    @sync_to_async
    def setup():
        u = get_user_model().objects.create_user("erin", password="pw")
        team.members.add(u)
        return u, make_sandbox(team, base_template, node=node)

    user, sb = await setup()
    await async_client.aforce_login(user)
    resp = await async_client.post(f"/dashboard/sandboxes/{sb.id}/kill")
    assert resp.status_code == 302 and resp["Location"] == f"/dashboard/sandboxes/{sb.id}/"
    assert (await Sandbox.objects.aget(pk=sb.id)).state == "killed"
    page = await async_client.get(resp["Location"])
    assert f"Sandbox {sb.id} killed." in page.content.decode()


# --------------------------------------------------------------------------- pause / resume, inline JSON results

JSON = {"HTTP_ACCEPT": "application/json"}


def test_pause_and_resume_through_the_services(dash, mine, nodes_mock):
    resp = dash.post(f"/dashboard/sandboxes/{mine.id}/pause", follow=True)
    assert f"Sandbox {mine.id} paused." in resp.content.decode()
    mine.refresh_from_db()
    assert mine.state == "paused"
    nodes_mock.client.pause_sandbox.assert_awaited_once()
    page = dash.get(f"/dashboard/sandboxes/{mine.id}/").content.decode()
    assert 'data-action="resume"' in page and 'data-action="pause"' not in page
    assert "sandbox is paused: resume it to use the terminal" in page

    resp = dash.post(f"/dashboard/sandboxes/{mine.id}/resume", {"seconds": "900"}, **JSON)
    assert resp.status_code == 200
    assert resp.json() == {"ok": True, "level": "success", "message": f"Sandbox {mine.id} resumed.",
                           "state": "running"}
    mine.refresh_from_db()
    assert mine.state == "running" and mine.envd_port == 40002
    assert mine.end_at > timezone.now() + timedelta(minutes=14)
    ops = list(SandboxEvent.objects.filter(sandbox=mine).order_by("id").values_list("operation", "outcome", "actor"))
    assert ops == [("pause", "started", "dashboard:alice"), ("pause", "ok", "dashboard:alice"),
                   ("resume", "started", "dashboard:alice"), ("resume", "ok", "dashboard:alice")]


def test_wrong_state_gives_the_apis_message_inline(dash, team, base_template, node, nodes_mock):
    paused = make_sandbox(team, base_template, state="paused", node=node)
    resp = dash.post(f"/dashboard/sandboxes/{paused.id}/pause", **JSON)
    assert resp.status_code == 409
    assert resp.json() == {"ok": False, "level": "error",
                           "message": f'Pause failed: sandbox "{paused.id}" is not running (it is paused)'}
    running = make_sandbox(team, base_template, node=node)
    resp = dash.post(f"/dashboard/sandboxes/{running.id}/resume", **JSON)
    assert resp.status_code == 200 and resp.json()["level"] == "info" and "already running" in resp.json()["message"]
    html = dash.post(f"/dashboard/sandboxes/{paused.id}/timeout", {"seconds": "-5"}, follow=True).content.decode()
    assert "message-error" in html and "Timeout not changed" in html
    nodes_mock.client.pause_sandbox.assert_not_awaited()
    nodes_mock.client.resume_sandbox.assert_not_awaited()


def test_node_failure_is_reported_inline(dash, mine, nodes_mock):
    from nodes.client import NodeTaskFailed

    nodes_mock.client.pause_sandbox.side_effect = NodeTaskFailed("disk full", kind="OSError")
    resp = dash.post(f"/dashboard/sandboxes/{mine.id}/pause", **JSON)
    assert resp.status_code == 500 and "disk full" in resp.json()["message"]
    mine.refresh_from_db()
    assert mine.state == "running"  # the node reported the failure, the VM still runs


def test_every_action_is_team_scoped(dash, theirs, nodes_mock):
    for action in ("pause", "resume", "snapshot", "fork", "kill", "timeout"):
        resp = dash.post(f"/dashboard/sandboxes/{theirs.id}/{action}", {"seconds": "60", "count": "1"}, **JSON)
        assert resp.status_code == 404, action
        assert resp.json()["code"] == 404
    assert dash.get(f"/dashboard/api/sandboxes/{theirs.id}.json").status_code == 404
    theirs.refresh_from_db()
    assert theirs.state == "running"
    assert not SandboxEvent.objects.filter(sandbox=theirs).exists()
    nodes_mock.client.pause_sandbox.assert_not_awaited()
    nodes_mock.client.kill_sandbox.assert_not_awaited()


def test_detail_json_changes_with_events(dash, mine, nodes_mock):
    before = dash.get(f"/dashboard/api/sandboxes/{mine.id}.json").json()
    assert before["state"] == "running" and before["id"] == mine.id and before["last_event_id"] is None
    dash.post(f"/dashboard/sandboxes/{mine.id}/pause")
    after = dash.get(f"/dashboard/api/sandboxes/{mine.id}.json").json()
    assert after["state"] == "paused"
    assert after["last_event_id"] == SandboxEvent.objects.filter(sandbox=mine).latest("id").id


# --------------------------------------------------------------------------- create, snapshot, fork, snapshots page


def test_create_from_template_goes_to_the_new_sandbox(dash, team, base_template, nodes_mock):
    resp = dash.post("/dashboard/sandboxes/create", {"template": "base", "seconds": "900", "metadata": "env=ui"})
    sb = Sandbox.objects.get(team=team)
    assert resp.status_code == 302 and resp["Location"] == f"/dashboard/sandboxes/{sb.id}/"
    assert sb.state == "running" and sb.metadata == {"env": "ui"}
    assert SandboxEvent.objects.filter(sandbox=sb, operation="create", actor="dashboard:alice").exists()

    resp = dash.post("/dashboard/sandboxes/create", {"template": "base"}, **JSON)
    assert resp.status_code == 201 and resp.json()["redirect"].startswith("/dashboard/sandboxes/i")


def test_create_errors_are_inline(dash, team, base_template, other_team, nodes_mock):
    from sandboxes.models import Template

    Template.objects.create(id="private", team=other_team, public=False)
    resp = dash.post("/dashboard/sandboxes/create", {"template": "private"}, **JSON)
    assert resp.status_code == 400 and resp.json()["ok"] is False  # the API's answer for an invisible template
    assert resp.json()["message"] == 'Create failed: template "private" not found'
    resp = dash.post("/dashboard/sandboxes/create", {"template": "base", "seconds": "soon"}, **JSON)
    assert resp.status_code == 400
    assert not Sandbox.objects.exists()
    nodes_mock.client.boot_sandbox.assert_not_awaited()


def test_snapshot_and_fork_call_the_snapshot_lifecycle(dash, mine, team):
    from unittest import mock

    from lifecycle.sandboxes.core import Result
    from sandboxes.errors import Conflict, StorageFull
    from lifecycle.snapshots.snapshot import Taken
    from snapshots.models import Snapshot

    snap = Snapshot(id="sabc", team=team, template=mine.template, name="n1")
    child = Sandbox(id="ichild", team=team, template=mine.template, end_at=timezone.now())
    with mock.patch("lifecycle.snapshots.snapshot.create_snapshot", mock.AsyncMock(return_value=Taken(snap))) as create, \
            mock.patch("lifecycle.snapshots.fork.fork_sandbox",
                       mock.AsyncMock(return_value=[Result(child), StorageFull("store full")])) as fork:
        resp = dash.post(f"/dashboard/sandboxes/{mine.id}/snapshot", {"name": "n1"}, **JSON)
        assert resp.status_code == 200 and resp.json()["snapshot"] == "sabc"
        create.assert_awaited_once_with(team, mine.id, name="n1", actor="dashboard:alice")
        resp = dash.post(f"/dashboard/sandboxes/{mine.id}/fork", {"count": "2"}, **JSON)
        body = resp.json()
        assert resp.status_code == 200 and body["level"] == "warning" and body["forks"] == ["ichild"]
        assert "1 failed: store full" in body["message"]
        fork.assert_awaited_once_with(team, mine.id, count=2, actor="dashboard:alice")
        assert dash.post(f"/dashboard/sandboxes/{mine.id}/fork", {"count": "0"}, **JSON).status_code == 400
        create.side_effect = Conflict("sandbox is not running")
        resp = dash.post(f"/dashboard/sandboxes/{mine.id}/snapshot", **JSON)
        assert resp.status_code == 409 and resp.json()["message"] == "Snapshot failed: sandbox is not running"
    page = dash.get(f"/dashboard/sandboxes/{mine.id}/").content.decode()
    assert 'data-action="snapshot"' in page and 'data-action="fork"' in page


def test_snapshots_page_lineage_is_team_scoped(dash, team, other_team, base_template, node):
    from snapshots.models import Snapshot

    parent = make_sandbox(team, base_template, node=node)
    snap = Snapshot.objects.create(team=team, template=base_template, source_sandbox=parent, name="golden",
                                   state="ready", size_bytes=3 * 2**20)
    restored = make_sandbox(team, base_template, node=node, source_snapshot=snap)
    fork = make_sandbox(team, base_template, node=node, forked_from=restored)
    fork_of_parent = make_sandbox(team, base_template, node=node, forked_from=parent)
    hidden = Snapshot.objects.create(team=other_team, template=base_template, name="secret", state="ready")
    html = dash.get("/dashboard/snapshots/").content.decode()
    for thing in (snap.id, "golden", parent.id, restored.id, fork.id, fork_of_parent.id, "3.0\xa0MB"):
        assert thing in html, thing
    assert hidden.id not in html and "secret" not in html
    lineage = html.split("data-lineage")[1]
    # template → snapshot → restored sandbox → its fork, in that order
    assert lineage.index("base") < lineage.index(snap.id) < lineage.index(restored.id) < lineage.index(fork.id)
    assert 'value="%s"' % snap.id in html  # "New sandbox" from it
    detail = dash.get(f"/dashboard/sandboxes/{restored.id}/").content.decode()
    assert snap.id in detail and fork.id in detail
    assert parent.id in dash.get(f"/dashboard/sandboxes/{fork_of_parent.id}/").content.decode()


def test_delete_snapshot_inline_result_and_team_scope(dash, team, other_team, base_template, node, nodes_mock):
    from unittest import mock

    from snapshots.models import Snapshot

    snap = Snapshot.objects.create(team=team, template=base_template, node=node, name="old", state="ready")
    in_use = Snapshot.objects.create(team=team, template=base_template, node=node, name="used", state="ready")
    make_sandbox(team, base_template, node=node, source_snapshot=in_use)
    theirs = Snapshot.objects.create(team=other_team, template=base_template, node=node, state="ready")
    nodes_mock.client.delete_snapshot_files = mock.AsyncMock(return_value={"deleted": True})

    resp = dash.post(f"/dashboard/snapshots/{in_use.id}/delete", **JSON)
    assert resp.status_code == 409 and resp.json()["message"].startswith("Delete failed: ")
    assert Snapshot.objects.filter(pk=in_use.pk, state="ready").exists()

    resp = dash.post(f"/dashboard/snapshots/{theirs.id}/delete", **JSON)
    assert resp.status_code == 404
    assert Snapshot.objects.filter(pk=theirs.pk).exists()

    resp = dash.post(f"/dashboard/snapshots/{snap.id}/delete", follow=True)
    assert f"Snapshot {snap.id} deleted." in resp.content.decode()
    assert not Snapshot.objects.filter(pk=snap.pk).exists()
    nodes_mock.client.delete_snapshot_files.assert_awaited_once()
