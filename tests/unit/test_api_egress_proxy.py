"""network.egressProxy through the ASGI app with the node side mocked: E2B's wire shape (the
SDK 2.63 body in, its model parsing the detail back), what is stored (the password sealed),
what the node is told (never the password), what is shown back and kept in events (never
the password), the address checks (public only unless AENV_EGRESS_PROXY_ALLOW_PRIVATE; never
IPv6), ``tls`` (E2B's enabled / serverName / caCert: checked, the node told the name and the
CA, shown back without the CA), the update's replace semantics, resume and fork keeping it,
and the nodes' password route."""
import json
from unittest import mock

import pytest
from django.conf import settings as django_settings
from django.utils import timezone

from lifecycle.sandboxes import egress_proxy
from nodes import node_auth
from nodes.models import Node
from sandboxes.models import Sandbox, SandboxEvent
from tests.unit.test_api_network import fork_each_child
from tests.unit.test_secrets_resolve import _ask as _node_ask
from tests.unit.test_secrets_resolve import _headers

pytestmark = pytest.mark.django_db(transaction=True)

PASSWORD = "pr0xy-Pa55word-do-not-show"
PROXY = {"address": "8.8.4.4:1080", "username": "alice", "password": PASSWORD}


def _ca_pem(name: str = "test proxy CA") -> str:
    """A self-signed CA certificate (PEM), as a user with a private CA gives in tls.caCert."""
    import datetime  # noqa: PLC0415

    from cryptography import x509  # noqa: PLC0415
    from cryptography.hazmat.primitives import hashes, serialization  # noqa: PLC0415
    from cryptography.hazmat.primitives.asymmetric import ec  # noqa: PLC0415
    from cryptography.x509.oid import NameOID  # noqa: PLC0415

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now)
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM).decode()


CA = _ca_pem()


@pytest.fixture
def net_mock(nodes_mock):
    nodes_mock.client.update_network = mock.AsyncMock(return_value={"timings": {}})
    return nodes_mock


def _everything_sent(nodes_mock) -> str:
    """Every argument of every node call made (the task arguments a node gets)."""
    calls = [c for v in vars(nodes_mock.client).values() if isinstance(v, mock.Mock) for c in v.mock_calls]
    assert calls
    return json.dumps([str(c) for c in calls])


async def test_create_stores_the_password_sealed_and_tells_the_node_only_where_and_who(api, nodes_mock):
    resp = await api.post("/v2/sandboxes", json={"templateID": "base", "network": {"egressProxy": PROXY}})
    assert resp.status_code == 201, resp.text
    spec = nodes_mock.client.boot_sandbox.await_args.kwargs["network"]["egress_proxy"]
    row = await Sandbox.objects.aget(pk=resp.json()["sandboxID"])
    stored = row.network["egressProxy"]
    assert spec == {"scheme": "socks5", "host": "8.8.4.4", "port": 1080, "username": "alice",
                    "credential": egress_proxy.credential_id(stored)}
    assert len(spec["credential"]) == 16
    assert PASSWORD not in json.dumps(row.network) and PASSWORD not in _everything_sent(nodes_mock)
    assert set(stored["password"]) == {"sealed", "keyId"}
    assert egress_proxy.password_of(stored) == PASSWORD  # opens under the secrets key
    detail = (await api.get(f"/sandboxes/{row.id}")).json()
    assert detail["network"] == {"egressProxy": {"address": "8.8.4.4:1080", "username": "alice"}}


