"""The unchanged E2B Python SDK 2.63's network calls (``Sandbox.create(network=…,
allow_internet_access=…)``, ``update_network`` as an instance and a class method, sync and
async, and the ``network`` that ``get_info`` parses back) against the real API served by
uvicorn on 127.0.0.1. No VM: the node is a mock, so these tests check what the SDK sends, that
aenv takes it, what the node is told and what the SDK reads back; whether a guest's packets
obey the policy is the VM tests' (tests/integration/test_network_e2e.py,
test_egress_domains.py)."""
import asyncio
from unittest import mock

import pytest
from e2b import ALL_TRAFFIC, AsyncSandbox, Sandbox, SandboxException, Secret
from e2b_code_interpreter import Sandbox as CodeInterpreterSandbox

from sandboxes.models import Sandbox as SandboxRow
from tests.unit.asgi_server import served_to_sdk

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

RULED = "api.example.com"
MARKER = Secret.fill("tok")  # "${e2b.secrets.tok}": what the guest may see of a secret


@pytest.fixture
def node_network(nodes_mock):
    nodes_mock.client.update_network = mock.AsyncMock(return_value={"timings": {"total_ms": 1.0}})
    return nodes_mock


@pytest.fixture
async def server(asgi_app, base_template, raw_key, node_network, monkeypatch):
    """The API on a free port; the SDK pointed at it with team A's key."""
    async with served_to_sdk(asgi_app, monkeypatch, raw_key) as url:
        yield url


def sdk(fn, *args, **kwargs):
    return asyncio.to_thread(fn, *args, **kwargs)


def told_at_boot(nodes_mock) -> dict:
    return nodes_mock.client.boot_sandbox.await_args.kwargs["network"]


def told_at_update(nodes_mock) -> dict:
    return nodes_mock.client.update_network.await_args.kwargs["network"]


async def test_create_with_every_enforced_option_and_read_it_back(server, node_network):
    """Addresses, CIDRs and domain names in ``allow_out``, ``deny_out`` as a callable,
    ``rules`` with a static transform holding a secret's marker and a callable transform,
    ``allow_public_traffic``, ``mask_request_host``, ``dns_servers``."""
    network = {
        "allow_out": ["1.1.1.1", "10.1.0.0/16", RULED, "*.example.org"],
        "deny_out": lambda ctx: [ctx.all_traffic],
        "rules": {RULED: [{"transform": {"headers": {"Authorization": f"Bearer {MARKER}"}}}],
                  "*.example.org": [{"transform": lambda ctx: {"headers": {"X-From": "callable"}}}]},
        "allow_public_traffic": False,
        "mask_request_host": "${PORT}-masked.example",
        "dns_servers": ["9.9.9.9"],
    }
    sbx = await sdk(Sandbox.create, network=network, allow_internet_access=True)
    told = told_at_boot(node_network)
    assert told["allow_out"] == ["1.1.1.1/32", "10.1.0.0/16", RULED, "*.example.org"]
    assert told["deny_out"] == [ALL_TRAFFIC]
    assert told["rules"] == {RULED: [{"Authorization": f"Bearer {MARKER}"}], "*.example.org": [{"X-From": "callable"}]}
    assert told["dns_servers"] == ["9.9.9.9"]  # the node lets the guest's DNS reach it (vmm.net.slots)
    assert sbx.traffic_access_token  # allow_public_traffic=False: the user ports need a token

    info = await sdk(sbx.get_info)
    assert info.allow_internet_access is True
    assert info.network == {
        "allow_out": ["1.1.1.1", "10.1.0.0/16", RULED, "*.example.org"], "deny_out": [ALL_TRAFFIC],
        "rules": {RULED: [{"transform": {"headers": {"Authorization": f"Bearer {MARKER}"}}}],
                  "*.example.org": [{"transform": {"headers": {"X-From": "callable"}}}]},
        "dns_servers": ["9.9.9.9"], "allow_public_traffic": False, "mask_request_host": "${PORT}-masked.example"}
    assert await sdk(sbx.kill) is True


async def test_allow_internet_access_false_closes_egress(server, node_network):
    sbx = await sdk(Sandbox.create, allow_internet_access=False)
    assert told_at_boot(node_network)["deny_out"] == [ALL_TRAFFIC]
    info = await sdk(Sandbox.get_info, sbx.sandbox_id)
    assert info.allow_internet_access is False


