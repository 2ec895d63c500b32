"""The node's own nftables table for its network slots (one per aenv instance).

Why on the host as well as in each slot: the slot's table keeps a guest inside its own
rules, but the slot's netns itself is a router the node must not trust. Here the node
drops anything a slot starts toward the node (its Redis, database, API and every other
local address), drops slot-to-slot traffic and new connections into a slot that the node
did not open, masquerades the slot pool toward the uplink (guests' egress leaves from the
node's uplink address) and gives the guests' TCP flows shorter conntrack timeouts, so the
slot's flow limit bounds what a guest holds in the node's table (vmm.net.conntrack). Drops in base chains are
final whatever other tables accept — and so are other tables' drops: where the host's firewall
drops forwarded traffic (Docker), the table comes with the slots' accepts there
(vmm.net.host_firewall). Rebuilt whole in one transaction at node start; slots
join and leave its ``veths`` set. Design: ``../shared/research/networking.md`` §2.3.

Ingress sources (``AENV_NET_INGRESS_FROM``): where the data plane or the dashboard runs on
another machine (or, on one machine, in another network namespace: ``scripts/cluster.sh``),
it must open connections into this node's slots too. The operator lists its addresses;
new connections from them into a slot are accepted, and a slot may never open one toward
them (the slots' own tables deny them as well: ``vmm.net.netns``). Never the pool or the
guests' link-local side: a guest must not become a gateway. Empty: only the node itself."""
from __future__ import annotations

import ipaddress
import logging
import subprocess

from . import conntrack, host_firewall
from .cidrs import checked_ipv4
from .slots import CHAIN_PORT, PROXY_PORT

log = logging.getLogger(__name__)


class HostTableError(Exception):
    """nft refused the node's table or a change to it."""


def table_name(prefix: str) -> str:
    return f"aenv_{prefix}"


GUEST_SIDE = ipaddress.ip_network("169.254.0.0/16")  # every slot's guest link (vmm.net.slots)


def ingress_sources(cidrs, pool: str) -> tuple[str, ...]:
    """``cidrs`` (strings) as normalised IPv4 networks, or HostTableError saying which one
    cannot be an ingress source: not IPv4, or overlapping the slot pool or the guests' side."""
    forbidden = ((ipaddress.ip_network(pool), f"the slot pool {pool}"),
                 (GUEST_SIDE, "the guests' side 169.254.0.0/16"))
    return checked_ipv4(cidrs, forbidden, "ingress source", "a guest must never be a gateway", HostTableError)


def _names(veths: tuple[str, ...]) -> str:
    quoted = ", ".join('"' + v + '"' for v in veths)
    return f"elements = {{ {quoted} }}" if veths else ""


def ruleset(prefix: str, pool: str, veths: tuple[str, ...] = (), dns_ip: str | None = None,
            ingress: tuple[str, ...] = (), chained: tuple[str, ...] = ()) -> str:
    """The whole table, replacing any earlier one of this instance (one ``nft -f``).
    ``ingress``: sources that may open connections into a slot besides the node. A slot sends
    a domain sandbox's TCP to ``dns_ip`` with the guest's port kept (vmm.net.slots); here it
    goes on to the egress proxy's one listener (vmm.net.egress), DNS (53) excepted.
    ``chained``: the veths of slots whose sandbox has an upstream proxy (``network.egressProxy``):
    every TCP connection their table lets out by address (not sent to ``dns_ip`` for a name
    to be judged) goes to the egress proxy's relay (``CHAIN_PORT``), its destination unchanged
    until here (``SO_ORIGINAL_DST`` gives it the address and port the guest dialled), so it
    leaves through the upstream as well."""
    name = table_name(prefix)
    elements = _names(veths)
    sources = ingress_sources(ingress, pool)
    ingress_elements = f"elements = {{ {', '.join(sources)} }}" if sources else ""
    dns = (f'        iifname @veths ip daddr {dns_ip} udp dport 53 accept\n'
           f'        iifname @veths ip daddr {dns_ip} tcp dport 53 accept\n') if dns_ip else ""
    if dns_ip:
        dns += f'        iifname @veths ip daddr {dns_ip} tcp dport {{ {PROXY_PORT}, {CHAIN_PORT} }} accept\n'
    to_proxy = (f"""    chain to_proxy {{
        type nat hook prerouting priority dstnat; policy accept;
        iifname @veths ip daddr {dns_ip} tcp dport != 53 dnat ip to {dns_ip}:{PROXY_PORT}
        iifname @chained ip daddr != {dns_ip} meta l4proto tcp dnat ip to {dns_ip}:{CHAIN_PORT}
    }}
""" if dns_ip else "")
    return f"""
table inet {name}
delete table inet {name}
table inet {name} {{
    set veths {{ type ifname; {elements} }}
    set chained {{ type ifname; {_names(chained)} }}
    set ingress {{ type ipv4_addr; flags interval; auto-merge; {ingress_elements} }}
{conntrack.node_timeout_object()}    chain timeouts {{
        type filter hook prerouting priority -150; policy accept;
        iifname @veths ct state new meta l4proto tcp ct timeout set "{conntrack.TIMEOUT_POLICY}"
    }}
    chain input {{
        type filter hook input priority -10; policy accept;
        iifname @veths ct state established,related accept
{dns}        iifname @veths drop
    }}
    chain forward {{
        type filter hook forward priority -10; policy accept;
        iifname @veths oifname @veths drop
        iifname @veths ip daddr @ingress ct state new drop
        oifname @veths ip saddr @ingress ct state new accept
        oifname @veths ct state new drop
    }}
{to_proxy}    chain post {{
        type nat hook postrouting priority srcnat; policy accept;
        ip saddr {pool} oifname != @veths masquerade
    }}
}}
"""


