"""E2B's network settings through the ASGI app with the node side mocked: create with an
egress policy (what the node is given, what is stored, E2B's 400s), trafficAccessToken,
PUT /sandboxes/{id}/network (replace semantics, states, failures at the node), resume and
fork passing the row's policy on, and the SDK 2.63 request bodies and response models."""
import asyncio
import contextvars
from unittest import mock

import httpx
import pytest

from lifecycle.sandboxes import network as sandbox_network
from sandboxes.models import Sandbox, SandboxEvent
from sandboxes.transitions import with_route_generation

pytestmark = pytest.mark.django_db(transaction=True)

ENVD = 49983
OPEN = {"allow_internet_access": True, "allow_out": [], "deny_out": [], "forward_ports": [ENVD]}
E2B_DOMAIN_MESSAGE = ("When specifying allowed domains in allow out, you must include 'ALL_TRAFFIC' in deny out "
                      "to block all other traffic.")


def _spec(allow=(), deny=(), internet=True, dns=None) -> dict:
    return {"allow_internet_access": internet, "allow_out": list(allow), "deny_out": list(deny),
            "forward_ports": [ENVD], **({"dns_servers": list(dns)} if dns is not None else {})}


async def fork_each_child(node, *, sandbox_id, env_vars, access_token, children, deadline=None):
    """The node's fork answer, every child up (on 127.0.0.1, without a guest_host: slirp)."""
    return {"parent": {"ok": True}, "timings": {}, "children": [
        {"sandbox_id": c["sandbox_id"], "ok": True, "envd_host": "127.0.0.1", "envd_port": 41000, "pid": 1,
         "timings": {}} for c in children]}


@pytest.fixture
def net_mock(nodes_mock):
    nodes_mock.client.update_network = mock.AsyncMock(return_value={"timings": {"total_ms": 1.5}})
    return nodes_mock


@pytest.fixture
async def other_api(asgi_app, other_key):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi_app), base_url="http://testserver",
                                 headers={"X-API-Key": other_key}, timeout=30) as client:
        yield client


async def _events(sandbox_id: str) -> list[tuple]:
    qs = SandboxEvent.objects.filter(sandbox_id=sandbox_id, operation="network").order_by("id")
    return [(e.outcome, e.from_state, e.to_state) async for e in qs]


# --------------------------------------------------------------------------- create


async def test_create_with_egress_lists_gives_the_node_the_parsed_policy(api, nodes_mock):
    resp = await api.post("/v2/sandboxes", json={"templateID": "base", "network": {
        "allowOut": ["1.1.1.1", "8.8.8.0/24"], "denyOut": ["0.0.0.0/0"], "maskRequestHost": "h.example:${PORT}"}})
    assert resp.status_code == 201, resp.text
    assert nodes_mock.client.boot_sandbox.await_args.kwargs["network"] == _spec(
        allow=["1.1.1.1/32", "8.8.8.0/24"], deny=["0.0.0.0/0"])
    row = await Sandbox.objects.aget(pk=resp.json()["sandboxID"])
    # stored as asked (the node gets the normalised form of exactly this)
    assert row.network == {"allowOut": ["1.1.1.1", "8.8.8.0/24"], "denyOut": ["0.0.0.0/0"],
                           "maskRequestHost": "h.example:${PORT}"}
    assert row.allow_internet_access is None and row.traffic_access_token == ""
    detail = (await api.get(f"/sandboxes/{row.id}")).json()
    assert detail["network"] == row.network and detail["allowInternetAccess"] is None


async def test_allow_internet_access_false_is_deny_all_and_keeps_allow_out(api, nodes_mock):
    resp = await api.post("/v2/sandboxes", json={"templateID": "base", "allow_internet_access": False,
                                                 "network": {"allowOut": ["8.8.8.8"], "denyOut": ["10.1.0.0/16"]}})
    assert resp.status_code == 201, resp.text
    assert nodes_mock.client.boot_sandbox.await_args.kwargs["network"] == _spec(
        allow=["8.8.8.8/32"], deny=["0.0.0.0/0"], internet=False)
    detail = (await api.get(f"/sandboxes/{resp.json()['sandboxID']}")).json()
    assert detail["allowInternetAccess"] is False


@pytest.mark.parametrize("network", [{"allow_out": ["1.1.1.1"], "deny_out": ["0.0.0.0/0"]},
                                     {"allowOut": ["1.1.1.1"], "deny_out": ["0.0.0.0/0"]}])
async def test_snake_case_network_keys_are_accepted(api, nodes_mock, network):
    resp = await api.post("/v2/sandboxes", json={"templateID": "base", "network": network})
    assert resp.status_code == 201, resp.text
    assert nodes_mock.client.boot_sandbox.await_args.kwargs["network"] == _spec(["1.1.1.1/32"], ["0.0.0.0/0"])
    assert (await Sandbox.objects.aget(pk=resp.json()["sandboxID"])).network == {
        "allowOut": ["1.1.1.1"], "denyOut": ["0.0.0.0/0"]}


async def test_domains_in_allow_out_go_to_the_node_beside_the_cidrs(api, nodes_mock):
    resp = await api.post("/v2/sandboxes", json={"templateID": "base", "network": {
        "allowOut": ["Example.com", "*.example.org", "1.1.1.1"], "denyOut": ["0.0.0.0/0"]}})
    assert resp.status_code == 201, resp.text
    assert nodes_mock.client.boot_sandbox.await_args.kwargs["network"] == _spec(
        ["1.1.1.1/32", "example.com", "*.example.org"], ["0.0.0.0/0"])