async def test_update_network_on_the_instance_and_the_class(server, node_network):
    sbx = await sdk(Sandbox.create, network={"deny_out": ["8.8.8.8"]})
    await sdk(sbx.update_network, {"allow_out": [RULED], "deny_out": lambda ctx: [ctx.all_traffic],
                                   "rules": {RULED: [{"transform": {"headers": {"X-Key": MARKER}}}]}})
    assert told_at_update(node_network)["rules"] == {RULED: [{"X-Key": MARKER}]}
    info = await sdk(sbx.get_info)
    assert info.network["allow_out"] == [RULED] and info.network["deny_out"] == [ALL_TRAFFIC]
    assert info.network["rules"] == {RULED: [{"transform": {"headers": {"X-Key": MARKER}}}]}

    await sdk(Sandbox.update_network, sbx.sandbox_id, {"allow_internet_access": False})
    assert told_at_update(node_network)["deny_out"] == [ALL_TRAFFIC]
    assert "rules" not in told_at_update(node_network)  # an update replaces the whole policy
    await sdk(Sandbox.update_network, sbx.sandbox_id, {})  # open again
    assert told_at_update(node_network)["deny_out"] == []
    assert (await sdk(sbx.get_info)).network is None
    assert node_network.client.update_network.await_count == 3


async def test_dns_servers_round_trip_and_an_update_without_them_resets_them(server, node_network):
    """E2B: ``dns_servers`` replaces the default 8.8.8.8 (``[]``: none) and, like the other
    egress fields, an update that leaves it out resets it; the metadata address is a 400."""
    sbx = await sdk(Sandbox.create, network={"allow_out": [RULED], "deny_out": [ALL_TRAFFIC], "dns_servers": []})
    assert told_at_boot(node_network)["dns_servers"] == []
    assert (await sdk(sbx.get_info)).network["dns_servers"] == []
    await sdk(sbx.update_network, {"allow_out": [RULED], "deny_out": [ALL_TRAFFIC], "dns_servers": ["1.1.1.1"]})
    assert told_at_update(node_network)["dns_servers"] == ["1.1.1.1"]
    assert (await sdk(sbx.get_info)).network["dns_servers"] == ["1.1.1.1"]
    await sdk(sbx.update_network, {"allow_out": [RULED], "deny_out": [ALL_TRAFFIC]})
    assert "dns_servers" not in told_at_update(node_network)  # back to E2B's default
    assert "dns_servers" not in (await sdk(sbx.get_info)).network
    with pytest.raises(SandboxException, match="never reach 169.254.0.0/16") as err:
        await sdk(sbx.update_network, {"dns_servers": ["169.254.169.254"]})
    assert err.value.status_code == 400 and node_network.client.update_network.await_count == 2


async def test_what_aenv_refuses_is_a_400_the_sdk_raises(server, node_network):
    """``https_ports`` (the data plane speaks plain HTTP to guest ports) and E2B's own rules
    (a domain name in ``deny_out``, ``rules`` for a host not allowed by name): a 400 the SDK
    raises as ``SandboxException`` (status 400) with aenv's reason, and no sandbox."""
    refused = [({"https_ports": [8443]}, "httpsPorts"), ({"deny_out": [RULED]}, "invalid denied CIDR"),
               ({"allow_out": ["1.1.1.1"], "rules": {RULED: [{}]}}, "rules")]
    for network, reason in refused:
        with pytest.raises(SandboxException, match=reason) as err:
            await sdk(Sandbox.create, network=network)
        assert err.value.status_code == 400
    node_network.client.boot_sandbox.assert_not_awaited()
    sbx = await sdk(Sandbox.create)
    with pytest.raises(SandboxException, match="invalid denied CIDR"):
        await sdk(sbx.update_network, {"deny_out": [RULED]})
    node_network.client.update_network.assert_not_awaited()
    assert await SandboxRow.objects.acount() == 1


async def test_the_async_sdk(server, node_network):
    sbx = await AsyncSandbox.create(network={"allow_out": lambda ctx: list(ctx.rules), "deny_out": [ALL_TRAFFIC],
                                             "rules": {RULED: [{"transform": {"headers": {"X-A": "1"}}}]}})
    assert told_at_boot(node_network)["rules"] == {RULED: [{"X-A": "1"}]}
    assert told_at_boot(node_network)["allow_out"] == [RULED]
    await sbx.update_network({"deny_out": ["7.7.7.0/24"]})
    assert told_at_update(node_network)["deny_out"] == ["7.7.7.0/24"]
    await AsyncSandbox.update_network(sbx.sandbox_id, {"allow_out": ["2.2.2.2"], "deny_out": [ALL_TRAFFIC]})
    assert told_at_update(node_network)["allow_out"] == ["2.2.2.2/32"]
    info = await sbx.get_info()
    assert info.network == {"allow_out": ["2.2.2.2"], "deny_out": [ALL_TRAFFIC]}
    assert await sbx.kill() is True


async def test_the_code_interpreter_sandbox_takes_the_same_options(server, node_network):
    """``e2b_code_interpreter.Sandbox`` subclasses the SDK's: the same create and update calls."""
    sbx = await sdk(CodeInterpreterSandbox.create, "base", network={"allow_out": [RULED], "deny_out": [ALL_TRAFFIC],
                                                                     "rules": {RULED: [{}]}})
    assert told_at_boot(node_network)["allow_out"] == [RULED]
    await sdk(sbx.update_network, {"deny_out": ["8.8.8.8"]})
    assert (await sdk(sbx.get_info)).network == {"deny_out": ["8.8.8.8"]}
