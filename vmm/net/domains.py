"""Domain names in an egress policy (E2B's ``allowOut`` entries such as ``example.com`` and
``*.example.com``): the check of an entry and the match of a connection's name against them.

Why a module of its own with nothing but the standard library: the API edge checks entries
with it, and the node's egress proxy (vmm/net/egress_proxy/addon.py, run by mitmproxy in a Python
environment of its own) loads this very file to judge each connection, so what is accepted
and what is matched cannot drift apart.

Semantics (E2B's): case-insensitive; ``example.com`` matches that name only;
``*.example.com`` matches every name below it but not ``example.com`` itself; ``*`` matches
any name. A name that is an IP address never matches a domain entry (HTTPS to a bare IP is
judged by the CIDR rules alone).
"""
from __future__ import annotations

import ipaddress
import re

_LABEL = re.compile(r"^(?!-)[a-z0-9_-]{1,63}(?<!-)$")
MAX_NAME = 253


def is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False


def _valid_name(name: str) -> bool:
    if not name or len(name) > MAX_NAME or is_ip(name):
        return False
    return all(_LABEL.match(label) for label in name.split("."))


def normalise(entry: str) -> str | None:
    """An allowOut domain entry in its stored form (lower case, no trailing dot), or None
    if it is no domain pattern aenv can match."""
    text = entry.strip().lower().rstrip(".")
    if text == "*":
        return text
    name = text[2:] if text.startswith("*.") else text
    return text if _valid_name(name) else None


def host_of(value: str | None) -> str | None:
    """The name a connection asks for (an SNI, or an HTTP Host header with its port), in
    the form entries are matched against; None when there is none."""
    if not value:
        return None
    text = value.strip().lower()
    if text.startswith("["):  # an IPv6 literal, possibly with a port
        return text[1:text.find("]")] if "]" in text else None
    if text.count(":") == 1:
        text = text.split(":", 1)[0]
    text = text.rstrip(".")
    return text or None


def matches(host: str | None, patterns) -> bool:
    """Whether ``host`` (from ``host_of``) is allowed by any of ``patterns`` (normalised
    entries)."""
    if not host or is_ip(host) or not _valid_name(host):
        return False
    for pattern in patterns:
        if pattern == "*":
            return True
        if pattern.startswith("*."):
            if host.endswith(pattern[1:]):
                return True
        elif host == pattern:
            return True
    return False
