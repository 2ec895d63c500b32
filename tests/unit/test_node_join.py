"""Joining nodes with operator-issued join tokens (issue 23, item 1): tokens (single use,
expiring, revocable, hashed), POST /nodes/join and /nodes/check-in, the node worker's side
(agent.join, the same function run_node calls), revocation (placement, nodes.client, the
heartbeat and registration all refuse a revoked node), the commands, the operator-only API
and the dashboard's nodes page."""
import json
import os
import stat
from datetime import timedelta

import httpx
import pytest
from asgiref.sync import sync_to_async
from django.core.management import call_command
from django.core.management.base import CommandError
from django.core.wsgi import get_wsgi_application
from django.utils import timezone

from agent import join as node_side
from agent.heartbeat import Heartbeat, beat, register_node
from config.log_redaction import redact
from nodes import client, join
from nodes.models import Node, NodeJoinToken
from nodes.placement import NoNodeAvailable, place

pytestmark = pytest.mark.django_db(transaction=True)

ADMIN_TOKEN = "op-" + "j" * 40


@pytest.fixture
def control_plane(settings, tmp_path):
    """The node's settings for joining: a control plane URL, its own AENV_HOME."""
    settings.AENV_CONTROL_PLANE_URL = "http://control.test"
    settings.AENV_NODE_JOIN_REQUIRED = True
    settings.AENV_NODE_JOIN_TOKEN = ""
    settings.AENV_HOME = tmp_path
    return settings


@pytest.fixture
def http():
    """A sync client on the real app (what agent.join posts with), not a double."""
    with httpx.Client(transport=httpx.WSGITransport(app=get_wsgi_application()),
                      base_url="http://control.test") as c:
        yield c


@pytest.fixture
async def admin(asgi_app, settings):
    settings.AENV_ADMIN_TOKEN = ADMIN_TOKEN
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi_app), base_url="http://testserver",
                                 headers={"X-Admin-Token": ADMIN_TOKEN}, timeout=30) as c:
        yield c


def _register(node_id: str) -> Node:
    return register_node(node_id=node_id, address="10.0.0.9", driver_name="fake", accel="tcg", vcpu_capacity=8,
                         memory_mb_capacity=4096)


def _start_node(node_id: str, http: httpx.Client) -> Node:
    """What run_node does before serving: join (or check in), then register."""
    node_side.ensure_joined(node_id, wait=0, http=http)
    return _register(node_id)


# --- tokens and joining ------------------------------------------------------

def test_token_is_stored_hashed_with_a_visible_prefix(db, settings):
    settings.AENV_NODE_JOIN_TOKEN_TTL = 3600
    token, raw = join.create_token(created_by="test")
    assert raw.startswith("aenv_join_") and len(raw) == len("aenv_join_") + 48
    assert token.prefix == raw[:18] and token.token_hash == join.hash_secret(raw) and raw not in token.token_hash
    assert abs((token.expires_at - timezone.now()).total_seconds() - 3600) < 5
    assert token.state() == "active"
    assert join.parse_ttl("24h") == 86400 and join.parse_ttl("90") == 90 and join.parse_ttl("7d") == 7 * 86400
    for bad in ("soon", "10", "31d", "-5m"):
        with pytest.raises(join.Invalid):
            join.parse_ttl(bad)


def test_join_secrets_never_reach_a_log(db):
    _, raw = join.create_token()
    credential = join.CREDENTIAL_MARK + "0f" * 32
    text = redact(f"joining with {raw} then {credential}.")
    assert raw not in text and credential not in text and text.count("[redacted]") == 2


def test_node_joins_through_the_api_and_stores_its_credential_0600(control_plane, http):
    token, raw = join.create_token()
    control_plane.AENV_NODE_JOIN_TOKEN = raw
    node = _start_node("node-7", http)
    path = control_plane.AENV_HOME / "node_credential"
    saved = json.loads(path.read_text())
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert saved["nodeId"] == "node-7" and saved["credential"].startswith("aenv_node_")
    node.refresh_from_db()
    assert node.credential_hash == join.hash_secret(saved["credential"]) and node.joined_via_id == token.pk
    token.refresh_from_db()
    assert token.state() == "used" and token.used_by == "node-7"
    # the next start checks in with the stored credential; the spent token is not needed
    control_plane.AENV_NODE_JOIN_TOKEN = ""
    assert node_side.ensure_joined("node-7", wait=0, http=http) == saved["credential"]
    # and the token cannot be spent again
    resp = http.post("/nodes/join", json={"nodeId": "node-8"}, headers={"Authorization": f"Bearer {raw}"})
    assert resp.status_code == 403 and resp.json()["error_code"] == "join_token_used"