async def test_a_create_without_a_policy_gets_the_open_spec(api, nodes_mock):
    resp = await api.post("/v2/sandboxes", json={"templateID": "base", "network": {}})
    assert resp.status_code == 201
    assert nodes_mock.client.boot_sandbox.await_args.kwargs["network"] == OPEN
    assert (await Sandbox.objects.aget(pk=resp.json()["sandboxID"])).network is None


BAD_POLICIES = [
    ({"network": {"denyOut": ["not-a-cidr"]}}, "invalid denied CIDR not-a-cidr"),
    ({"network": {"denyOut": ["0.0.0.0"]}}, "invalid denied CIDR 0.0.0.0"),
    ({"network": {"allowOut": ["0.0.0.0"]}}, "invalid allowed address 0.0.0.0"),
    ({"network": {"allowOut": ["example.com"]}}, E2B_DOMAIN_MESSAGE),
    ({"network": {"allowOut": ["api.exa mple.com"], "denyOut": ["0.0.0.0/0"]}}, "invalid allowed address"),
    ({"allow_internet_access": False, "network": {"allowOut": ["*.example.com"]}}, "allowed domains"),
    ({"network": {"allowOut": "1.1.1.1"}}, "allowOut must be a list of strings"),
    ({"network": {"rules": {"api.example.com": [{"transform": {"headers": {"A": "b"}}}]}}},
     "allowOut must name the rules' hosts as domains"),
    ({"network": {"allowOut": ["8.8.8.8"], "denyOut": ["0.0.0.0/0"],
                  "rules": {"8.8.8.8": [{"transform": {"headers": {"A": "b"}}}]}}}, "allowOut must name"),
    ({"network": {**(RULED := {"allowOut": ["api.example.com"], "denyOut": ["0.0.0.0/0"]}),
                  "rules": {"10.0.0.0/8": [{"transform": {"headers": {"A": "b"}}}]}}}, "not a domain name"),
    ({"network": {**RULED, "rules": {"api.example.com": [{"transform": {"headers": {"A": "b\r\nX: y"}}}]}}},
     "without CR, LF or NUL"),
    ({"network": {**RULED, "rules": {"api.example.com": [{"transform": {"headers": {"Host": "x"}}}]}}},
     "not a header a rule may set"),
    ({"network": {**RULED, "rules": {"api.example.com": [{"transform": {"headers": {"A b": "x"}}}]}}},
     "not a header a rule may set"),
    ({"network": {**RULED, "rules": {"api.example.com": [{"transform": {"body": "x"}}]}}}, "takes only headers"),
    ({"network": {**RULED, "rules": {"api.example.com": {"transform": {}}}}}, "must be a list"),
    ({"network": {**RULED, "rules": ["api.example.com"]}}, "network.rules must be an object"),
    ({"network": {"egressProxy": {"address": "10.1.2.3:1080"}}}, "10.1.2.3 is a loopback or private address"),
    ({"network": {"egress_proxy": {"address": "[2001:db8::1]:1080"}}}, "IPv6 upstream proxies are not supported"),
    ({"network": {"httpsPorts": [3000]}}, "network.httpsPorts is not supported"),
    ({"network": {"dnsServers": ["dns.example"]}}, "invalid DNS server dns.example"),
    ({"network": {"dnsServers": ["1.1.1.1"] * 11}}, "at most 10"),
    ({"network": {"dnsServers": ["1.1.1.1", "224.0.0.251"]}}, "sandboxes can never reach 224.0.0.0/4"),
    ({"network": {"dns_servers": ["169.254.169.254"]}}, "sandboxes can never reach 169.254.0.0/16"),
    ({"network": {"dnsServers": ["127.0.0.53"]}}, "sandboxes can never reach 127.0.0.0/8"),
    ({"network": {"dnsServers": "1.1.1.1"}}, "dnsServers must be a list of strings"),
    ({"network": {"allowPublicTraffic": "no"}}, "allowPublicTraffic must be a boolean"),
    ({"network": {"maskRequestHost": 3}}, "maskRequestHost must be a string"),
    ({"network": {"allowOut": ["1.1.1.1"], "allow_out": ["2.2.2.2"]}}, "given twice"),
]


@pytest.mark.parametrize("extra, message", BAD_POLICIES)
async def test_bad_or_unenforceable_policies_are_400_before_anything_exists(api, nodes_mock, assert_error,
                                                                          extra, message):
    body = assert_error(await api.post("/v2/sandboxes", json={"templateID": "base", **extra}), 400, message)
    if message == E2B_DOMAIN_MESSAGE:
        assert body["message"] == message  # E2B's own words
    nodes_mock.client.boot_sandbox.assert_not_awaited()
    assert await Sandbox.objects.acount() == 0


@pytest.mark.parametrize("network", [
    {"dnsServers": ["1.1.1.1", "8.8.8.8"]}, {"dnsServers": []}, {"httpsPorts": []}, {"rules": {}},
    {"egressProxy": None}, {"allowPublicTraffic": None}, {"maskRequestHost": ""},
    {"allowOut": ["8.8.8.8"], "denyOut": ["0.0.0.0/0"], "dnsServers": ["8.8.8.8"]},
    {"futureField": {"x": 1}},
])
async def test_what_aenv_can_honour_or_ignore_safely_creates(api, nodes_mock, network):
    resp = await api.post("/v2/sandboxes", json={"templateID": "base", "network": network})
    assert resp.status_code == 201, resp.text


