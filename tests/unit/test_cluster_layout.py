"""The one-machine cluster's plan (``cluster.layout``) and its root-namespace table
(``cluster.hostnet.ruleset``): distinct names, addresses and pools per node, each
node's settings (its gateway the only ingress source, guests denied the root namespace and
every cluster range), bad layouts refused, and a table nft accepts (checked, not applied)."""
import ipaddress
import shutil
import subprocess

import pytest

from cluster import ClusterLayout, LayoutError
from cluster.hostnet import ruleset


def test_nodes_get_distinct_namespaces_addresses_and_pools():
    layout = ClusterLayout(nodes=16)
    nodes = layout.all_nodes
    assert [n.netns for n in nodes[:3]] == ["aenvh1", "aenvh2", "aenvh3"]
    assert (nodes[0].gateway_ip, nodes[0].address, nodes[0].pool) == ("10.210.1.1", "10.210.1.2", "10.211.0.0/20")
    assert nodes[2].pool == "10.211.32.0/20" and nodes[15].pool == "10.211.240.0/20"
    for field in ("netns", "node_id", "gateway_ip", "address", "pool", "net_prefix", "home"):
        assert len({getattr(n, field) for n in nodes}) == 16, field
    pools = [ipaddress.ip_network(n.pool) for n in nodes]
    assert not any(a.overlaps(b) for i, a in enumerate(pools) for b in pools[i + 1:])
    assert all(ipaddress.ip_network(layout.pool_net).supernet_of(p) for p in pools)
    # slot names of the node's instance stay within Linux's 15 characters (a /20: 2047 slots)
    assert len(f"{nodes[15].net_prefix}v2047") <= 15


def test_a_node_reaches_the_services_through_its_gateway_and_only_it_opens_slots():
    layout = ClusterLayout(nodes=2, redis_db=7)
    env = layout.node(2).env("k", deny_extra=("192.0.2.2/32",))
    assert env["DATABASE_URL"] == "postgres://postgres@10.210.2.1:5432/cluster"
    assert env["CELERY_BROKER_URL"] == "redis://10.210.2.1:6379/7"
    assert env["AENV_CHANNEL_LAYER_URL"] == "redis://10.210.2.1:6379/9"
    assert env["AENV_NODE_ADDRESS"] == "10.210.2.2" and env["AENV_NODE_ID"] == "aenvh-2"
    assert env["AENV_NET_INGRESS_FROM"] == "10.210.2.1/32" and env["AENV_NETWORK"] == "netns"
    assert env["AENV_NET_DENY_EXTRA"].split(",") == ["192.0.2.2/32", "10.210.0.0/16", "10.211.0.0/16"]
    # it joins at the API through its gateway with the token it is given (nodes.join)
    assert env["AENV_CONTROL_PLANE_URL"] == "http://10.210.2.1:3010" and env["AENV_NODE_JOIN_TOKEN"] == ""
    assert layout.node(2).env("k", join_token="aenv_join_x")["AENV_NODE_JOIN_TOKEN"] == "aenv_join_x"
    control = layout.control_env("k")
    assert control["AENV_NODE_JOIN_REQUIRED"] == "1"  # placement leaves a node that did not join alone
    assert control["AENV_NODE_DATABASE_ROLES"] == "1" and "AENV_NODE_DATABASE_ROLES" not in env  # own roles
    assert control["DATABASE_URL"] == "postgres://postgres@127.0.0.1:5432/cluster"
    assert control["DJANGO_SECRET_KEY"] == env["DJANGO_SECRET_KEY"] == "k"
    assert control["AENV_HOME"] != env["AENV_HOME"]
    # signed node tasks: every process trusts the cluster's certificate; only the control plane signs
    assert control["AENV_TASK_SIGNING_CERT"] == env["AENV_TASK_SIGNING_CERT"] == str(layout.signing_dir / "cert.pem")
    assert control["AENV_TASK_SIGNING_KEY"] == str(layout.signing_dir / "key.pem")
    assert "AENV_TASK_SIGNING_KEY" not in env


@pytest.mark.parametrize("kwargs, words", [
    ({"nodes": 0}, "between 1 and 16"), ({"nodes": 17}, "between 1 and 16"),
    ({"name": "Aenv-1"}, "lowercase letters"), ({"name": "toolongname"}, "lowercase letters"),
    ({"link_net": "10.210.0.0/24"}, "/19 or larger"), ({"pool_net": "10.211.0.0/17"}, "/16 or larger"),
    ({"link_net": "10.0.0.0/8", "pool_net": "10.211.0.0/16"}, "overlaps"), ({"redis_db": 14}, "redis_db"),
])
def test_bad_layouts_are_refused(kwargs, words):
    with pytest.raises(LayoutError, match=words):
        ClusterLayout(**kwargs)


def test_the_root_table_opens_exactly_the_service_ports_to_the_nodes():
    layout = ClusterLayout(nodes=2, pg_port=5433, redis_port=6380)
    text = ruleset(layout, "eth0")
    assert 'elements = { "aenvh1", "aenvh2" }' in text and "elements = { 10.210.1.1, 10.210.2.1 }" in text
    # PostgreSQL, Redis and the API (where nodes join): DNAT, source rewrite, input accept; nothing else
    assert text.count("{ 5433, 6380, 3010 }") == 3
    assert "iifname @links oifname @links drop" in text and "iifname @links drop" in text
    assert 'iifname "eth0" drop' in text and 'iifname "eth0"' not in ruleset(layout, None)


@pytest.mark.skipif(shutil.which("nft") is None, reason="needs nft")
def test_nft_accepts_the_root_table():
    done = subprocess.run(["nft", "-c", "-f", "-"], input=ruleset(ClusterLayout(nodes=3), "eth0"),
                          capture_output=True, text=True)
    if "Operation not permitted" in done.stderr:
        pytest.skip("nft -c needs CAP_NET_ADMIN")
    assert done.returncode == 0, done.stderr
