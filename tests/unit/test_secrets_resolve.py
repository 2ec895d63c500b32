"""The nodes' POST /nodes/secrets/resolve: which node may have which value, for which sandbox
and host (team_secrets.resolve, nodes.node_auth)."""
import httpx
import pytest
from asgiref.sync import sync_to_async
from django.conf import settings as django_settings
from django.utils import timezone

from nodes import join, node_auth
from nodes.models import Node
from sandboxes.models import Sandbox
from team_secrets import resolve, store

pytestmark = pytest.mark.django_db(transaction=True)

VALUE = "ghp_0123456789-secret-VALUE"
RULES = {"api.github.com": [{"transform": {"headers": {"Authorization": "token ${e2b.secrets.GH}"}}}],
         "*.example.com": [{"transform": {"headers": {"X-Key": "${e2b.secrets.gh}", "X-Other": "plain"}}}],
         "10.1.0.0/16": [{"transform": {"headers": {"X-Key": "${e2b.secrets.gh}"}}}],
         "other.test": [{"transform": {"headers": {"X-Key": "${e2b.secrets.unrelated}"}}}]}


@pytest.mark.parametrize("pattern, host, ok", [
    ("api.github.com", "api.github.com", True), ("api.github.com", "API.GitHub.com.", True),
    ("api.github.com", "api.github.com:443", True), ("api.github.com", "github.com", False),
    ("api.github.com", "evil-api.github.com", False), ("*.example.com", "a.b.example.com", True),
    ("*.example.com", "example.com", False), ("*.example.com", "badexample.com", False),
    ("10.1.0.0/16", "10.1.2.3", True), ("10.1.0.0/16", "10.2.0.1", False), ("1.2.3.4", "1.2.3.4", True),
    ("api.github.com", "", False), ("*", "any.example.org", True), ("*", "10.0.0.1", False),
    ("10.1.0.0/16", "api.github.com", False), ("not a pattern!", "x.com", False),
])
def test_host_patterns(pattern, host, ok):
    assert resolve.host_matches(pattern, host) is ok


def test_markers_and_allowed_hosts():
    assert resolve.names_in("a ${e2b.secrets.X} b ${e2b.secrets.y-2} ${e2b.secrets.}") == {"x", "y-2"}
    assert resolve.marker("gh") == "${e2b.secrets.gh}"
    assert sorted(resolve.allowed_hosts({"rules": RULES}, "GH")) == ["*.example.com", "10.1.0.0/16", "api.github.com"]
    assert resolve.allowed_hosts({"rules": RULES}, "nope") == []
    assert resolve.allowed_hosts(None, "gh") == [] and resolve.allowed_hosts({"rules": "junk"}, "gh") == []
    assert resolve.allowed_hosts({"rules": {"h": ["junk", {"transform": "x"}]}}, "gh") == []


@pytest.fixture
def setup(team, other_team, base_template, node):
    other_node = Node.objects.create(id="n2", address="127.0.0.2", vcpu_capacity=8, memory_mb_capacity=8192,
                                     last_heartbeat_at=timezone.now())
    store.create(team, "gh", VALUE)
    store.create(other_team, "theirs", "not yours")
    end = timezone.now() + timezone.timedelta(hours=1)
    sandbox = Sandbox.objects.create(team=team, template=base_template, node=node, state="running", end_at=end,
                                     network={"rules": {**RULES, "x.test": [{"transform": {"headers": {
                                         "X": "${e2b.secrets.theirs}"}}}]}})
    return sandbox, node, other_node


def _headers(node_id: str) -> dict:
    return {"Authorization": f"Bearer {node_auth.derived_token(django_settings.SECRET_KEY, node_id)}",
            node_auth.NODE_HEADER: node_id}


async def _ask(app, headers, route: str = "/nodes/secrets/resolve", **body) -> httpx.Response:
    """A node's POST to one of its resolve routes (``headers``: whose, see ``_headers``)."""
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as c:
        return await c.post(route, json=body, headers=headers)


async def test_the_sandboxs_node_gets_the_value_for_an_allowed_host(asgi_app, setup):
    sandbox, node, _ = setup
    for host in ("api.github.com", "deep.sub.example.com", "10.1.9.9"):
        resp = await _ask(asgi_app, _headers(node.pk), sandboxID=sandbox.pk, name="GH", host=host)
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["value"] == VALUE and body["version"] == 1 and body["secretID"].startswith("sec_")
        assert body["ttl"] == django_settings.AENV_EGRESS_SECRET_CACHE_TTL
        assert resp.headers["cache-control"] == "no-store"


