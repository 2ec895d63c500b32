"""E2B's egress policy, parsed and checked once: what a sandbox may reach, as CIDR sets.

Why one place: the API edge answers a bad policy with E2B's 400 messages, and the slot's
nftables table is filled from the same parse, so what is accepted is exactly what is
enforced. Semantics (E2B's, see ../shared/research/networking.md §2.4):

1. the always-denied ranges (private, loopback, link-local, the node) drop whatever
   allowOut says (enforced by the slot table, not here);
2. a destination in allowOut is allowed;
3. else one in denyOut is dropped;
4. else it is allowed (empty lists: no restriction).

``allow_internet_access: false`` replaces denyOut with ``0.0.0.0/0`` (deny all) and keeps
allowOut. A bare IP is a /32. Domain names (vmm.net.domains) are allowed only with
``0.0.0.0/0`` denied (E2B's rule): the slot sends such a sandbox's new TCP connections (any
port) that no CIDR allows through the node's egress proxy (vmm.net.egress), which
judges each by its TLS SNI or HTTP Host.

``dnsServers`` (E2B SDK 2.63: "DNS servers the sandbox can reach when allowOut contains a
domain", default 8.8.8.8, ``[]`` none): the resolvers the guest's DNS (udp/tcp 53, and 853
for DNS over TLS) may go to whatever the CIDRs say; with domains in allowOut, DNS anywhere
else is dropped. Where aenv differs: E2B opens every port of those addresses, aenv only DNS
(other ports stay with the policy: list the address in allowOut to open them), and it also
honours a list given without domains (E2B ignores it there), so ``allow_internet_access:
false`` with ``dnsServers`` keeps name lookups. The always-denied ranges still win (a private
resolver stays unreachable unless the operator reopened its range; the API refuses one
``never_reachable``); 8.8.8.8 is the guest's resolv.conf address, which the slot sends to the
node's resolver (port 53 only).
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from . import domains as domain_names

ALL_TRAFFIC = "0.0.0.0/0"
DEFAULT_NAMESERVER = "8.8.8.8"  # E2B's, the guest's resolv.conf; its DNS goes to the node's resolver
MAX_DNS_SERVERS = 10  # E2B's limit
# E2B's DeniedSandboxCIDRs (IPv4) plus "this network", IETF protocol assignments, the
# benchmarking range, the documentation TEST-NETs, multicast and reserved (RFC 6890: none is
# the internet); the slot pool is inside 10/8. The slot table drops them first (vmm.net.slots;
# the node's own addresses are added per node).
ALWAYS_DENIED = ("0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16",
                 "172.16.0.0/12", "192.0.0.0/24", "192.0.2.0/24", "192.168.0.0/16", "198.18.0.0/15",
                 "198.51.100.0/24", "203.0.113.0/24", "224.0.0.0/4", "240.0.0.0/4")
# Of those, what no operator setting reopens (AENV_NET_ALLOW_EXTRA refuses the guests'
# link-local side and the node's loopback) or where no resolver can be: this network,
# loopback, link-local (a cloud's metadata service), multicast and reserved.
NEVER_REACHABLE = ("0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/4", "240.0.0.0/4")


class PolicyError(ValueError):
    """A policy aenv cannot accept; the message is E2B's (or says what aenv does not enforce)."""


@dataclass(frozen=True)
class EgressPolicy:
    """What the slot table enforces: allow wins over deny; both are IPv4 networks.
    ``domains``: allowed names (normalised patterns) the egress proxy judges connections by."""

    allow: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()
    domains: tuple[str, ...] = ()
    dns_servers: tuple[str, ...] | None = None  # E2B dnsServers as given (None: not given)

    @property
    def open(self) -> bool:
        return not self.deny

    @property
    def resolvers(self) -> tuple[str, ...]:
        """Where the guest's DNS may go whatever the CIDRs say: dnsServers, else E2B's default
        (8.8.8.8 when allowOut names domains, none otherwise)."""
        if self.dns_servers is not None:
            return self.dns_servers
        return (DEFAULT_NAMESERVER,) if self.domains else ()


def _is_domain(entry: str) -> bool:
    try:
        ipaddress.ip_network(entry, strict=False)
        return False
    except ValueError:
        return True


def _network(entry: str, what: str) -> str:
    """A normalised IPv4 network for an allowOut / denyOut entry, or PolicyError."""
    text = entry.strip()
    try:
        net = ipaddress.ip_network(text, strict=False)
    except ValueError:
        raise PolicyError(f"invalid {what} {entry}") from None
    if net.version != 4:
        raise PolicyError(f"invalid {what} {entry}: aenv filters IPv4 only (guests have no IPv6)")
    if net.network_address.is_unspecified and net.prefixlen != 0:  # 0.0.0.0 alone; only 0.0.0.0/0 passes
        raise PolicyError(f"invalid {what} {entry}")
    return str(net)


def nameservers(value) -> tuple[str, ...] | None:
    """E2B's ``dnsServers`` → IPv4 addresses (None: not given), or PolicyError."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(isinstance(e, str) for e in value):
        raise PolicyError("dnsServers must be a list of strings")
    if len(value) > MAX_DNS_SERVERS:
        raise PolicyError(f"dnsServers takes at most {MAX_DNS_SERVERS} entries")
    out = []
    for entry in value:
        try:
            out.append(str(ipaddress.IPv4Address(entry.strip())))
        except ValueError:
            raise PolicyError(f"invalid DNS server {entry}: must be an IPv4 address") from None
    return tuple(dict.fromkeys(out))


def never_reachable(address: str) -> str | None:
    """The range holding ``address`` if no guest can ever reach it (None: a guest may, though
    the rest of the always-denied ranges stay shut unless the node's operator reopened them)."""
    ip = ipaddress.ip_address(address)
    return next((c for c in NEVER_REACHABLE if ip in ipaddress.ip_network(c)), None)


def parse(allow_out=None, deny_out=None, allow_internet_access: bool | None = None,
          dns_servers=None) -> EgressPolicy:
    """E2B's create / update fields → an EgressPolicy, or PolicyError with E2B's message."""
    allow_out = [] if allow_out is None else allow_out
    deny_out = [] if deny_out is None else deny_out
    if not isinstance(allow_out, (list, tuple)) or not all(isinstance(e, str) for e in allow_out):
        raise PolicyError("allowOut must be a list of strings")
    if not isinstance(deny_out, (list, tuple)) or not all(isinstance(e, str) for e in deny_out):
        raise PolicyError("denyOut must be a list of strings")
    deny = [_network(e, "denied CIDR") for e in deny_out]
    names = []
    for entry in (e for e in allow_out if _is_domain(e.strip())):
        name = domain_names.normalise(entry)
        if name is None:
            raise PolicyError(f"invalid allowed address {entry}")
        names.append(name)
    if names and ALL_TRAFFIC not in deny:  # E2B checks the request's denyOut, whatever allow_internet_access says
        raise PolicyError("When specifying allowed domains in allow out, you must include 'ALL_TRAFFIC' "
                          "in deny out to block all other traffic.")
    if allow_internet_access is False:
        deny = [ALL_TRAFFIC]
    allow = [_network(e, "allowed address") for e in allow_out if not _is_domain(e.strip())]
    return EgressPolicy(tuple(dict.fromkeys(allow)), tuple(dict.fromkeys(deny)), tuple(dict.fromkeys(names)),
                        nameservers(dns_servers))
