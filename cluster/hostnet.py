"""The network of a one-machine cluster: one namespace per node ("its host"), joined to the
root namespace by a veth, and the root namespace's nftables table for them.

Why this shape: each node must be a host of its own (its address, its slot pool, its
nftables table) while PostgreSQL and Redis listen on the root namespace's loopback only.
So the root namespace is the nodes' gateway: it routes each node's slot pool to that node
(the data plane and the dashboard terminal reach guests through it; each node accepts them
through ``AENV_NET_INGRESS_FROM``), forwards and masquerades the nodes' egress, and lets a
node reach exactly the database and broker ports on its gateway address (DNAT to 127.0.0.1,
with ``route_localnet`` on that link only, and the source rewritten to 127.0.0.1 so the
services' loopback-only trust holds). Nothing else of the root namespace is open to a node,
nodes do not reach each other, and nothing outside opens a connection into a node.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

from cluster.layout import UPLINK, ClusterLayout, NodeLayout

TABLE_PREFIX = "aenvcluster_"


class NetworkError(Exception):
    """A namespace, link, route or rule could not be set up."""


def _run(*argv: str, check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=60)
    if check and done.returncode != 0:
        raise NetworkError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done


def in_netns(netns: str, *argv: str) -> list[str]:
    """``argv`` run in network namespace ``netns`` (the mount namespace stays the host's, so
    the slot namespaces a node makes under /run/netns are everyone's)."""
    return ["nsenter", f"--net=/run/netns/{netns}", "--", *argv]


def namespaces() -> set[str]:
    out = _run("ip", "-j", "netns", "list", check=False).stdout.strip()
    return {n["name"] for n in json.loads(out)} if out else set()


def root_addresses() -> tuple[str, ...]:
    """The root namespace's IPv4 addresses (loopback aside) as /32s: guests must reach none."""
    found = json.loads(_run("ip", "-j", "-4", "addr", "show").stdout or "[]")
    out = {f"{a['local']}/32" for link in found for a in link.get("addr_info", [])
           if a.get("local") and not a["local"].startswith("127.")}
    return tuple(sorted(out))


def uplink() -> str | None:
    """The device of the root namespace's default route (where egress leaves), if any."""
    routes = json.loads(_run("ip", "-j", "-4", "route", "show", "default").stdout or "[]")
    return routes[0].get("dev") if routes else None


def ruleset(layout: ClusterLayout, uplink_dev: str | None) -> str:
    """The root namespace's table for the cluster (one transaction, replacing any earlier)."""
    links = ", ".join(f'"{n.link}"' for n in layout.all_nodes)
    gateways = ", ".join(n.gateway_ip for n in layout.all_nodes)
    # PostgreSQL and Redis, and the API: each node joins there with its join token (nodes.join).
    ports = f"{{ {layout.pg_port}, {layout.redis_port}, {layout.api_port} }}"
    guard = (f'        iifname "{uplink_dev}" ct state established,related accept\n'
             f'        iifname "{uplink_dev}" drop\n') if uplink_dev else ""
    return f"""
table inet {layout.table}
delete table inet {layout.table}
table inet {layout.table} {{
    set links {{ type ifname; elements = {{ {links} }} }}
    set gateways {{ type ipv4_addr; elements = {{ {gateways} }} }}
    chain services {{
        type nat hook prerouting priority dstnat; policy accept;
        iifname @links ip daddr @gateways tcp dport {ports} dnat ip to 127.0.0.1
    }}
    chain services_source {{
        type nat hook input priority 100; policy accept;
        iifname @links ip daddr 127.0.0.1 tcp dport {ports} snat ip to 127.0.0.1
    }}
    chain input {{
        type filter hook input priority -10; policy accept;
        iifname @links ct state established,related accept
        iifname @links ct status dnat ip daddr 127.0.0.1 tcp dport {ports} accept
        iifname @links drop
    }}
    chain forward {{
        type filter hook forward priority -10; policy accept;
        iifname @links oifname @links drop
        oifname @links ct state established,related accept
        oifname @links drop
{guard}    }}
    chain egress {{
        type nat hook postrouting priority srcnat; policy accept;
        ip saddr {layout.link_net} oifname != @links masquerade
    }}
}}
"""


def install_table(layout: ClusterLayout, uplink_dev: str | None) -> None:
    _run("nft", "-f", "-", stdin=ruleset(layout, uplink_dev))


def remove_table(layout: ClusterLayout) -> bool:
    return _run("nft", "delete", "table", "inet", layout.table, check=False).returncode == 0


def cluster_tables() -> list[str]:
    """The root namespace's tables of every cluster up on this machine."""
    out = _run("nft", "-j", "list", "tables", check=False).stdout
    names = [t["table"]["name"] for t in json.loads(out or '{"nftables": []}')["nftables"] if "table" in t]
    return [n for n in names if n.startswith(TABLE_PREFIX)]


def other_cluster_tables(layout: ClusterLayout) -> list[str]:
    return [n for n in cluster_tables() if n != layout.table]


def sysctl(key: str, value: str | None = None, netns: str | None = None) -> str:
    """Reads (``value`` None) or writes one sysctl, in ``netns`` if given."""
    argv = ["sysctl", "-n", key] if value is None else ["sysctl", "-q", "-w", f"{key}={value}"]
    return _run(*(in_netns(netns, *argv) if netns else argv)).stdout.strip()


def _link_up(node: NodeLayout) -> bool:
    """The node's namespace and link exist with the root side's address."""
    if node.netns not in namespaces():
        return False
    found = json.loads(_run("ip", "-j", "-4", "addr", "show", "dev", node.link, check=False).stdout or "[]")
    return any(a.get("local") == node.gateway_ip for link in found for a in link.get("addr_info", []))


def ensure_node(node: NodeLayout) -> bool:
    """The node's namespace ("host"), its link and routes; a half-made one is made again.
    True if something was made."""
    if _link_up(node):
        _run("ip", "route", "replace", node.pool, "via", node.address, "dev", node.link)
        return False
    remove_node(node)
    ns = node.netns
    try:
        _run("ip", "netns", "add", ns)
        _run("ip", "link", "add", node.link, "type", "veth", "peer", "name", UPLINK, "netns", ns)
        _run("ip", "addr", "add", f"{node.gateway_ip}/30", "dev", node.link)
        _run("ip", "link", "set", node.link, "up")
        # forwarding for the node's traffic, and the DNAT of its service ports to loopback: on this link only
        sysctl(f"net.ipv4.conf.{node.link}.forwarding", "1")
        sysctl(f"net.ipv4.conf.{node.link}.route_localnet", "1")
        for argv in (("ip", "link", "set", "lo", "up"), ("ip", "addr", "add", f"{node.address}/30", "dev", UPLINK),
                     ("ip", "link", "set", UPLINK, "up"), ("ip", "route", "add", "default", "via", node.gateway_ip)):
            _run(*in_netns(ns, *argv))
        # the node is its slots' router (a new namespace starts with forwarding off); no IPv6
        sysctl("net.ipv4.ip_forward", "1", netns=ns)
        sysctl("net.ipv6.conf.all.disable_ipv6", "1", netns=ns)
        sysctl("net.ipv6.conf.default.disable_ipv6", "1", netns=ns)
        _run("ip", "route", "replace", node.pool, "via", node.address, "dev", node.link)
    except BaseException:
        remove_node(node)
        raise
    return True


def remove_node(node: NodeLayout) -> bool:
    """The node's namespace and its link (routes go with the link). False if neither existed."""
    found = _run("ip", "link", "del", node.link, check=False).returncode == 0
    if node.netns in namespaces():
        _run("ip", "netns", "del", node.netns)
        found = True
    return found


UPLINK_STATE = Path("/run/aenv-cluster-uplink.json")  # machine-wide; /run is cleared at boot like sysctls


class UplinkForwarding:
    """Egress needs forwarding on the uplink too (replies come in there). Turned on while any
    cluster is up — each cluster's table forwards nothing from the uplink but replies — and put
    back as it was when the last cluster goes: the first cluster up remembers the value in
    ``state``, shared by every cluster of the machine."""

    def __init__(self, state: Path = UPLINK_STATE):
        self.state = state

    def enable(self, dev: str) -> None:
        key = f"net.ipv4.conf.{dev}.forwarding"
        if not self.state.exists():
            self.state.write_text(json.dumps({"dev": dev, "forwarding": sysctl(key)}))
        sysctl(key, "1")

    def restore(self, layout: ClusterLayout) -> None:
        """After ``layout``'s table is gone: the saved value back, unless another cluster is up."""
        if not self.state.exists() or other_cluster_tables(layout):
            return
        saved = json.loads(self.state.read_text())
        _run("sysctl", "-q", "-w", f"net.ipv4.conf.{saved['dev']}.forwarding={saved['forwarding']}", check=False)
        self.state.unlink()
