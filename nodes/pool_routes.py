"""Routes from every node's slot pool to that node, on a machine that must reach guests.

Why: the data plane and the dashboard terminal connect to a guest at its slot address, which
only its node routes (the slot's TAP is on that node). In Kubernetes the API and data plane
pods run on other machines of the same network; each of those machines needs
``ip route <pool> via <node's address>`` for every node, and the set changes as nodes come and
go. The syncer (``manage.py sync_pool_routes``, the ``aenv-routes`` DaemonSet) keeps exactly
those routes, read from the pools folder (``nodes.pools``) and the nodes' addresses in the
database, and nothing else:

- its routes carry their own routing protocol number (``ROUTE_PROTO``), so it changes and
  removes only routes it made, never the operator's or the CNI's;
- a pool the machine already routes some other way is left alone (and said once);
- a node whose address is on this machine gets no route (that machine is the node: its
  slots are its own interfaces).
"""
from __future__ import annotations

import ipaddress
import logging
import socket
from dataclasses import dataclass

from pyroute2 import NetlinkError

log = logging.getLogger(__name__)

# rtnetlink protocol of aenv's routes (``ip route ... proto 174``); 174 is unassigned in
# iproute2's rt_protos and outside the range routing daemons use (186-192).
ROUTE_PROTO = 174
MAIN_TABLE = 254


@dataclass(frozen=True)
class Change:
    """One route change the syncer made (for the log and the tests)."""
    action: str            # "add", "replace" or "delete"
    pool: ipaddress.IPv4Network
    gateway: str | None


def gateway_of(address: str) -> ipaddress.IPv4Address | None:
    """The IPv4 address a node's ``AENV_NODE_ADDRESS`` names (an address or a host name);
    None when it names none (the node is then not routed to, and said so)."""
    try:
        return ipaddress.IPv4Address(address)
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(address, None, family=socket.AF_INET, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return None
    return ipaddress.IPv4Address(infos[0][4][0]) if infos else None


def desired_routes(pools: dict[str, ipaddress.IPv4Network], addresses: dict[str, str],
                   local: set[ipaddress.IPv4Address]) -> dict[ipaddress.IPv4Network, ipaddress.IPv4Address]:
    """Pool -> gateway for every node that has both a pool and a usable address that is not
    this machine's. A node without a row (not started yet) has no route yet."""
    routes = {}
    for node_id, pool in sorted(pools.items()):
        address = addresses.get(node_id)
        if not address:
            continue
        gateway = gateway_of(address)
        if gateway is None:
            log.warning("node %s: its address %r names no IPv4 address; its pool %s is not routed",
                        node_id, address, pool)
            continue
        if gateway in local:
            continue
        routes[pool] = gateway
    return routes


def _dst_of(route) -> ipaddress.IPv4Network | None:
    dst = route.get_attr("RTA_DST")
    if dst is None:
        return None
    return ipaddress.IPv4Network(f"{dst}/{route['dst_len']}", strict=False)


def local_addresses(ipr) -> set[ipaddress.IPv4Address]:
    """Every IPv4 address on this machine's interfaces (in the syncer's network namespace)."""
    return {ipaddress.IPv4Address(a.get_attr("IFA_ADDRESS")) for a in ipr.get_addr(family=socket.AF_INET)}


def apply(ipr, wanted: dict[ipaddress.IPv4Network, ipaddress.IPv4Address]) -> list[Change]:
    """Make this machine's main table hold exactly `wanted` among aenv's routes: add or
    re-point what differs, delete aenv's routes no longer wanted; routes of any other
    protocol are never touched (a pool they already cover is skipped with a warning)."""
    ours: dict[ipaddress.IPv4Network, str | None] = {}
    theirs: set[ipaddress.IPv4Network] = set()
    for route in ipr.get_routes(family=socket.AF_INET, table=MAIN_TABLE):
        dst = _dst_of(route)
        if dst is None:
            continue
        if route["proto"] == ROUTE_PROTO:
            ours[dst] = route.get_attr("RTA_GATEWAY")
        else:
            theirs.add(dst)
    changes = []
    for pool, gateway in sorted(wanted.items()):
        if pool in theirs and pool not in ours:
            log.warning("pool %s is already routed on this machine by something else: left as it is", pool)
            continue
        if ours.get(pool) == str(gateway):
            continue
        action = "replace" if pool in ours else "add"
        try:
            ipr.route("replace", dst=str(pool), gateway=str(gateway), proto=ROUTE_PROTO, table=MAIN_TABLE)
        except NetlinkError as exc:
            # Typically the gateway is not on a network of this machine (not one L2 network:
            # such pools need the network's router, docs/deployment.md).
            log.warning("pool %s via %s: cannot route (%s)", pool, gateway, exc)
            continue
        changes.append(Change(action, pool, str(gateway)))
    for pool, gateway in sorted(ours.items()):
        if pool not in wanted:
            ipr.route("del", dst=str(pool), gateway=gateway, proto=ROUTE_PROTO, table=MAIN_TABLE)
            changes.append(Change("delete", pool, gateway))
    for change in changes:
        log.info("route %s: %s via %s", change.action, change.pool, change.gateway)
    return changes


def sync(ipr, pools: dict[str, ipaddress.IPv4Network], addresses: dict[str, str]) -> list[Change]:
    """One pass: the routes the pools and addresses call for, applied."""
    return apply(ipr, desired_routes(pools, addresses, local_addresses(ipr)))