async def test_the_sdks_body_goes_in_and_its_model_reads_the_detail_back(api, nodes_mock):
    from e2b.api.client.models import NewSandboxV2, SandboxNetworkConfig  # noqa: PLC0415
    from e2b.api.client.models.sandbox_detail import SandboxDetail  # noqa: PLC0415
    from e2b.sandbox.sandbox_api import build_network_config, from_client_network_config  # noqa: PLC0415

    network = build_network_config({"allow_out": ["8.8.8.8"], "egress_proxy": {
        "address": "http://8.8.4.4:3128", "username": "bob", "password": PASSWORD, "tls": False}})
    body = NewSandboxV2(template_id="base", network=SandboxNetworkConfig(**network)).to_dict()
    assert body["network"]["egressProxy"]["password"] == PASSWORD  # the SDK sends it in the body
    resp = await api.post("/v2/sandboxes", json=body)
    assert resp.status_code == 201, resp.text
    assert nodes_mock.client.boot_sandbox.await_args.kwargs["network"]["egress_proxy"]["scheme"] == "http"
    raw = (await api.get(f"/sandboxes/{resp.json()['sandboxID']}")).json()
    assert PASSWORD not in json.dumps(raw)
    info = from_client_network_config(SandboxDetail.from_dict(raw).network)
    assert info["egress_proxy"] == {"address": "http://8.8.4.4:3128", "username": "bob"}


@pytest.mark.parametrize("proxy, message", [
    ({}, "address must be a non-empty string"),
    ("8.8.4.4:1080", "must be an object"),
    ({"address": 1080}, "address must be a non-empty string"),
    ({"address": "8.8.4.4"}, "must be host:port"),
    ({"address": "8.8.4.4:0"}, "must be host:port"),
    ({"address": "8.8.4.4:70000"}, "must be host:port"),
    ({"address": "socks5://u:p@8.8.4.4:1080"}, "must not carry credentials"),
    ({"address": "ftp://8.8.4.4:21"}, "is not a proxy aenv chains to"),
    ({"address": "https://8.8.4.4:443"}, "is not a proxy aenv chains to"),
    ({"address": "[2001:4860::8888]:1080"}, "IPv6 upstream proxies are not supported"),
    ({"address": "socks5://[2001:4860::8888]:1080"}, "IPv6 upstream proxies are not supported"),
    ({"address": "2001:4860::8888:1080"}, "IPv6 upstream proxies are not supported"),
    ({"address": "[::ffff:8.8.4.4]:1080"}, "IPv6 upstream proxies are not supported"),
    ({"address": "[8.8.4.4]:1080"}, "is not a host name or IPv4 address"),
    ({"address": "[proxy.example.com]:1080"}, "is not a host name or IPv4 address"),
    ({"address": "*.example.com:1080"}, "is not a host name or IPv4 address"),
    ({"address": "bad_host!:1080"}, "is not a host name"),
    ({"address": "8.8.4.4:1080/x"}, "must be host:port"),
    ({"address": "8.8.4.4:1080", "password": "x"}, "only together with username"),
    ({"address": "8.8.4.4:1080", "username": "u" * 256}, "at most 255 bytes"),
    ({"address": "8.8.4.4:1080", "username": "u", "password": "é" * 128}, "at most 255 bytes"),
    ({"address": "8.8.4.4:1080", "username": "u\r\nX: y"}, "without CR, LF or NUL"),
    ({"address": "http://8.8.4.4:3128", "username": "a:b"}, "cannot contain ':'"),
    ({"address": "8.8.4.4:1080", "passwd": "x"}, "not 'passwd'"),
    ({"address": "8.8.4.4:1080", "tls": "yes"}, "tls must be an object"),
    ({"address": "8.8.4.4:1080", "tls": {"serverName": "p.example"}}, "tls.enabled must be true or false"),
    ({"address": "8.8.4.4:1080", "tls": {"enabled": "true"}}, "tls.enabled must be true or false"),
    ({"address": "8.8.4.4:1080", "tls": {"enabled": True, "insecureSkipVerify": True}}, "not 'insecureSkipVerify'"),
    ({"address": "8.8.4.4:1080", "tls": {"enabled": False, "serverName": "p.example"}}, "no other field"),
    ({"address": "8.8.4.4:1080", "tls": {"enabled": True, "serverName": "bad name!"}}, "tls.serverName"),
    ({"address": "8.8.4.4:1080", "tls": {"enabled": True, "serverName": "*.example.com"}}, "tls.serverName"),
    ({"address": "8.8.4.4:1080", "tls": {"enabled": True, "serverName": "2001:db8::1"}}, "tls.serverName"),
    ({"address": "8.8.4.4:1080", "tls": {"enabled": True, "serverName": "p" * 254}}, "at most 253 bytes"),
    ({"address": "8.8.4.4:1080", "tls": {"enabled": True, "caCert": ""}}, "caCert must be a non-empty string"),
    ({"address": "8.8.4.4:1080", "tls": {"enabled": True, "caCert": "not a certificate"}}, "is not PEM"),
    ({"address": "8.8.4.4:1080", "tls": {"enabled": True, "caCert": "-----BEGIN CERTIFICATE-----\nAAAA\n"
                                                                     "-----END CERTIFICATE-----\n"}}, "is not PEM"),
    ({"address": "8.8.4.4:1080", "tls": {"enabled": True, "caCert": CA * 20}}, "at most 8192 bytes"),
    ({"address": "8.8.4.4:1080", "tls": {"enabled": True, "caCert": "x" * 100_000}}, "at most 8192 bytes"),
    ({"address": "8.8.4.4:1080", "tls": {"enabled": True, "caCert": CA + "\x07"}}, "without control characters"),
    ({"address": "8.8.4.4:1080", "tls": {"enabled": True, "caCert": [CA]}}, "caCert must be a non-empty string"),
    ({"address": "8.8.4.4:1080", "tls": {"enabled": True, "serverName": "a.example\r\nX: y"}}, "without CR, LF"),
    ({"address": "8.8.4.4:1080", "tls": {"enabled": True, "serverName": 5}}, "serverName must be a non-empty"),
    ({"address": "127.0.0.1:1080"}, "127.0.0.1 is a loopback or private address"),
    ({"address": "192.168.1.5:1080"}, "192.168.1.5 is a loopback or private address"),
    ({"address": "169.254.169.254:80"}, "link-local, metadata"),
    ({"address": "0.0.0.0:1080"}, "unspecified"),
    ({"address": "198.51.100.7:1080"}, "loopback or private address"),
    ({"address": "no-such-proxy.invalid:1080"}, "does not resolve to an IPv4 address"),
])
async def test_bad_proxies_are_400_before_anything_exists(api, nodes_mock, assert_error, proxy, message):
    resp = await api.post("/v2/sandboxes", json={"templateID": "base", "network": {"egressProxy": proxy}})
    body = assert_error(resp, 400, message)
    assert "network.egressProxy" in body["message"]
    assert PASSWORD not in body["message"]
    nodes_mock.client.boot_sandbox.assert_not_awaited()
    assert await Sandbox.objects.acount() == 0