async def test_a_node_that_cannot_enforce_the_policy_is_400_not_500(api, nodes_mock, assert_error):
    nodes_mock.client.boot_sandbox.side_effect = nodes_mock.client.NodeTaskFailed(
        "the slirp network backend cannot restrict egress (no egress to 0.0.0.0/0 (denyOut))",
        kind="UnsupportedNetworkPolicy")
    resp = await api.post("/v2/sandboxes", json={"templateID": "base", "network": {"denyOut": ["0.0.0.0/0"]}})
    body = assert_error(resp, 400, "slirp network backend cannot restrict egress")
    assert body.get("error_code") == "unsupported_network_policy"
    assert resp.headers.get("should-retry") == "false"
    row = await Sandbox.objects.aget()
    assert row.state == "error" and "cannot restrict egress" in row.error_reason


async def test_create_from_a_snapshot_restores_with_the_requests_policy(api, create, nodes_mock):
    from snapshots.models import Snapshot  # noqa: PLC0415

    source = await Sandbox.objects.aget(pk=(await create())["sandboxID"])
    snap = await Snapshot.objects.acreate(team_id=source.team_id, template_id="base", node_id="n1", state="ready",
                                          memory=True, source_sandbox=source, name="golden")
    nodes_mock.client.restore_sandbox = mock.AsyncMock(return_value={
        "envd_host": "10.11.0.3", "envd_port": ENVD, "guest_host": "10.11.0.3", "pid": 1, "timings": {}})
    resp = await api.post("/v2/sandboxes", json={"templateID": snap.id, "allow_internet_access": False})
    assert resp.status_code == 201, resp.text
    assert nodes_mock.client.restore_sandbox.await_args.kwargs["network"] == _spec(deny=["0.0.0.0/0"],
                                                                                 internet=False)
    assert (await Sandbox.objects.aget(pk=resp.json()["sandboxID"])).guest_host == "10.11.0.3"


# --------------------------------------------------------------------------- trafficAccessToken


async def test_traffic_access_token_only_for_private_sandboxes_in_create_and_get(api, create):
    private = await create(network={"allowPublicTraffic": False})
    public = await create(network={"allowPublicTraffic": True})
    default = await create()
    token = private["trafficAccessToken"]
    assert isinstance(token, str) and len(token) >= 40
    assert public["trafficAccessToken"] is None and default["trafficAccessToken"] is None
    assert (await Sandbox.objects.aget(pk=private["sandboxID"])).traffic_access_token == token
    assert (await api.get(f"/sandboxes/{private['sandboxID']}")).json()["trafficAccessToken"] == token
    for sb in (public, default):
        assert (await api.get(f"/sandboxes/{sb['sandboxID']}")).json()["trafficAccessToken"] is None
    again = await create(network={"allow_public_traffic": False})
    assert again["trafficAccessToken"] and again["trafficAccessToken"] != token
    detail = (await api.get(f"/sandboxes/{private['sandboxID']}")).json()
    assert detail["network"] == {"allowPublicTraffic": False}


# --------------------------------------------------------------------------- PUT /network


async def test_put_network_replaces_the_policy_and_the_node_gets_it(api, create, net_mock):
    sb = await create(network={"allowPublicTraffic": False, "maskRequestHost": "m.example", "allowOut": ["2.2.2.2"],
                               "denyOut": ["0.0.0.0/0"], "dnsServers": ["1.1.1.1"]})
    token = sb["trafficAccessToken"]
    resp = await api.put(f"/sandboxes/{sb['sandboxID']}/network", json={"denyOut": ["9.9.9.0/24"]})
    assert resp.status_code == 204 and resp.content == b""
    assert net_mock.client.update_network.await_args.kwargs == {
        "sandbox_id": sb["sandboxID"], "network": _spec(deny=["9.9.9.0/24"]),
        "deadline": sandbox_network.NODE_DEADLINE,
        "access_token": (await Sandbox.objects.aget(pk=sb["sandboxID"])).envd_access_token or None}
    row = await Sandbox.objects.aget(pk=sb["sandboxID"])
    # allowOut and dnsServers were omitted: cleared; allowPublicTraffic, maskRequestHost and the token kept
    assert row.network == {"allowPublicTraffic": False, "maskRequestHost": "m.example", "denyOut": ["9.9.9.0/24"]}
    assert row.traffic_access_token == token and row.allow_internet_access is None
    assert await _events(row.id) == [("started", "running", "running"), ("ok", "running", "running")]
    detail = (await api.get(f"/sandboxes/{row.id}")).json()
    assert detail["network"] == row.network and detail["trafficAccessToken"] == token


async def test_put_network_with_allow_internet_access_false_and_snake_case(api, create, net_mock):
    sb = await create()
    resp = await api.put(f"/sandboxes/{sb['sandboxID']}/network",
                         json={"allow_out": ["1.1.1.1"], "allow_internet_access": False})
    assert resp.status_code == 204, resp.text
    assert net_mock.client.update_network.await_args.kwargs["network"] == _spec(["1.1.1.1/32"], ["0.0.0.0/0"],
                                                                                internet=False)
    row = await Sandbox.objects.aget(pk=sb["sandboxID"])
    assert row.allow_internet_access is False and row.network == {"allowOut": ["1.1.1.1"]}