async def test_a_new_version_is_what_the_node_gets_next(asgi_app, setup, team):
    sandbox, node, _ = setup
    await sync_to_async(store.update)(team, "gh", "rotated")
    body = (await _ask(asgi_app, _headers(node.pk), sandboxID=sandbox.pk, name="gh", host="api.github.com")).json()
    assert (body["value"], body["version"]) == ("rotated", 2)


@pytest.mark.parametrize("name, host, status", [
    ("gh", "github.com", 403),            # no rule for that host
    ("gh", "example.com", 403),           # the wildcard is for names below it only
    ("gh", "other.test", 403),            # that host's rule carries another secret
    ("unrelated", "other.test", 404),     # named by a rule, but the team has no such secret
    ("theirs", "x.test", 404),            # another team's secret, even if the rules name it
])
async def test_refusals(asgi_app, setup, assert_error, name, host, status):
    sandbox, node, _ = setup
    body = assert_error(await _ask(asgi_app, _headers(node.pk), sandboxID=sandbox.pk, name=name, host=host), status)
    assert VALUE not in body["message"]


async def test_another_node_or_a_stopped_sandbox_gets_nothing(asgi_app, setup, assert_error):
    sandbox, node, other_node = setup
    assert_error(await _ask(asgi_app, _headers(other_node.pk), sandboxID=sandbox.pk, name="gh",
                            host="api.github.com"), 404, "no live sandbox")
    for state in ("paused", "killed", "error"):
        await Sandbox.objects.filter(pk=sandbox.pk).aupdate(state=state)
        assert_error(await _ask(asgi_app, _headers(node.pk), sandboxID=sandbox.pk, name="gh", host="api.github.com"),
                     404)
    assert_error(await _ask(asgi_app, _headers(node.pk), sandboxID="inope", name="gh", host="api.github.com"), 404)


async def test_who_may_ask(asgi_app, setup, raw_key, assert_error):
    sandbox, node, _ = setup
    body = {"sandboxID": sandbox.pk, "name": "gh", "host": "api.github.com"}
    assert_error(await _ask(asgi_app, {}, **body), 401)
    assert_error(await _ask(asgi_app, {"X-API-Key": raw_key}, **body), 401)  # a team's key is no node
    assert_error(await _ask(asgi_app, {"Authorization": f"Bearer {raw_key}"}, **body), 401)
    assert_error(await _ask(asgi_app, {**_headers(node.pk), node_auth.NODE_HEADER: "n2"}, **body), 401)
    assert_error(await _ask(asgi_app, {"Authorization": _headers(node.pk)["Authorization"]}, **body), 401)
    assert_error(await _ask(asgi_app, _headers("ghost"), **body), 401)


async def test_a_joined_node_uses_its_credential_and_revocation_ends_it(asgi_app, setup, assert_error):
    sandbox, node, _ = setup
    token, raw = await sync_to_async(join.create_token)(node_id=node.pk)
    _, credential = await sync_to_async(join.join)(raw, node.pk)
    body = {"sandboxID": sandbox.pk, "name": "gh", "host": "api.github.com"}
    ok = await _ask(asgi_app, {"Authorization": f"Bearer {credential}"}, **body)
    assert ok.status_code == 200 and ok.json()["value"] == VALUE
    assert_error(await _ask(asgi_app, _headers(node.pk), **body), 403, "credential")  # the derived token no longer
    assert_error(await _ask(asgi_app, {"Authorization": f"Bearer {credential}", node_auth.NODE_HEADER: "n2"},
                            **body), 403)
    await sync_to_async(join.revoke_node)(node.pk)
    assert_error(await _ask(asgi_app, {"Authorization": f"Bearer {credential}"}, **body), 403, "revoked")


async def test_derived_tokens_are_refused_where_joining_is_required(asgi_app, setup, settings, assert_error):
    sandbox, node, _ = setup
    settings.AENV_NODE_JOIN_REQUIRED = True
    assert_error(await _ask(asgi_app, _headers(node.pk), sandboxID=sandbox.pk, name="gh", host="api.github.com"),
                 403, "never joined")


async def test_bad_bodies_are_400(asgi_app, setup, assert_error):
    _, node, _ = setup
    assert_error(await _ask(asgi_app, _headers(node.pk), name="gh", host="h"), 400)
    assert_error(await _ask(asgi_app, _headers(node.pk), sandboxID="x", name="gh", host="h" * 300), 400)


def test_derived_tokens_differ_per_node_and_key():
    a = node_auth.derived_token("key-one", "n1")
    assert a != node_auth.derived_token("key-one", "n2") != node_auth.derived_token("key-two", "n1")
    assert len(a) == 64 and "key-one" not in a
    with pytest.raises(ValueError):
        node_auth.derived_token("", "n1")