@pytest.mark.parametrize("proxy", [
    {"address": "127.0.0.1:1080"}, {"address": "socks5://10.12.0.1:1080", "username": "u", "password": "p"},
    {"address": "http://192.168.1.5:3128"}, {"address": "proxy.internal:1080"},
])
async def test_the_operator_setting_allows_private_upstreams(api, nodes_mock, settings, proxy):
    settings.AENV_EGRESS_PROXY_ALLOW_PRIVATE = True
    resp = await api.post("/v2/sandboxes", json={"templateID": "base", "network": {"egressProxy": proxy}})
    assert resp.status_code == 201, resp.text
    link_local = {"address": "169.254.169.254:80"}  # never, whatever the setting
    resp = await api.post("/v2/sandboxes", json={"templateID": "base", "network": {"egressProxy": link_local}})
    assert resp.status_code == 400


@pytest.mark.parametrize("proxy", [None, {"address": "8.8.4.4:1080", "tls": False},
                                   {"address": "8.8.4.4:1080", "tls": {"enabled": False}},
                                   {"address": "socks5h://8.8.4.4:1080", "username": "only-user"}])
async def test_what_is_accepted(api, nodes_mock, proxy):
    resp = await api.post("/v2/sandboxes", json={"templateID": "base", "network": {"egressProxy": proxy}})
    assert resp.status_code == 201, resp.text
    spec = nodes_mock.client.boot_sandbox.await_args.kwargs["network"]
    assert ("egress_proxy" in spec) is (proxy is not None)
    if proxy and "username" in proxy:
        assert spec["egress_proxy"]["credential"] == "" and spec["egress_proxy"]["scheme"] == "socks5"


