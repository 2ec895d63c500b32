"""The Django admin for every model: changelists render with their search, filters and
computed columns for a superuser (on SQLite and PostgreSQL), secrets never show, the
node drain switch works, and non-staff users (dashboard users) are kept out."""
from datetime import timedelta

import pytest
from django.contrib import admin
from django.contrib.auth import get_user_model
from django.utils import timezone

from nodes.models import Node
from sandboxes.models import ApiKey, Sandbox, SandboxEvent, Team, Template
from snapshots.models import Snapshot

pytestmark = pytest.mark.django_db


@pytest.fixture
def data(client):
    root = get_user_model().objects.create_superuser("root", "root@example.com", "pw")
    client.force_login(root)
    team = Team.objects.create(name="Acme", slug="acme")
    team.members.add(root)
    tpl = Template.objects.create(id="base")
    alive = Node.objects.create(id="n-alive", address="10.0.0.1", vcpu_capacity=8, memory_mb_capacity=8192,
                                last_heartbeat_at=timezone.now())
    stale = Node.objects.create(id="n-stale", address="10.0.0.2", last_heartbeat_at=timezone.now() - timedelta(hours=1))
    parent = Sandbox.objects.create(team=team, template=tpl, node=alive, state="running", metadata={"env": "prod"},
                                    end_at=timezone.now() + timedelta(minutes=5), envd_access_token="tok-secret-1")
    snap = Snapshot.objects.create(team=team, template=tpl, source_sandbox=parent, node=alive, name="golden",
                                   state="ready", envd_access_token="tok-secret-2")
    restored = Sandbox.objects.create(team=team, template=tpl, node=alive, state="running", source_snapshot=snap,
                                      end_at=timezone.now())
    fork = Sandbox.objects.create(team=team, template=tpl, node=alive, state="paused", forked_from=parent,
                                  end_at=timezone.now())
    SandboxEvent.objects.create(sandbox=parent, operation="create", to_state="running")
    key, raw = ApiKey.generate(team)
    return {"client": client, "team": team, "alive": alive, "stale": stale, "parent": parent, "snap": snap,
            "restored": restored, "fork": fork, "raw": raw}


def test_every_model_is_registered():
    from django.apps import apps

    ours = [m for m in apps.get_models() if m._meta.app_label in ("sandboxes", "nodes", "snapshots")]
    assert ours and all(admin.site.is_registered(m) for m in ours), [m for m in ours if not admin.site.is_registered(m)]


@pytest.mark.parametrize("url", [
    "/admin/nodes/node/", "/admin/nodes/node/?q=10.0.0", "/admin/nodes/node/?alive=yes", "/admin/nodes/node/?alive=no",
    "/admin/nodes/node/?draining__exact=1", "/admin/nodes/node/?o=5",
    "/admin/sandboxes/sandbox/?q=golden", "/admin/sandboxes/sandbox/?q=prod",
    "/admin/sandboxes/sandbox/?source_snapshot__isempty=0", "/admin/sandboxes/sandbox/?forked_from__isempty=0",
    "/admin/sandboxes/sandboxevent/?to_state=running", "/admin/sandboxes/team/?q=root",
    "/admin/snapshots/snapshot/?q=golden", "/admin/auth/user/",
])
def test_changelists_with_search_and_filters_render(data, url):
    resp = data["client"].get(url)
    assert resp.status_code == 200, url
    assert "errornote" not in resp.content.decode()


def test_list_columns_show_lineage_and_liveness(data):
    c = data["client"]
    html = c.get("/admin/sandboxes/sandbox/").content.decode()
    assert f"snapshot {data['snap'].id}" in html and f"fork of {data['parent'].id}" in html
    only_forks = c.get("/admin/sandboxes/sandbox/?forked_from__isempty=0").content.decode()
    assert data["fork"].id in only_forks and data["restored"].id not in only_forks
    by_meta = c.get("/admin/sandboxes/sandbox/?q=prod").content.decode()
    assert data["parent"].id in by_meta and data["fork"].id not in by_meta
    alive_only = c.get("/admin/nodes/node/?alive=yes").content.decode()
    assert "n-alive" in alive_only and "n-stale" not in alive_only
    nodes = c.get("/admin/nodes/node/").content.decode()
    assert 'alt="True"' in nodes and 'alt="False"' in nodes  # the alive column


def test_change_pages_never_show_secrets(data):
    c = data["client"]
    for url in (f"/admin/sandboxes/sandbox/{data['parent'].pk}/change/",
                f"/admin/snapshots/snapshot/{data['snap'].pk}/change/", f"/admin/nodes/node/{data['alive'].pk}/change/"):
        page = c.get(url)
        body = page.content.decode()
        assert page.status_code == 200, url
        assert "tok-secret" not in body and data["raw"] not in body


def test_drain_action_and_nodes_cannot_be_added(data):
    c = data["client"]
    resp = c.post("/admin/nodes/node/", {"action": "drain", "index": "0", "_selected_action": ["n-alive", "n-stale"]})
    assert resp.status_code == 302
    assert Node.objects.filter(draining=True).count() == 2
    c.post("/admin/nodes/node/", {"action": "undrain", "index": "0", "_selected_action": ["n-stale"]})
    assert list(Node.objects.filter(draining=True).values_list("id", flat=True)) == ["n-alive"]
    assert c.get("/admin/nodes/node/add/").status_code == 403


def test_dashboard_users_are_kept_out_of_the_admin(client, data):
    user = get_user_model().objects.create_user("dash", password="pw")
    data["team"].members.add(user)
    client.force_login(user)
    resp = client.get("/admin/nodes/node/")
    assert resp.status_code == 302 and "/admin/login/" in resp["Location"]