async def test_put_empty_object_clears_the_egress_policy(api, create, net_mock):
    sb = await create(allow_internet_access=False, network={"allowOut": ["1.1.1.1"], "allowPublicTraffic": False})
    assert (await api.put(f"/sandboxes/{sb['sandboxID']}/network", json={})).status_code == 204
    assert net_mock.client.update_network.await_args.kwargs["network"] == OPEN
    row = await Sandbox.objects.aget(pk=sb["sandboxID"])
    assert row.allow_internet_access is None and row.network == {"allowPublicTraffic": False}
    sb2 = await create(network={"denyOut": ["0.0.0.0/0"]})
    assert (await api.put(f"/sandboxes/{sb2['sandboxID']}/network", json={})).status_code == 204
    assert (await Sandbox.objects.aget(pk=sb2["sandboxID"])).network is None


async def test_put_network_unknown_or_other_team_is_404(api, other_api, create, net_mock, assert_error):
    sb = await create(network={"denyOut": ["0.0.0.0/0"]})
    assert_error(await api.put("/sandboxes/nope/network", json={}), 404, "not found")
    assert_error(await other_api.put(f"/sandboxes/{sb['sandboxID']}/network", json={}), 404, "not found")
    net_mock.client.update_network.assert_not_awaited()
    assert (await Sandbox.objects.aget(pk=sb["sandboxID"])).network == {"denyOut": ["0.0.0.0/0"]}


async def test_put_network_on_a_paused_sandbox_is_409_and_on_a_killed_one_404(api, create, net_mock, assert_error):
    sb = await create(network={"denyOut": ["0.0.0.0/0"]})
    assert (await api.post(f"/sandboxes/{sb['sandboxID']}/pause", json={})).status_code == 204
    assert_error(await api.put(f"/sandboxes/{sb['sandboxID']}/network", json={}), 409, "not running")
    killed = await create()
    assert (await api.delete(f"/sandboxes/{killed['sandboxID']}")).status_code == 204
    assert_error(await api.put(f"/sandboxes/{killed['sandboxID']}/network", json={}), 404)
    net_mock.client.update_network.assert_not_awaited()
    assert (await Sandbox.objects.aget(pk=sb["sandboxID"])).network == {"denyOut": ["0.0.0.0/0"]}
    assert await _events(sb["sandboxID"]) == []


@pytest.mark.parametrize("body, message", [
    ({"denyOut": ["0.0.0.0"]}, "invalid denied CIDR 0.0.0.0"),
    ({"allowOut": ["example.com"]}, E2B_DOMAIN_MESSAGE),
    ({"allowOut": ["*.*.example.com"], "denyOut": ["0.0.0.0/0"]}, "invalid allowed address"),
    ({"rules": {"x.example.com": [{"transform": {"headers": {"a": "b"}}}]}}, "network.rules apply to requests"),
    ({"egressProxy": {"address": "127.0.0.1:1080"}}, "127.0.0.1 is a loopback or private address"),
    ({"allow_internet_access": "no"}, "allow_internet_access must be a boolean"),
    ({"dnsServers": ["127.0.0.1"]}, "sandboxes can never reach 127.0.0.0/8"),
    (["1.1.1.1"], "JSON object"),
])
async def test_put_network_bad_policy_is_400_and_changes_nothing(api, create, net_mock, assert_error, body, message):
    sb = await create(network={"denyOut": ["8.8.8.8"]})
    assert_error(await api.put(f"/sandboxes/{sb['sandboxID']}/network", json=body), 400, message)
    net_mock.client.update_network.assert_not_awaited()
    assert (await Sandbox.objects.aget(pk=sb["sandboxID"])).network == {"denyOut": ["8.8.8.8"]}


async def test_put_network_the_node_cannot_enforce_is_400_and_the_row_goes_back(api, create, net_mock,
                                                                                assert_error):
    sb = await create(network={"denyOut": ["8.8.8.8"]})
    net_mock.client.update_network.side_effect = net_mock.client.NodeTaskFailed(
        "the slirp network backend cannot restrict egress", kind="UnsupportedNetworkPolicy")
    resp = await api.put(f"/sandboxes/{sb['sandboxID']}/network", json={"denyOut": ["0.0.0.0/0"]})
    assert_error(resp, 400, "cannot restrict egress")
    row = await Sandbox.objects.aget(pk=sb["sandboxID"])
    assert row.network == {"denyOut": ["8.8.8.8"]} and row.state == "running"
    assert await _events(sb["sandboxID"]) == [("started", "running", "running"), ("error", "running", "running")]
    event = await SandboxEvent.objects.filter(sandbox_id=sb["sandboxID"], outcome="error").afirst()
    assert event.details["restored"] is True and event.details["kind"] == "UnsupportedNetworkPolicy"


async def test_put_network_other_node_failure_is_500_and_the_row_goes_back(api, create, net_mock, assert_error):
    sb = await create(allow_internet_access=False)
    net_mock.client.update_network.side_effect = net_mock.client.NodeTaskFailed("nft broke", kind="VMError")
    assert_error(await api.put(f"/sandboxes/{sb['sandboxID']}/network", json={}), 500, "VMError")
    row = await Sandbox.objects.aget(pk=sb["sandboxID"])
    assert row.allow_internet_access is False and row.network is None