@pytest.mark.parametrize("tls, told, shown", [
    (True, {"tls": True, "tls_server_name": "8.8.4.4", "tls_ca": ""}, {"enabled": True}),
    ({"enabled": True}, {"tls": True, "tls_server_name": "8.8.4.4", "tls_ca": ""}, {"enabled": True}),
    ({"enabled": True, "serverName": "Proxy.Example.COM."},
     {"tls": True, "tls_server_name": "proxy.example.com", "tls_ca": ""},
     {"enabled": True, "serverName": "proxy.example.com"}),
    ({"enabled": True, "serverName": "proxy.example.com", "caCert": CA + _ca_pem("second CA")},
     {"tls": True, "tls_server_name": "proxy.example.com"}, {"enabled": True, "serverName": "proxy.example.com"}),
], ids=["true", "enabled", "server-name", "ca-cert"])
async def test_tls_is_told_to_the_node_and_shown_back_without_the_ca(api, nodes_mock, tls, told, shown):
    proxy = {**PROXY, "tls": tls}
    resp = await api.post("/v2/sandboxes", json={"templateID": "base", "network": {"egressProxy": proxy}})
    assert resp.status_code == 201, resp.text
    spec = nodes_mock.client.boot_sandbox.await_args.kwargs["network"]["egress_proxy"]
    assert {k: v for k, v in spec.items() if k.startswith("tls")} == {
        **told, **({"tls_ca": tls["caCert"]} if isinstance(tls, dict) and "caCert" in tls else {})}
    assert spec["host"] == "8.8.4.4" and spec["credential"]  # the rest as without TLS
    detail = (await api.get(f"/sandboxes/{resp.json()['sandboxID']}")).json()
    assert detail["network"]["egressProxy"] == {"address": "8.8.4.4:1080", "username": "alice", "tls": shown}
    assert "BEGIN CERTIFICATE" not in json.dumps(detail) and PASSWORD not in json.dumps(detail)
    events = [e.details async for e in SandboxEvent.objects.filter(sandbox_id=resp.json()["sandboxID"])]
    assert not any("BEGIN CERTIFICATE" in json.dumps(d) or PASSWORD in json.dumps(d) for d in events)


async def test_put_network_sets_replaces_and_clears_it_never_keeping_the_password_in_events(api, create, net_mock):
    sb = await create(network={"denyOut": ["8.8.8.8"]})
    url = f"/sandboxes/{sb['sandboxID']}/network"
    assert (await api.put(url, json={"egressProxy": PROXY})).status_code == 204
    first = net_mock.client.update_network.await_args.kwargs["network"]["egress_proxy"]
    assert first["host"] == "8.8.4.4" and first["credential"]
    assert (await api.put(url, json={"egress_proxy": {**PROXY, "password": "another"}})).status_code == 204
    second = net_mock.client.update_network.await_args.kwargs["network"]["egress_proxy"]
    assert second["credential"] != first["credential"]  # a new password is a new credential: no stale cache
    row = await Sandbox.objects.aget(pk=sb["sandboxID"])
    assert egress_proxy.password_of(row.network["egressProxy"]) == "another"
    assert (await api.put(url, json={"denyOut": ["8.8.8.8"]})).status_code == 204  # omitted: cleared
    assert "egress_proxy" not in net_mock.client.update_network.await_args.kwargs["network"]
    assert (await Sandbox.objects.aget(pk=sb["sandboxID"])).network == {"denyOut": ["8.8.8.8"]}
    events = [e.details async for e in SandboxEvent.objects.filter(sandbox_id=sb["sandboxID"])]
    assert events and not any("sealed" in json.dumps(d) or PASSWORD in json.dumps(d) for d in events)
    assert any(d.get("after", {}).get("network", {}).get("egressProxy") == {"address": "8.8.4.4:1080",
                                                                           "username": "alice"} for d in events)


