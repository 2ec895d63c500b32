"""The node's secret resolver (agent.egress_secrets): what it sends, what it keeps and for how
long, what it refuses; and the whole path through the real API on a live server."""
import httpx
import pytest
from django.conf import settings as django_settings
from django.utils import timezone

from agent import egress_secrets
from nodes import node_auth


class FakeApi:
    def __init__(self):
        self.calls, self.value, self.status, self.ttl = [], "v1", 200, 60

    def __call__(self, request: httpx.Request) -> httpx.Response:
        import json  # noqa: PLC0415

        self.calls.append((request.url.path, dict(request.headers), json.loads(request.content)))
        if self.status != 200:
            return httpx.Response(self.status, json={"code": self.status, "message": "no"})
        return httpx.Response(200, json={"value": self.value, "version": 1, "secretID": "sec_x", "ttl": self.ttl})


@pytest.fixture
def fake():
    api, now = FakeApi(), [0.0]
    client = egress_secrets.SecretResolver("http://cp:3000/", {"Authorization": "Bearer t"},
                                           http=httpx.Client(transport=httpx.MockTransport(api)), clock=lambda: now[0])
    return api, client, now


def test_asks_once_then_serves_from_memory_until_the_ttl(fake):
    api, client, now = fake
    assert client.value("i1", "GH", "API.github.com.") == "v1"
    path, headers, body = api.calls[0]
    assert path == "/nodes/secrets/resolve" and headers["authorization"] == "Bearer t"
    assert body == {"sandboxID": "i1", "name": "GH", "host": "API.github.com."}
    api.value = "v2"
    assert client.value("i1", "gh", "api.github.com") == "v1" and len(api.calls) == 1
    now[0] = 61
    assert client.value("i1", "gh", "api.github.com") == "v2" and len(api.calls) == 2
    assert client.value("i2", "gh", "api.github.com") == "v2" and len(api.calls) == 3  # per sandbox
    client.forget("i1")
    assert client.cached() == 1


def test_fill_headers_replaces_every_marker(fake):
    api, client, _ = fake
    filled = client.fill_headers("i1", "h", {"Authorization": "Bearer ${e2b.secrets.a}", "X": "${e2b.secrets.a}-x",
                                             "Y": "plain"})
    assert filled == {"Authorization": "Bearer v1", "X": "v1-x", "Y": "plain"} and len(api.calls) == 1


@pytest.mark.parametrize("status", [401, 403, 404])
def test_refusals_raise_and_are_not_kept(fake, status):
    api, client, _ = fake
    api.status = status
    with pytest.raises(egress_secrets.SecretRefused) as info:
        client.value("i1", "gh", "h")
    assert info.value.status == status
    api.status = 200
    assert client.value("i1", "gh", "h") == "v1"


def test_an_api_that_cannot_answer_is_unavailable(fake):
    api, client, _ = fake
    api.status = 503
    with pytest.raises(egress_secrets.SecretUnavailable):
        client.value("i1", "gh", "h")

    def down(request):
        raise httpx.ConnectError("refused")

    broken = egress_secrets.SecretResolver("http://cp", {}, http=httpx.Client(transport=httpx.MockTransport(down)))
    with pytest.raises(egress_secrets.SecretUnavailable, match="cannot be asked"):
        broken.value("i1", "gh", "h")


def test_node_headers():
    assert egress_secrets.node_headers("n1", "aenv_node_x", "k") == {"Authorization": "Bearer aenv_node_x"}
    derived = egress_secrets.node_headers("n1", None, "k")
    assert derived == {"Authorization": f"Bearer {node_auth.derived_token('k', 'n1')}", node_auth.NODE_HEADER: "n1"}


@pytest.mark.django_db(transaction=True)
def test_through_the_real_api(live_server, team, base_template, node):
    from sandboxes.models import Sandbox  # noqa: PLC0415
    from team_secrets import store  # noqa: PLC0415

    store.create(team, "gh", "the-token")
    rules = {"api.github.com": [{"transform": {"headers": {"Authorization": "token ${e2b.secrets.gh}"}}}]}
    sandbox = Sandbox.objects.create(team=team, template=base_template, node=node, state="running",
                                     end_at=timezone.now() + timezone.timedelta(hours=1), network={"rules": rules})
    client = egress_secrets.SecretResolver(live_server.url,
                                           egress_secrets.node_headers(node.pk, None, django_settings.SECRET_KEY))
    assert client.fill_headers(sandbox.pk, "api.github.com", rules["api.github.com"][0]["transform"]["headers"]) == {
        "Authorization": "token the-token"}
    with pytest.raises(egress_secrets.SecretRefused) as info:
        client.value(sandbox.pk, "gh", "evil.test")
    assert info.value.status == 403
