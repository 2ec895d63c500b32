"""The egress proxy's secret client (vmm.egress_secrets; agent.egress_secrets builds its
configuration): what it sends, what it keeps and for how long, what it refuses; and the whole
path through the real API on a live server with the standard library's HTTP client."""
import pytest
from django.conf import settings as django_settings
from django.utils import timezone

from agent import egress_secrets as node_side
from nodes import node_auth
from vmm import egress_secrets


class FakeApi:
    def __init__(self):
        self.calls, self.value, self.status, self.ttl = [], "v1", 200, 60

    def __call__(self, url, headers, body, timeout):
        self.calls.append((url, dict(headers), body))
        if self.status != 200:
            return self.status, {"code": self.status, "message": "no"}
        return 200, {"value": self.value, "version": 1, "secretID": "sec_x", "ttl": self.ttl}


@pytest.fixture
def fake():
    api, now = FakeApi(), [0.0]
    client = egress_secrets.SecretResolver("http://cp:3000/", {"Authorization": "Bearer t"}, post=api,
                                           clock=lambda: now[0])
    return api, client, now


def test_asks_once_then_serves_from_memory_until_the_ttl(fake):
    api, client, now = fake
    assert client.value("i1", "GH", "API.github.com.") == "v1"
    url, headers, body = api.calls[0]
    assert url == "http://cp:3000/nodes/secrets/resolve" and headers == {"Authorization": "Bearer t"}
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
    nobody_there = egress_secrets.SecretResolver("http://127.0.0.1:9", {}, timeout=2)
    with pytest.raises(egress_secrets.SecretUnavailable, match="cannot be asked"):
        nobody_there.value("i1", "gh", "h")


def test_the_nodes_headers_and_config(settings, tmp_path):
    assert node_side.node_headers("n1", "aenv_node_x", "k") == {"Authorization": "Bearer aenv_node_x"}
    assert node_side.node_headers("n1", None, "k") == {
        "Authorization": f"Bearer {node_auth.derived_token('k', 'n1')}", node_auth.NODE_HEADER: "n1"}
    settings.AENV_HOME, settings.AENV_CONTROL_PLANE_URL = tmp_path, ""
    config = node_side.proxy_config()
    assert config["url"] == settings.AENV_API_PUBLIC_URL and node_auth.NODE_HEADER in config["headers"]
    settings.AENV_CONTROL_PLANE_URL = "https://cp.example"
    assert node_side.proxy_config()["url"] == "https://cp.example"


def test_the_client_file_imports_nothing_but_the_standard_library():
    """The proxy loads it by path in mitmproxy's own environment."""
    import ast  # noqa: PLC0415
    import sys  # noqa: PLC0415

    tree = ast.parse(open(egress_secrets.__file__).read())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert names - {"__future__"} <= set(sys.stdlib_module_names), names


@pytest.mark.django_db(transaction=True)
def test_through_the_real_api(live_server, team, base_template, node):
    from sandboxes.models import Sandbox  # noqa: PLC0415
    from team_secrets import store  # noqa: PLC0415

    store.create(team, "gh", "the-token")
    rules = {"api.github.com": [{"transform": {"headers": {"Authorization": "token ${e2b.secrets.gh}"}}}]}
    sandbox = Sandbox.objects.create(team=team, template=base_template, node=node, state="running",
                                     end_at=timezone.now() + timezone.timedelta(hours=1), network={"rules": rules})
    client = egress_secrets.SecretResolver.from_config(
        {"url": live_server.url, "headers": node_side.node_headers(node.pk, None, django_settings.SECRET_KEY)})
    assert client.fill_headers(sandbox.pk, "api.github.com", rules["api.github.com"][0]["transform"]["headers"]) == {
        "Authorization": "token the-token"}
    with pytest.raises(egress_secrets.SecretRefused) as info:
        client.value(sandbox.pk, "gh", "evil.test")
    assert info.value.status == 403