async def test_put_network_on_a_sandbox_whose_vm_is_gone_is_409_lost(api, create, net_mock, assert_error):
    """The node has no VM for it: a 409 saying the sandbox is lost (the node's VM watch makes
    the row error), never a 500."""
    sb = await create(allow_internet_access=False)
    net_mock.client.update_network.side_effect = net_mock.client.NodeTaskFailed("no VM", kind="VMNotFound")
    body = assert_error(await api.put(f"/sandboxes/{sb['sandboxID']}/network", json={}), 409, "lost")
    assert body["error_code"] == "sandbox_lost"


async def test_put_network_without_an_answer_keeps_the_new_policy_says_so_and_resume_applies_it(
        api, create, net_mock, assert_error):
    """No answer from the node: the VM may or may not have the policy. The row keeps the
    new one (the caller is told it is unconfirmed), and a resume hands the node the row's."""
    sb = await create(network={"denyOut": ["8.8.8.8"]})
    net_mock.client.update_network.side_effect = net_mock.client.NodeTimeout("no answer")
    body = assert_error(await api.put(f"/sandboxes/{sb['sandboxID']}/network", json={"denyOut": ["0.0.0.0/0"]}),
                        504, "did not confirm")
    assert "retry" in body["message"]
    row = await Sandbox.objects.aget(pk=sb["sandboxID"])
    assert row.network == {"denyOut": ["0.0.0.0/0"]}
    assert await _events(row.id) == [("started", "running", "running"), ("unconfirmed", "running", "running")]
    assert (await api.post(f"/sandboxes/{row.id}/pause", json={})).status_code == 204
    assert (await api.post(f"/sandboxes/{row.id}/connect", json={"timeout": 60})).status_code == 201
    assert net_mock.client.resume_sandbox.await_args.kwargs["network"] == _spec(deny=["0.0.0.0/0"])
    net_mock.client.update_network.side_effect = None  # the unconfirmed update does not block the next
    assert (await api.put(f"/sandboxes/{row.id}/network", json={})).status_code == 204


async def test_put_network_on_a_dead_node_is_503_and_changes_nothing(api, create, net_mock, assert_error):
    sb = await create(network={"denyOut": ["8.8.8.8"]})
    net_mock.node.last_heartbeat_at = net_mock.node.last_heartbeat_at.replace(year=2000)
    await net_mock.node.asave()
    assert_error(await api.put(f"/sandboxes/{sb['sandboxID']}/network", json={}), 503, "not alive")
    net_mock.client.update_network.assert_not_awaited()
    assert (await Sandbox.objects.aget(pk=sb["sandboxID"])).network == {"denyOut": ["8.8.8.8"]}


async def test_updates_of_one_sandbox_go_one_at_a_time(api, create, net_mock):
    """B arrives while A is on its way to the node: B waits for A's outcome, so the node
    gets A then B and B's event knows the policy A left (what a refusal would put back)."""
    sb = await create()
    sid = sb["sandboxID"]
    calls, second = [], {}
    # B is another client's request: started in the test's context, not in A's (a task made
    # inside A's request would inherit A's per-request thread context, and asgiref would run B's
    # ORM calls on A's lent thread: a connection left open there, now and then, after A ended)
    outside = contextvars.copy_context()

    async def node_call(node, *, sandbox_id, network, deadline, access_token=None):
        calls.append(network)
        if len(calls) == 1:
            second["task"] = asyncio.get_running_loop().create_task(
                api.put(f"/sandboxes/{sid}/network", json={"denyOut": ["7.7.7.7"]}), context=outside)
            await asyncio.sleep(0.5)
            assert len(calls) == 1 and not second["task"].done()  # B waits for A
        return {"timings": {}}

    net_mock.client.update_network.side_effect = node_call
    assert (await api.put(f"/sandboxes/{sid}/network", json={"denyOut": ["6.6.6.6"]})).status_code == 204
    assert (await second["task"]).status_code == 204
    assert calls == [_spec(deny=["6.6.6.6/32"]), _spec(deny=["7.7.7.7/32"])]
    assert (await Sandbox.objects.aget(pk=sid)).network == {"denyOut": ["7.7.7.7"]}
    started = [e async for e in SandboxEvent.objects.filter(sandbox_id=sid, operation="network",
                                                            outcome="started").order_by("id")]
    assert started[1].details["before"]["network"] == {"denyOut": ["6.6.6.6"]}
    assert [o for o, *_ in await _events(sid)] == ["started", "ok", "started", "ok"]


async def test_an_update_left_in_flight_by_a_dead_process_frees_the_sandbox_later(api, create, net_mock,
                                                                                  monkeypatch):
    sb = await create()
    await SandboxEvent.objects.acreate(sandbox_id=sb["sandboxID"], operation="network", outcome="started")
    monkeypatch.setattr(sandbox_network, "IN_FLIGHT_WINDOW", 0.5)
    assert (await api.put(f"/sandboxes/{sb['sandboxID']}/network", json={})).status_code == 204
    net_mock.client.update_network.assert_awaited_once()


async def test_put_waits_out_a_transitional_state(api, create, net_mock):
    sb = await create()
    await Sandbox.objects.filter(pk=sb["sandboxID"]).aupdate(state="snapshotting")

    async def settle_later():
        await asyncio.sleep(0.3)
        await Sandbox.objects.filter(pk=sb["sandboxID"]).aupdate(state="running")

    later = asyncio.ensure_future(settle_later())
    resp = await api.put(f"/sandboxes/{sb['sandboxID']}/network", json={"denyOut": ["0.0.0.0/0"]})
    await later
    assert resp.status_code == 204, resp.text
    net_mock.client.update_network.assert_awaited_once()


