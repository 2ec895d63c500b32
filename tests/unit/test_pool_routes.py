"""Per-node pools (nodes.pools) and the routes to them (nodes.pool_routes, manage.py
sync_pool_routes): real routes in a network namespace of the test's own."""
import ipaddress
import socket
import uuid

import pytest

from nodes import pool_routes, pools
from vmm.net import slots

Net = ipaddress.IPv4Network
Addr = ipaddress.IPv4Address


def _write(folder, **by_node):
    for name, text in by_node.items():
        (folder / name).write_text(text + "\n")
    return folder


def test_read_pools_skips_configmap_links_and_hidden_entries(tmp_path):
    _write(tmp_path, **{"node-a": "10.212.0.0/20", "node-b": "10.212.16.0/20"})
    (tmp_path / "..data").mkdir()
    (tmp_path / ".hidden").write_text("garbage")
    assert pools.read_pools(tmp_path) == {"node-a": Net("10.212.0.0/20"), "node-b": Net("10.212.16.0/20")}
    assert pools.pool_of(tmp_path, "node-b") == Net("10.212.16.0/20")


@pytest.mark.parametrize("files, message", [
    ({"a": "10.212.0.0/20", "b": "10.212.8.0/21"}, "node a's pool 10.212.0.0/20 overlaps node b's 10.212.8.0/21"),
    ({"a": "10.212.0.0/33"}, "the pool of node a ('10.212.0.0/33') is not an IPv4 network"),
    ({"a": "fd00::/64"}, "is not an IPv4 network"),
])
def test_a_bad_folder_is_refused_whole(tmp_path, files, message):
    _write(tmp_path, **files)
    with pytest.raises(pools.PoolError, match=message.replace("(", r"\(").replace(")", r"\)")):
        pools.read_pools(tmp_path)


def test_a_node_without_a_pool_is_named(tmp_path, capsys):
    _write(tmp_path, a="10.212.0.0/20")
    with pytest.raises(pools.PoolError, match="no slot pool for node b"):
        pools.pool_of(tmp_path, "b")
    assert pools.main([str(tmp_path), "b"]) == 1
    assert "add the key b to the aenv-node-pools ConfigMap" in capsys.readouterr().err
    assert pools.main([str(tmp_path), "a"]) == 0
    assert capsys.readouterr().out.strip() == "10.212.0.0/20"


def test_desired_routes_skip_this_machine_unknown_nodes_and_unresolvable_addresses():
    folder = {"a": Net("10.212.0.0/20"), "b": Net("10.212.16.0/20"), "c": Net("10.212.32.0/20"),
              "d": Net("10.212.48.0/20"), "e": Net("10.212.64.0/20")}
    addresses = {"a": "10.0.0.11", "b": "10.0.0.12", "d": "no-such-host.invalid", "e": "localhost"}
    assert pool_routes.desired_routes(folder, addresses, local={Addr("10.0.0.12"), Addr("127.0.0.1")}) == {
        Net("10.212.0.0/20"): Addr("10.0.0.11")}


netns_only = pytest.mark.skipif(not slots.netns_supported(), reason="needs root and network namespaces")


@pytest.fixture
def machine():
    """A network namespace standing in for a machine of the cluster's network: 10.77.0.1/24
    on a veth interface (nodes at .11, .12 are on-link), and one route of the operator's."""
    from pyroute2 import NetNS, netns  # noqa: PLC0415
    name = f"aenv-rt-{uuid.uuid4().hex[:8]}"
    netns.create(name)
    try:
        with NetNS(name) as ns:
            ns.link("add", ifname="lan0", kind="veth", peer="lan1")
            idx = ns.link_lookup(ifname="lan0")[0]
            ns.addr("add", index=idx, address="10.77.0.1", prefixlen=24)
            ns.link("set", index=idx, state="up")
            ns.link("set", index=ns.link_lookup(ifname="lan1")[0], state="up")
            ns.route("add", dst="10.212.96.0/20", gateway="10.77.0.99", proto=4)   # the operator's ("static")
            yield name
    finally:
        netns.remove(name)


def _routes(name):
    from pyroute2 import NetNS  # noqa: PLC0415
    with NetNS(name) as ns:
        return {(str(pool_routes._dst_of(r)), r.get_attr("RTA_GATEWAY"), r["proto"])
                for r in ns.get_routes(family=socket.AF_INET, table=254) if pool_routes._dst_of(r) is not None}


