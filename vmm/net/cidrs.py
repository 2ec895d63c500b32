"""Operator-given IPv4 ranges checked against what they may never cover.

Why one place: the node's ingress sources (``AENV_NET_INGRESS_FROM``) and the ranges it
reopens to guests (``AENV_NET_ALLOW_EXTRA``) are both lists a typo can turn into a hole
(a guest that becomes a gateway, a guest that reaches the node); both are parsed the same
way and refused with a message naming the value and what it overlaps."""
from __future__ import annotations

import ipaddress


def checked_ipv4(cidrs, forbidden, label: str, why: str, error: type[Exception]) -> tuple[str, ...]:
    """``cidrs`` (strings) as normalised IPv4 networks, duplicates dropped, or ``error``
    saying which value (``label`` names the list) is not IPv4 or overlaps one of
    ``forbidden``, ``(network, what it is)`` pairs; ``why`` ends that message."""
    out = []
    for raw in cidrs:
        try:
            net = ipaddress.ip_network(str(raw).strip(), strict=False)
        except ValueError:
            raise error(f"{label} {raw!r} is not an IPv4 address or CIDR") from None
        if net.version != 4:
            raise error(f"{label} {raw!r} is not IPv4 (guests have no IPv6)")
        for other, what in forbidden:
            if other.version == 4 and net.overlaps(other):
                raise error(f"{label} {raw!r} overlaps {what}: {why}")
        out.append(str(net))
    return tuple(dict.fromkeys(out))