# --------------------------------------------------------------------------- dnsServers


async def test_dns_servers_reach_the_node_as_given_and_omitted_is_not_empty(api, create, nodes_mock):
    """The node enforces them (vmm.net.slots); ``[]`` (no resolver) and omitted (E2B's default)
    must stay apart all the way to the node."""
    domains = {"allowOut": ["api.example.com"], "denyOut": ["0.0.0.0/0"]}
    cases = [({**domains, "dnsServers": [" 1.1.1.1", "9.9.9.9", "1.1.1.1"]}, ["1.1.1.1", "9.9.9.9"]),
             ({**domains, "dnsServers": []}, []), (domains, None),
             ({"dnsServers": ["1.1.1.1"]}, ["1.1.1.1"]),  # no domains: aenv still honours it
             # a private resolver: kept; the slot shuts it unless the operator reopened its range
             ({"dnsServers": ["10.0.0.2"]}, ["10.0.0.2"])]
    for network, expected in cases:
        sb = await create(network=network)
        spec = nodes_mock.client.boot_sandbox.await_args.kwargs["network"]
        assert spec.get("dns_servers", "absent") == ("absent" if expected is None else expected), network
        row = await Sandbox.objects.aget(pk=sb["sandboxID"])
        assert row.network.get("dnsServers", "absent") == ("absent" if expected is None else expected)


async def test_put_network_sets_and_clears_dns_servers_and_resume_and_fork_keep_them(api, create, net_mock):
    sb = await create(allow_internet_access=False)
    sid = sb["sandboxID"]
    resp = await api.put(f"/sandboxes/{sid}/network", json={"dns_servers": ["1.1.1.1"], "allow_internet_access": False})
    assert resp.status_code == 204, resp.text
    kept = _spec(deny=["0.0.0.0/0"], internet=False, dns=["1.1.1.1"])
    assert net_mock.client.update_network.await_args.kwargs["network"] == kept
    assert (await Sandbox.objects.aget(pk=sid)).network == {"dnsServers": ["1.1.1.1"]}
    assert (await api.post(f"/sandboxes/{sid}/pause", json={})).status_code == 204
    assert (await api.post(f"/sandboxes/{sid}/connect", json={"timeout": 60})).status_code == 201
    assert net_mock.client.resume_sandbox.await_args.kwargs["network"] == kept

    net_mock.client.fork_sandbox = mock.AsyncMock(side_effect=fork_each_child)
    kid = (await api.post(f"/sandboxes/{sid}/fork", json={"count": 1})).json()[0]["sandbox"]
    assert [c["network"] for c in net_mock.client.fork_sandbox.await_args.kwargs["children"]] == [kept]
    assert (await Sandbox.objects.aget(pk=kid["sandboxID"])).network == {"dnsServers": ["1.1.1.1"]}
    # an update that leaves them out clears them (E2B: back to the default), like the other egress fields
    assert (await api.put(f"/sandboxes/{sid}/network", json={"allow_internet_access": False})).status_code == 204
    assert net_mock.client.update_network.await_args.kwargs["network"] == _spec(deny=["0.0.0.0/0"], internet=False)
    assert (await Sandbox.objects.aget(pk=sid)).network is None


# --------------------------------------------------------------------------- resume, fork, routes


async def test_resume_passes_the_rows_policy_and_writes_guest_host(api, create, net_mock):
    sb = await create(allow_internet_access=False)
    net_mock.client.resume_sandbox.return_value = {"envd_host": "10.11.0.5", "envd_port": ENVD,
                                                   "guest_host": "10.11.0.5", "pid": 9, "timings": {}}
    assert (await api.post(f"/sandboxes/{sb['sandboxID']}/pause", json={})).status_code == 204
    before = (await Sandbox.objects.aget(pk=sb["sandboxID"])).vm_generation
    assert (await api.post(f"/sandboxes/{sb['sandboxID']}/connect", json={"timeout": 60})).status_code == 201
    assert net_mock.client.resume_sandbox.await_args.kwargs["network"] == _spec(deny=["0.0.0.0/0"], internet=False)
    row = await Sandbox.objects.aget(pk=sb["sandboxID"])
    assert row.guest_host == "10.11.0.5" and row.vm_generation == before + 1


async def test_create_writes_guest_host(api, nodes_mock):
    nodes_mock.client.boot_sandbox.return_value = {"envd_host": "10.11.0.9", "envd_port": ENVD,
                                                   "guest_host": "10.11.0.9", "pid": 3, "timings": {}}
    resp = await api.post("/v2/sandboxes", json={"templateID": "base"})
    assert (await Sandbox.objects.aget(pk=resp.json()["sandboxID"])).guest_host == "10.11.0.9"


def test_a_new_guest_host_is_a_new_route_generation():
    assert "vm_generation" in with_route_generation({"guest_host": "10.11.0.9"})
    assert "vm_generation" not in with_route_generation({"end_at": None})


