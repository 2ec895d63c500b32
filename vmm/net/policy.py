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
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from . import domains as domain_names

ALL_TRAFFIC = "0.0.0.0/0"


class PolicyError(ValueError):
    """A policy aenv cannot accept; the message is E2B's (or says what aenv does not enforce)."""


@dataclass(frozen=True)
class EgressPolicy:
    """What the slot table enforces: allow wins over deny; both are IPv4 networks.
    ``domains``: allowed names (normalised patterns) the egress proxy judges connections by."""

    allow: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()
    domains: tuple[str, ...] = ()

    @property
    def open(self) -> bool:
        return not self.deny


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


def parse(allow_out=None, deny_out=None, allow_internet_access: bool | None = None) -> EgressPolicy:
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
    return EgressPolicy(tuple(dict.fromkeys(allow)), tuple(dict.fromkeys(deny)), tuple(dict.fromkeys(names)))