def _sync(name, folder, addresses):
    from pyroute2 import NetNS  # noqa: PLC0415
    with NetNS(name) as ns:
        return pool_routes.sync(ns, folder, addresses)


@netns_only
def test_sync_adds_repoints_and_removes_only_its_own_routes(machine, caplog):
    P = pool_routes.ROUTE_PROTO
    folder = {"a": Net("10.212.0.0/20"), "b": Net("10.212.16.0/20"), "me": Net("10.212.32.0/20"),
              "ops": Net("10.212.96.0/20")}
    addresses = {"a": "10.77.0.11", "b": "10.77.0.12", "me": "10.77.0.1", "ops": "10.77.0.13"}
    changes = _sync(machine, folder, addresses)
    assert {(c.action, str(c.pool), c.gateway) for c in changes} == {
        ("add", "10.212.0.0/20", "10.77.0.11"), ("add", "10.212.16.0/20", "10.77.0.12")}
    routes = _routes(machine)
    assert ("10.212.0.0/20", "10.77.0.11", P) in routes and ("10.212.16.0/20", "10.77.0.12", P) in routes
    assert not any(dst == "10.212.32.0/20" for dst, _, _ in routes), "this machine's own pool got a route"
    assert ("10.212.96.0/20", "10.77.0.99", 4) in routes, "the operator's route was changed"
    assert "already routed on this machine by something else" in caplog.text

    assert _sync(machine, folder, addresses) == [], "a second pass with nothing new changed something"

    # Node b moved to another address; node a left the folder.
    del folder["a"]
    addresses["b"] = "10.77.0.22"
    changes = _sync(machine, folder, addresses)
    assert {(c.action, str(c.pool), c.gateway) for c in changes} == {
        ("replace", "10.212.16.0/20", "10.77.0.22"), ("delete", "10.212.0.0/20", "10.77.0.11")}
    routes = _routes(machine)
    assert ("10.212.16.0/20", "10.77.0.22", P) in routes
    assert not any(dst == "10.212.0.0/20" for dst, _, _ in routes)
    assert ("10.212.96.0/20", "10.77.0.99", 4) in routes


@netns_only
def test_a_gateway_off_this_network_is_logged_not_fatal(machine, caplog):
    changes = _sync(machine, {"far": Net("10.212.0.0/20"), "near": Net("10.212.16.0/20")},
                    {"far": "192.0.2.7", "near": "10.77.0.12"})
    assert [(c.action, str(c.pool)) for c in changes] == [("add", "10.212.16.0/20")]
    assert "10.212.0.0/20 via 192.0.2.7: cannot route" in caplog.text


@netns_only
@pytest.mark.django_db
def test_the_command_routes_the_nodes_in_the_database(machine, tmp_path, monkeypatch):
    from pyroute2 import NetNS  # noqa: PLC0415

    from nodes.management.commands import sync_pool_routes  # noqa: PLC0415
    from nodes.models import Node  # noqa: PLC0415
    Node.objects.create(id="node-a", address="10.77.0.11")
    Node.objects.create(id="node-b", address="10.77.0.12")
    folder = tmp_path / "pools"
    folder.mkdir()
    _write(folder, **{"node-a": "10.212.0.0/20", "node-b": "10.212.16.0/20"})
    monkeypatch.setattr(sync_pool_routes, "IPRoute", lambda: NetNS(machine))
    beat = tmp_path / "alive"
    command = sync_pool_routes.Command()
    assert command.one_pass(folder, beat) is True
    assert beat.exists()
    routes = _routes(machine)
    assert ("10.212.0.0/20", "10.77.0.11", pool_routes.ROUTE_PROTO) in routes
    assert ("10.212.16.0/20", "10.77.0.12", pool_routes.ROUTE_PROTO) in routes

    # An overlapping folder (being rewritten badly) changes nothing and says why.
    (folder / "node-c").write_text("10.212.0.0/16")
    beat.unlink()
    assert command.one_pass(folder, beat) is False
    assert not beat.exists()
    assert ("10.212.0.0/20", "10.77.0.11", pool_routes.ROUTE_PROTO) in _routes(machine)
