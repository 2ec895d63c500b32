"""Which secret value a node's egress proxy may have, for which sandbox and destination.

E2B's model, which aenv follows: a secret carries no list of domains of its own. A sandbox
names it as the marker ``${e2b.secrets.NAME}`` inside a header of a transform of its
``network.rules`` (``{"api.example.com": [{"transform": {"headers": {"Authorization":
"Bearer ${e2b.secrets.NAME}"}}}]}``), and the proxy substitutes it only into requests to the
host that rule is for. So a value is handed out for ``(sandbox, name, host)`` only when:

- the asking node is the sandbox's node, and the sandbox is live there (not paused, killed);
- the sandbox's team has a secret of that name;
- a rule of the sandbox whose host pattern matches ``host`` carries that secret's marker in
  one of its header values.

Host patterns: a name (``api.example.com``, matched whole, case-insensitive, a trailing dot
and a port ignored), ``*.example.com`` (any name below ``example.com``, not ``example.com``
itself), ``*`` (any name), or an IP address / CIDR (``host`` an address inside it)."""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from sandboxes.errors import Forbidden, NotFound
from sandboxes.models import Sandbox
from sandboxes.states import SandboxState as S
from team_secrets import store
from team_secrets.models import Secret
from vmm.net import domains

MARKER = re.compile(r"\$\{e2b\.secrets\.([^{}\s\x00-\x1f\x7f-\x9f]+)\}")
# States in which the sandbox's VM may be sending requests.
LIVE = frozenset({S.CREATING, S.RUNNING, S.RESUMING, S.PAUSING, S.SNAPSHOTTING, S.FORKING})


def marker(name: str) -> str:
    return "${e2b.secrets." + name + "}"


def names_in(text: str) -> set[str]:
    """The (lower-cased) secret names whose markers ``text`` carries."""
    return {m.lower() for m in MARKER.findall(text or "")}


def host_matches(pattern: str, host: str) -> bool:
    """Whether a rule's host ``pattern`` covers the destination ``host`` (see the module): names
    by the egress proxy's own matcher (``vmm.net.domains``, so the proxy and this check agree),
    addresses by CIDR."""
    name = domains.host_of(host)
    if not name or not isinstance(pattern, str):
        return False
    if domains.is_ip(name):
        try:
            return ipaddress.ip_address(name) in ipaddress.ip_network(pattern.strip(), strict=False)
        except ValueError:
            return False
    normal = domains.normalise(pattern)
    return normal is not None and domains.matches(name, [normal])


def _header_values(rules) -> list[str]:
    values = []
    for rule in rules if isinstance(rules, list) else []:
        transform = rule.get("transform") if isinstance(rule, dict) else None
        headers = transform.get("headers") if isinstance(transform, dict) else None
        if isinstance(headers, dict):
            values += [v for v in headers.values() if isinstance(v, str)]
    return values


def allowed_hosts(network: dict | None, name: str) -> list[str]:
    """The host patterns of ``network.rules`` whose header transforms carry ``name``'s marker."""
    rules = (network or {}).get("rules")
    if not isinstance(rules, dict):
        return []
    name = name.lower()
    return [pattern for pattern, entries in rules.items()
            if any(name in names_in(v) for v in _header_values(entries))]


@dataclass(frozen=True)
class Resolved:
    value: str
    version: int
    secret_id: str


def resolve(node_id: str, sandbox_id: str, name: str, host: str) -> Resolved:
    """The value a node may put into a request of ``sandbox_id`` to ``host`` (module rules).
    NotFound: no such live sandbox on this node, or no such secret of its team; Forbidden: the
    sandbox's rules do not send that secret to ``host``."""
    sandbox = Sandbox.objects.filter(pk=sandbox_id).only("id", "team_id", "node_id", "state", "network").first()
    if sandbox is None or sandbox.node_id != node_id or sandbox.state not in LIVE:
        raise NotFound(f'no live sandbox "{sandbox_id}" on node {node_id}', retry=False)
    name = (name or "").lower()
    secret = Secret.objects.filter(team_id=sandbox.team_id, name=name).first()
    if secret is None:
        raise NotFound(f'sandbox {sandbox_id}\'s team has no secret "{name}"', retry=False)
    if not any(host_matches(p, host) for p in allowed_hosts(sandbox.network, name)):
        raise Forbidden(f'sandbox {sandbox_id}\'s network.rules do not send secret "{name}" to '
                        f'{domains.host_of(host) or "that host"}',
                        code="secret_host_not_allowed", retry=False)
    return Resolved(store.current_value(secret), secret.current_version, secret.pk)