async def test_fork_children_inherit_the_policy_and_get_their_own_traffic_tokens(api, create, nodes_mock):
    async def fork(node, *, sandbox_id, env_vars, access_token, children, deadline=None):
        return {"parent": {"ok": True}, "timings": {}, "children": [
            {"sandbox_id": c["sandbox_id"], "ok": True, "envd_host": f"10.11.0.{20 + i}", "envd_port": ENVD,
             "guest_host": f"10.11.0.{20 + i}", "pid": i, "timings": {}} for i, c in enumerate(children)]}

    nodes_mock.client.fork_sandbox = mock.AsyncMock(side_effect=fork)
    parent = await create(allow_internet_access=False, network={"allowOut": ["8.8.8.8"], "allowPublicTraffic": False})
    resp = await api.post(f"/sandboxes/{parent['sandboxID']}/fork", json={"count": 2})
    assert resp.status_code == 201, resp.text
    kids = [r["sandbox"] for r in resp.json()]
    tokens = {k["trafficAccessToken"] for k in kids}
    assert len(tokens) == 2 and None not in tokens and parent["trafficAccessToken"] not in tokens
    sent = nodes_mock.client.fork_sandbox.await_args.kwargs["children"]
    assert [c["network"] for c in sent] == [_spec(["8.8.8.8/32"], ["0.0.0.0/0"], internet=False)] * 2
    for i, kid in enumerate(kids):
        row = await Sandbox.objects.aget(pk=kid["sandboxID"])
        assert row.allow_internet_access is False
        assert row.network == {"allowOut": ["8.8.8.8"], "allowPublicTraffic": False}
        assert row.traffic_access_token == kid["trafficAccessToken"] and row.guest_host.startswith("10.11.0.")


async def test_fork_of_a_public_sandbox_has_no_traffic_tokens(api, create, nodes_mock):
    nodes_mock.client.fork_sandbox = mock.AsyncMock(side_effect=fork_each_child)
    parent = await create()
    kid = (await api.post(f"/sandboxes/{parent['sandboxID']}/fork", json={"count": 1})).json()[0]["sandbox"]
    assert kid["trafficAccessToken"] is None
    row = await Sandbox.objects.aget(pk=kid["sandboxID"])
    assert row.traffic_access_token == "" and row.guest_host == ""  # a node without guest_host (slirp)


# --------------------------------------------------------------------------- the SDK's wire


async def test_sdk_2_63_create_and_update_bodies_are_accepted_and_answers_parse(api, nodes_mock, net_mock):
    """The bodies the installed SDK builds (its own builders, ALL_TRAFFIC from a callable),
    and the models it parses our answers with."""
    from e2b.api.client.models import NewSandboxV2, SandboxNetworkConfig  # noqa: PLC0415
    from e2b.api.client.models.sandbox import Sandbox as CreatedSandbox  # noqa: PLC0415
    from e2b.api.client.models.sandbox_detail import SandboxDetail  # noqa: PLC0415
    from e2b.sandbox.network import ALL_TRAFFIC  # noqa: PLC0415
    from e2b.sandbox.sandbox_api import (  # noqa: PLC0415
        build_network_config,
        build_network_update_body,
        from_client_network_config,
        to_sandbox_create_response,
    )

    network = build_network_config({"allow_out": ["1.1.1.1"], "deny_out": lambda ctx: [ctx.all_traffic],
                                    "allow_public_traffic": False, "mask_request_host": "${PORT}-x.example",
                                    "dns_servers": ["8.8.8.8"]})
    body = NewSandboxV2(template_id="base", allow_internet_access=True,
                        network=SandboxNetworkConfig(**network)).to_dict()
    assert body["network"]["denyOut"] == [ALL_TRAFFIC] and body["allow_internet_access"] is True
    resp = await api.post("/v2/sandboxes", json=body)
    assert resp.status_code == 201, resp.text
    created = to_sandbox_create_response(CreatedSandbox.from_dict(resp.json()))
    assert created.traffic_access_token and created.traffic_access_token == resp.json()["trafficAccessToken"]
    assert nodes_mock.client.boot_sandbox.await_args.kwargs["network"] == _spec(["1.1.1.1/32"], [ALL_TRAFFIC],
                                                                                dns=["8.8.8.8"])
    sid = created.sandbox_id

    info = SandboxDetail.from_dict((await api.get(f"/sandboxes/{sid}")).json())
    assert from_client_network_config(info.network) == {
        "allow_out": ["1.1.1.1"], "deny_out": [ALL_TRAFFIC], "dns_servers": ["8.8.8.8"],
        "allow_public_traffic": False, "mask_request_host": "${PORT}-x.example"}
    assert info.allow_internet_access is True

    update = build_network_update_body({"allow_out": ["1.0.0.1"], "deny_out": lambda ctx: [ctx.all_traffic],
                                        "allow_internet_access": True}).to_dict()
    assert update == {"allowOut": ["1.0.0.1"], "denyOut": [ALL_TRAFFIC], "allow_internet_access": True}
    assert (await api.put(f"/sandboxes/{sid}/network", json=update)).status_code == 204
    assert net_mock.client.update_network.await_args.kwargs["network"] == _spec(["1.0.0.1/32"], [ALL_TRAFFIC])
    cleared = build_network_update_body({}).to_dict()
    assert cleared == {} and (await api.put(f"/sandboxes/{sid}/network", json=cleared)).status_code == 204
    info = SandboxDetail.from_dict((await api.get(f"/sandboxes/{sid}")).json())
    assert from_client_network_config(info.network) == {"allow_public_traffic": False,
                                                        "mask_request_host": "${PORT}-x.example"}