async def test_resume_and_fork_keep_it(api, create, net_mock):
    sb = await create(network={"egressProxy": PROXY})
    sent = net_mock.client.boot_sandbox.await_args.kwargs["network"]["egress_proxy"]
    assert (await api.post(f"/sandboxes/{sb['sandboxID']}/pause", json={})).status_code == 204
    assert (await api.post(f"/sandboxes/{sb['sandboxID']}/connect", json={"timeout": 60})).status_code == 201
    assert net_mock.client.resume_sandbox.await_args.kwargs["network"]["egress_proxy"] == sent

    net_mock.client.fork_sandbox = mock.AsyncMock(side_effect=fork_each_child)
    kid = (await api.post(f"/sandboxes/{sb['sandboxID']}/fork", json={"count": 1})).json()[0]["sandbox"]
    assert [c["network"]["egress_proxy"] for c in net_mock.client.fork_sandbox.await_args.kwargs["children"]] == [sent]
    row = await Sandbox.objects.aget(pk=kid["sandboxID"])
    assert egress_proxy.password_of(row.network["egressProxy"]) == PASSWORD


# --------------------------------------------------------------------------- the nodes' route


def _ask(app, headers, **body):
    return _node_ask(app, headers, route="/nodes/egress-proxy/resolve", **body)


@pytest.fixture
def chained(team, base_template, node):
    other = Node.objects.create(id="n2", address="127.0.0.2", vcpu_capacity=8, memory_mb_capacity=8192,
                                last_heartbeat_at=timezone.now())
    stored = egress_proxy.checked(PROXY)
    sandbox = Sandbox.objects.create(team=team, template=base_template, node=node, state="running",
                                     end_at=timezone.now() + timezone.timedelta(hours=1),
                                     network={"egressProxy": stored})
    return sandbox, node, other, egress_proxy.credential_id(stored)


async def test_only_the_sandboxs_node_gets_the_password_for_the_current_credential(asgi_app, chained, raw_key):
    sandbox, node, other, credential = chained
    resp = await _ask(asgi_app, _headers(node.pk), sandboxID=sandbox.pk, credential=credential)
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"password": PASSWORD, "ttl": django_settings.AENV_EGRESS_SECRET_CACHE_TTL}
    assert resp.headers["cache-control"] == "no-store"
    for headers, body, status in [
        (_headers(other.pk), {"sandboxID": sandbox.pk, "credential": credential}, 404),  # not its sandbox
        (_headers(node.pk), {"sandboxID": sandbox.pk, "credential": "0" * 16}, 404),  # a replaced password
        (_headers(node.pk), {"sandboxID": "nope", "credential": credential}, 404),
        ({"X-API-Key": raw_key}, {"sandboxID": sandbox.pk, "credential": credential}, 401),  # a team's key
        ({"Authorization": "Bearer nope", node_auth.NODE_HEADER: node.pk},
         {"sandboxID": sandbox.pk, "credential": credential}, 401),
        (_headers(node.pk), {"sandboxID": sandbox.pk}, 400),
    ]:
        resp = await _ask(asgi_app, headers, **body)
        assert resp.status_code == status, (headers, body, resp.text)
        assert PASSWORD not in resp.text
    await Sandbox.objects.filter(pk=sandbox.pk).aupdate(state="paused")
    assert (await _ask(asgi_app, _headers(node.pk), sandboxID=sandbox.pk, credential=credential)).status_code == 404