def _nft(script: str) -> None:
    done = subprocess.run(["nft", "-f", "-"], input=script, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise HostTableError(f"nft: {done.stderr.strip() or done.returncode}")


def install(prefix: str, pool: str, veths: tuple[str, ...] = (), dns_ip: str | None = None,
            ingress: tuple[str, ...] = (), chained: tuple[str, ...] = ()) -> None:
    """(Re)builds the instance's table with the given slot veths (``chained``: those whose
    TCP goes through the egress proxy to an upstream), atomically, and puts the slots'
    accepts into the host's firewall where it drops forwarded traffic."""
    _nft(ruleset(prefix, pool, veths, dns_ip, ingress, chained))
    try:
        host_firewall.ensure(prefix, pool)
    except host_firewall.HostFirewallError as exc:  # the slot pool checks again (vmm.net.slot_pool)
        log.warning("could not put the slots' accepts into the host firewall: %s", exc)


def exists(prefix: str) -> bool:
    done = subprocess.run(["nft", "list", "table", "inet", table_name(prefix)], capture_output=True, text=True,
                          timeout=30)
    return done.returncode == 0


def ensure(prefix: str, pool: str, dns_ip: str | None = None, ingress: tuple[str, ...] = ()) -> None:
    """Installs the instance's table if it has none (a driver that makes slots before, or
    without, a node start); never replaces a live one."""
    if not exists(prefix):
        install(prefix, pool, (), dns_ip, ingress)


def add_veth(prefix: str, veth: str) -> None:
    _nft(f'add element inet {table_name(prefix)} veths {{ "{veth}" }}\n')


def remove_veth(prefix: str, veth: str) -> None:
    """Takes a slot's veth out of ``veths`` and ``chained`` (a later slot of that name must not
    inherit an upstream: the add makes the delete from ``chained`` succeed when it is absent)."""
    name = table_name(prefix)
    try:
        _nft(f'add element inet {name} chained {{ "{veth}" }}\ndelete element inet {name} chained {{ "{veth}" }}\n'
             f'delete element inet {name} veths {{ "{veth}" }}\n')
    except HostTableError:
        _nft(f'delete element inet {name} veths {{ "{veth}" }}\n')  # a table from before ``chained``


def has_chained(prefix: str) -> bool:
    """Whether the instance's table can send a slot's TCP to an upstream proxy (tables made
    before ``chained`` existed cannot: the node refuses egressProxy until it restarts)."""
    done = subprocess.run(["nft", "list", "set", "inet", table_name(prefix), "chained"], capture_output=True,
                          text=True, timeout=30)
    return done.returncode == 0


def set_chained(prefix: str, veth: str, on: bool) -> None:
    """Puts a slot's veth into the ``chained`` set (its TCP through the egress proxy) or takes
    it out (absent already: nothing to do)."""
    name = table_name(prefix)
    script = f'add element inet {name} chained {{ "{veth}" }}\n'
    if not on:
        script += f'delete element inet {name} chained {{ "{veth}" }}\n'
    _nft(script)


def remove(prefix: str) -> bool:
    """Drops the instance's table and its accepts in the host's firewall (best effort: they
    match no slot any more); False if there was no table."""
    try:
        host_firewall.remove(prefix)
    except host_firewall.HostFirewallError as exc:
        log.warning("could not remove the slots' accepts from the host firewall: %s", exc)
    done = subprocess.run(["nft", "delete", "table", "inet", table_name(prefix)], capture_output=True, text=True,
                          timeout=30)
    return done.returncode == 0