def test_a_node_with_a_revoked_token_cannot_register(control_plane, http):
    """The required test: through the function run_node calls before registering."""
    token, raw = join.create_token()
    join.revoke_token(token.prefix)
    control_plane.AENV_NODE_JOIN_TOKEN = raw
    with pytest.raises(node_side.NodeNotAdmitted, match="join token .* is revoked"):
        _start_node("node-7", http)
    assert not Node.objects.filter(pk="node-7").exists()
    assert not (control_plane.AENV_HOME / "node_credential").exists()


def test_run_node_exits_with_the_control_planes_message(control_plane, http, monkeypatch):
    token, raw = join.create_token()
    join.revoke_token(token.prefix)
    control_plane.AENV_NODE_JOIN_TOKEN = raw
    control_plane.AENV_NODE_ID = "node-7"
    real = node_side.ensure_joined
    monkeypatch.setattr("agent.worker.ensure_joined", lambda node_id: real(node_id, wait=0, http=http))
    monkeypatch.setattr("agent.worker.get_driver", lambda: pytest.fail("the node must stop before its driver"))
    with pytest.raises(CommandError, match="node node-7 not started: .*403.*revoked"):
        call_command("run_node")


def test_no_token_and_no_credential_refuses_to_start(control_plane, http):
    with pytest.raises(node_side.NodeNotAdmitted, match="has not joined: set AENV_NODE_JOIN_TOKEN"):
        node_side.ensure_joined("node-7", wait=0, http=http)
    control_plane.AENV_CONTROL_PLANE_URL = ""
    with pytest.raises(node_side.NodeNotAdmitted, match="needs AENV_CONTROL_PLANE_URL"):
        node_side.ensure_joined("node-7", wait=0, http=http)


def test_single_machine_default_does_not_join(settings):
    settings.AENV_NODE_JOIN_REQUIRED = False
    settings.AENV_NODE_JOIN_TOKEN = ""
    assert node_side.ensure_joined("node-1", wait=0) is None