@pytest.mark.parametrize("answer, status", [("10.9.9.9", 400), ("8.8.8.8", 201), ("slow", 201)])
async def test_a_named_upstream_is_resolved_at_the_edge_within_a_budget(api, nodes_mock, monkeypatch, answer,
                                                                        status):
    import socket  # noqa: PLC0415
    import time  # noqa: PLC0415

    def getaddrinfo(host, port, *args):
        assert host == "proxy.example.org"
        if answer == "slow":
            time.sleep(0.5)  # past the budget: accepted, the node checks at every dial
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (answer if answer != "slow" else "10.9.9.9", port))]

    monkeypatch.setattr(egress_proxy.socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(egress_proxy, "RESOLVE_BUDGET", 0.1)
    resp = await api.post("/v2/sandboxes", json={"templateID": "base", "network": {
        "egressProxy": {"address": "proxy.example.org:1080"}}})
    assert resp.status_code == status, resp.text
    if status == 400:
        assert "10.9.9.9 is a loopback or private address" in resp.json()["message"]


# --------------------------------------------------------------------------- the unchanged SDK


@pytest.fixture
async def sdk_server(asgi_app, base_template, raw_key, net_mock, monkeypatch):
    from tests.unit.asgi_server import served_to_sdk  # noqa: PLC0415

    async with served_to_sdk(asgi_app, monkeypatch, raw_key) as url:
        yield url


async def test_the_sdks_create_update_and_get_info(sdk_server, net_mock):
    """E2B Python SDK 2.63's ``Sandbox.create(network={"egress_proxy": …})``, ``update_network``
    and ``get_info`` against the API on uvicorn, ``tls`` too (``True`` and a mapping); an IPv6
    upstream is the SDK's own 400."""
    import asyncio  # noqa: PLC0415

    from e2b import Sandbox as SDKSandbox  # noqa: PLC0415
    from e2b import SandboxException  # noqa: PLC0415

    def run():
        sandbox = SDKSandbox.create(network={"egress_proxy": {"address": "8.8.4.4:1080", "username": "alice",
                                                              "password": PASSWORD}})
        first = sandbox.get_info().network
        SDKSandbox.update_network(sandbox.sandbox_id, {"allow_out": ["8.8.8.8"], "deny_out": ["0.0.0.0/0"],
                                                       "egress_proxy": {"address": "http://8.8.4.4:3128"}})
        second = sandbox.get_info().network
        sandbox.update_network({"allow_out": ["8.8.8.8"]})
        third = sandbox.get_info().network
        over_tls = SDKSandbox.create(network={"egress_proxy": {
            "address": "8.8.4.4:1080", "tls": {"server_name": "proxy.example.com", "ca_cert": CA}}})
        fourth = over_tls.get_info().network
        SDKSandbox.update_network(over_tls.sandbox_id, {"egress_proxy": {"address": "8.8.4.4:1443", "tls": True}})
        fifth = over_tls.get_info().network
        try:
            SDKSandbox.create(network={"egress_proxy": {"address": "[2001:4860::8888]:1080"}})
            refused = None
        except SandboxException as exc:
            refused = str(exc)
        return first, second, third, fourth, fifth, refused

    first, second, third, fourth, fifth, refused = await asyncio.to_thread(run)
    assert first["egress_proxy"] == {"address": "8.8.4.4:1080", "username": "alice"}
    assert second["egress_proxy"] == {"address": "http://8.8.4.4:3128"}
    assert "egress_proxy" not in third  # an update without it: direct again
    assert fourth["egress_proxy"] == {"address": "8.8.4.4:1080", "tls": {"server_name": "proxy.example.com"}}
    assert fifth["egress_proxy"] == {"address": "8.8.4.4:1443", "tls": {}}
    assert net_mock.client.boot_sandbox.await_args_list[1].kwargs["network"]["egress_proxy"]["tls_ca"] == CA
    assert net_mock.client.update_network.await_args_list[-1].kwargs["network"]["egress_proxy"] == {
        "scheme": "socks5", "host": "8.8.4.4", "port": 1443, "username": "", "credential": "", "tls": True,
        "tls_server_name": "8.8.4.4", "tls_ca": ""}
    assert "IPv6 upstream proxies are not supported" in refused
    boot = net_mock.client.boot_sandbox.await_args_list[0].kwargs["network"]["egress_proxy"]
    assert boot["username"] == "alice" and boot["credential"]
    assert net_mock.client.update_network.await_args_list[0].kwargs["network"]["egress_proxy"] == {
        "scheme": "http", "host": "8.8.4.4", "port": 3128, "username": "", "credential": ""}
    assert PASSWORD not in _everything_sent(net_mock)