# --------------------------------------------------------------------------- network.rules

RULES = {"api.example.com": [{"transform": {"headers": {"Authorization": "Bearer ${e2b.secrets.tok}"}}},
                             {"transform": {"headers": {"X-Two": "2"}}}],
         "*.Example.org.": [{}]}
RULED_NETWORK = {"allowOut": ["api.example.com", "*.example.org"], "denyOut": ["0.0.0.0/0"], "rules": RULES}
STORED_RULES = {"api.example.com": RULES["api.example.com"], "*.example.org": [{}]}
SPEC_RULES = {"api.example.com": [{"Authorization": "Bearer ${e2b.secrets.tok}"}, {"X-Two": "2"}],
              "*.example.org": [{}]}


def _ruled_spec() -> dict:
    return {**_spec(["api.example.com", "*.example.org"], ["0.0.0.0/0"]), "rules": SPEC_RULES}


async def test_rules_are_stored_shown_and_handed_to_the_node_with_markers_only(api, nodes_mock):
    resp = await api.post("/v2/sandboxes", json={"templateID": "base", "network": RULED_NETWORK})
    assert resp.status_code == 201, resp.text
    assert nodes_mock.client.boot_sandbox.await_args.kwargs["network"] == _ruled_spec()
    row = await Sandbox.objects.aget(pk=resp.json()["sandboxID"])
    assert row.network["rules"] == STORED_RULES  # hosts normalised, the E2B shape kept
    assert (await api.get(f"/sandboxes/{row.id}")).json()["network"]["rules"] == STORED_RULES


async def test_a_node_that_cannot_apply_rules_is_400(api, nodes_mock, assert_error):
    nodes_mock.client.boot_sandbox.side_effect = nodes_mock.client.NodeTaskFailed(
        "network.rules need the node's egress proxy with the node's CA", kind="UnsupportedNetworkPolicy")
    resp = await api.post("/v2/sandboxes", json={"templateID": "base", "network": RULED_NETWORK})
    assert_error(resp, 400, "network.rules need the node's egress proxy")


async def test_put_network_with_rules_passes_the_envd_token_so_the_guest_gets_the_ca(api, create, net_mock):
    sb = await create(network={"denyOut": ["8.8.8.8"]})
    resp = await api.put(f"/sandboxes/{sb['sandboxID']}/network", json=RULED_NETWORK)
    assert resp.status_code == 204, resp.text
    row = await Sandbox.objects.aget(pk=sb["sandboxID"])
    kwargs = net_mock.client.update_network.await_args.kwargs
    assert kwargs["network"] == _ruled_spec() and row.envd_access_token
    assert kwargs["access_token"] == row.envd_access_token
    assert row.network["rules"] == STORED_RULES
    # an update without rules clears them (replace semantics)
    assert (await api.put(f"/sandboxes/{sb['sandboxID']}/network", json={})).status_code == 204
    assert "rules" not in net_mock.client.update_network.await_args.kwargs["network"]
    assert (await Sandbox.objects.aget(pk=sb["sandboxID"])).network is None


async def test_resume_and_fork_keep_the_rules(api, create, net_mock):
    sb = await create(network=RULED_NETWORK)
    assert (await api.post(f"/sandboxes/{sb['sandboxID']}/pause", json={})).status_code == 204
    assert (await api.post(f"/sandboxes/{sb['sandboxID']}/connect", json={"timeout": 60})).status_code == 201
    assert net_mock.client.resume_sandbox.await_args.kwargs["network"] == _ruled_spec()

    net_mock.client.fork_sandbox = mock.AsyncMock(side_effect=fork_each_child)
    kid = (await api.post(f"/sandboxes/{sb['sandboxID']}/fork", json={"count": 1})).json()[0]["sandbox"]
    assert [c["network"] for c in net_mock.client.fork_sandbox.await_args.kwargs["children"]] == [_ruled_spec()]
    assert (await Sandbox.objects.aget(pk=kid["sandboxID"])).network["rules"] == STORED_RULES


async def test_the_sdks_rules_body_is_accepted(api, nodes_mock):
    from e2b.api.client.models import NewSandboxV2, SandboxNetworkConfig  # noqa: PLC0415
    from e2b.sandbox.sandbox_api import build_network_config  # noqa: PLC0415

    network = build_network_config({"allow_out": lambda ctx: list(ctx.rules), "deny_out": lambda ctx: [ctx.all_traffic],
                                    "rules": {"api.example.com": [{"transform": {"headers": {"X-Key": "v"}}}]}})
    body = NewSandboxV2(template_id="base", network=SandboxNetworkConfig(**network)).to_dict()
    resp = await api.post("/v2/sandboxes", json=body)
    assert resp.status_code == 201, resp.text
    assert nodes_mock.client.boot_sandbox.await_args.kwargs["network"]["rules"] == {"api.example.com": [{"X-Key": "v"}]}
    from e2b.api.client.models.sandbox_detail import SandboxDetail  # noqa: PLC0415
    from e2b.sandbox.sandbox_api import from_client_network_config  # noqa: PLC0415

    info = SandboxDetail.from_dict((await api.get(f"/sandboxes/{resp.json()['sandboxID']}")).json())
    assert from_client_network_config(info.network)["rules"] == {
        "api.example.com": [{"transform": {"headers": {"X-Key": "v"}}}]}