def test_join_answers(control_plane, http, assert_error):
    def post(raw, node_id="node-7"):
        return http.post("/nodes/join", json={"nodeId": node_id}, headers={"Authorization": f"Bearer {raw}"})

    assert_error(http.post("/nodes/join", json={}), 401, "Bearer")
    assert_error(post("aenv_join_" + "0" * 48), 401, "unknown join token")
    assert_error(post("something-else"), 401, "unknown join token")
    expired, raw_expired = join.create_token()
    NodeJoinToken.objects.filter(pk=expired.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert assert_error(post(raw_expired), 403, "expired")["error_code"] == "join_token_expired"
    _, bound = join.create_token(node_id="node-9")
    assert assert_error(post(bound), 403, "is for node node-9")["error_code"] == "join_token_other_node"
    _, any_id = join.create_token()
    assert_error(post(any_id, node_id="Bad Id"), 400, "node id")
    assert_error(post(any_id, node_id="join-tokens"), 400, "reserved")
    assert_error(http.post("/nodes/join", json={}, headers={"Authorization": f"Bearer {any_id}"}), 400, "node id")
    ok = post(bound, node_id="")  # the id the token is for
    assert ok.status_code == 200 and ok.json()["nodeId"] == "node-9" and ok.headers["Cache-Control"] == "no-store"
    # an unbound token cannot take over a node that has joined (its credential would be replaced)
    assert assert_error(post(any_id, node_id="node-9"), 403, "has joined already")["error_code"] == \
        "node_already_joined"
    # check-in: the credential, for its own id only
    credential = ok.json()["credential"]
    assert http.post("/nodes/check-in", json={"nodeId": "node-9"},
                     headers={"Authorization": f"Bearer {credential}"}).json() == {"nodeId": "node-9"}
    assert_error(http.post("/nodes/check-in", json={"nodeId": "node-1"},
                           headers={"Authorization": f"Bearer {credential}"}), 403, "not node-1")
    assert_error(http.post("/nodes/check-in", json={}, headers={"Authorization": "Bearer aenv_node_x"}), 401,
                 "unknown node credential")


# --- revocation --------------------------------------------------------------

def _joined(node_id: str) -> tuple[Node, str]:
    _, raw = join.create_token(node_id=node_id)
    node, credential = join.join(raw)
    _register(node_id)
    node.refresh_from_db()
    return node, credential


def test_revoked_node_cannot_register_or_beat_and_is_not_revived(db):
    node, _ = _joined("node-5")
    before = node.last_heartbeat_at
    revoked = join.revoke_node("node-5")
    assert revoked.revoked_at is not None and revoked.draining
    with pytest.raises(join.NodeRevoked, match="node node-5 was revoked"):
        _register("node-5")
    with pytest.raises(join.NodeRevoked):
        beat("node-5", lambda: 3)
    node.refresh_from_db()
    assert node.last_heartbeat_at == before and node.sandboxes_running == 0 and node.revoked_at is not None
    # the heartbeat thread stops and tells the worker (which stops itself)
    told = []
    heartbeat = Heartbeat("node-5", 60, lambda: 0, on_revoked=told.append)
    heartbeat.round()
    assert len(told) == 1 and isinstance(told[0], join.NodeRevoked) and heartbeat._stopped.is_set()


def test_revoked_node_rejoins_only_with_a_new_token_issued_for_it(control_plane, http):
    _, raw = join.create_token()
    control_plane.AENV_NODE_JOIN_TOKEN = raw
    _start_node("node-5", http)
    _, unbound = join.create_token()
    _, bound_before = join.create_token(node_id="node-5")
    join.revoke_node("node-5")
    # its stored credential is refused at the next start: 403 revoked
    control_plane.AENV_NODE_JOIN_TOKEN = ""
    with pytest.raises(node_side.NodeNotAdmitted, match="403.*revoked"):
        node_side.ensure_joined("node-5", wait=0, http=http)
    # neither an unbound token nor one issued before the revocation (revoked with it) re-admits it
    with pytest.raises(join.NodeRevoked):
        join.join(unbound, "node-5")
    with pytest.raises(join.JoinRefused, match="revoked"):
        join.join(bound_before, "node-5")
    _, bound_after = join.create_token(node_id="node-5")
    control_plane.AENV_NODE_JOIN_TOKEN = bound_after
    node = _start_node("node-5", http)  # the refused credential, then the new token
    assert node.revoked_at is None and not node.draining


async def test_placement_skips_a_revoked_node_and_sends_it_nothing(db):
    node, _ = await sync_to_async(_joined)("node-5")
    assert (await place(1, 128)).pk == "node-5"
    await sync_to_async(join.revoke_node)("node-5")
    # even if it writes its heartbeat and undrains itself with its database access
    await Node.objects.filter(pk="node-5").aupdate(last_heartbeat_at=timezone.now(), draining=False)
    with pytest.raises(NoNodeAvailable):
        await place(1, 128)
    with pytest.raises(NoNodeAvailable, match="revoked"):
        await place(1, 128, on=node)
    with pytest.raises(client.NodeRefused, match="node node-5 was revoked .*no task is sent"):
        await client.kill_sandbox(node, sandbox_id="i" * 20, deadline=1)
    with pytest.raises(client.NodeRefused):
        await client.build_template(node, build_id="b", template_id="t", spec={}, cpu_count=1, memory_mb=128,
                                    disk_size_mb=1024)


async def test_join_required_leaves_nodes_that_never_joined_alone(settings):
    settings.AENV_NODE_JOIN_REQUIRED = True
    stray = await Node.objects.acreate(id="stray", address="x", vcpu_capacity=8, memory_mb_capacity=4096,
                                       last_heartbeat_at=timezone.now())
    with pytest.raises(NoNodeAvailable):
        await place(1, 128)
    with pytest.raises(client.NodeRefused, match="never joined"):
        await client.kill_sandbox(stray, sandbox_id="i" * 20, deadline=1)
    settings.AENV_NODE_JOIN_REQUIRED = False  # the single-machine default: the node's own row suffices
    assert (await place(1, 128)).pk == "stray"


# --- commands ----------------------------------------------------------------

def test_commands_create_list_revoke(db, capsys):
    call_command("node_tokens", "create", "--node-id", "node-4", "--ttl", "2h")
    raw = capsys.readouterr().out.strip()
    assert raw.startswith("aenv_join_")
    token = NodeJoinToken.objects.get()
    assert token.token_hash == join.hash_secret(raw) and token.node_id == "node-4" and token.created_by == "manage.py"
    call_command("node_tokens", "list")
    listed = capsys.readouterr().out
    assert token.prefix in listed and "node-4" in listed and "active" in listed and raw not in listed
    call_command("node_tokens", "revoke", token.prefix)
    assert "revoked" in capsys.readouterr().out
    call_command("node_tokens", "list")
    assert "revoked" in capsys.readouterr().out
    with pytest.raises(CommandError, match="no join token"):
        call_command("node_tokens", "revoke", "aenv_join_ffffffff")
    with pytest.raises(CommandError, match="ttl"):
        call_command("node_tokens", "create", "--ttl", "forever")
    _joined("node-4b")
    call_command("revoke_node", "node-4b")
    assert "node node-4b revoked" in capsys.readouterr().out
    assert Node.objects.get(pk="node-4b").revoked_at is not None
    with pytest.raises(CommandError, match="not found"):
        call_command("revoke_node", "nope")


# --- the operators' API ------------------------------------------------------

async def test_operator_api_creates_lists_and_revokes(admin, assert_error):
    created = await admin.post("/nodes/join-tokens", json={"nodeId": "node-3", "ttl": "1h"})
    assert created.status_code == 201, created.text
    body = created.json()
    assert body["token"].startswith(body["prefix"]) and body["nodeId"] == "node-3" and body["state"] == "active"
    assert created.headers["Cache-Control"] == "no-store"
    listed = (await admin.get("/nodes/join-tokens")).json()
    assert [t["prefix"] for t in listed] == [body["prefix"]] and "token" not in listed[0]
    assert (await admin.delete(f"/nodes/join-tokens/{body['prefix']}")).status_code == 204
    assert (await admin.get("/nodes/join-tokens")).json()[0]["state"] == "revoked"
    assert_error(await admin.delete("/nodes/join-tokens/aenv_join_00000000"), 404, "no join token")
    assert_error(await admin.post("/nodes/join-tokens", json={"ttl": "1y"}), 400, "ttl")
    await sync_to_async(_joined)("node-3b")
    revoked = await admin.post("/nodes/node-3b/revoke")
    assert revoked.status_code == 200 and revoked.json()["nodeId"] == "node-3b" and revoked.json()["revokedAt"]
    assert_error(await admin.post("/nodes/nope/revoke"), 404, "not found")
    # GET /nodes/{id} still answers (the joining routes are matched before it), saying so
    detail = await admin.get("/nodes/node-3b")
    assert detail.status_code == 200 and detail.json()["revokedAt"] == revoked.json()["revokedAt"]


async def test_a_tenant_key_cannot_manage_tokens_or_revoke(api, anon, node, assert_error):
    assert_error(await api.post("/nodes/join-tokens", json={}), 403, "operators")
    assert_error(await api.get("/nodes/join-tokens"), 403, "operators")
    assert_error(await api.delete("/nodes/join-tokens/aenv_join_00000000"), 403, "operators")
    assert_error(await api.post(f"/nodes/{node.pk}/revoke"), 403, "operators")
    assert_error(await anon.post("/nodes/join-tokens", json={}), 401)
    assert not await NodeJoinToken.objects.aexists()
    assert (await Node.objects.aget(pk=node.pk)).revoked_at is None


# --- the dashboard -----------------------------------------------------------

def test_dashboard_nodes_page_operator_section(dash, user, node):
    page = dash.get("/dashboard/nodes/").content.decode()
    assert "Join tokens" not in page  # not staff: no operator section
    assert dash.post("/dashboard/nodes/join-tokens/create", {"node_id": "", "ttl": "24h"}).status_code == 403
    assert dash.post(f"/dashboard/nodes/{node.pk}/revoke").status_code == 403
    assert not NodeJoinToken.objects.exists()
    user.is_staff = True
    user.save()
    created = dash.post("/dashboard/nodes/join-tokens/create", {"node_id": "node-6", "ttl": "1h"})
    assert created.status_code == 200 and created["Cache-Control"] == "no-store"
    token = NodeJoinToken.objects.get()
    raw = created.content.decode().split('data-secret>')[1].split("<")[0]
    assert token.token_hash == join.hash_secret(raw) and token.node_id == "node-6"
    assert token.created_by == "dashboard:alice"
    page = dash.get("/dashboard/nodes/").content.decode()
    assert "Join tokens" in page and token.prefix in page and "node-6" in page and raw not in page
    bad = dash.post("/dashboard/nodes/join-tokens/create", {"node_id": "Bad Id", "ttl": "1h"}, follow=True)
    assert "node id" in bad.content.decode()
    assert dash.post(f"/dashboard/nodes/join-tokens/{token.prefix}/revoke").status_code == 302
    token.refresh_from_db()
    assert token.state() == "revoked"
    assert dash.post(f"/dashboard/nodes/{node.pk}/revoke").status_code == 302
    assert Node.objects.get(pk=node.pk).revoked_at is not None
    page = dash.get("/dashboard/nodes/").content.decode()
    assert ">revoked</span>" in page
