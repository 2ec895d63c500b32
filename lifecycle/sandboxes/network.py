"""A sandbox's network settings (E2B's ``allow_internet_access`` and ``network`` object): checked
once at the edge, stored on the row, turned into the NetworkSpec its node enforces, and
replaced on a running sandbox (``PUT /sandboxes/{id}/network``).

Why one module: create, restore, resume, fork and the update all hand a node the policy, and it
must be built from the row in one way (``spec_of``) with the same parse that checked the request
(``vmm.net.policy``), so what is stored is exactly what is enforced.

What aenv does with each field:

- ``allow_internet_access``, ``allowOut``, ``denyOut``: enforced by the node (E2B's semantics
  and 400 messages, ``vmm.net.policy``); domain names in ``allowOut`` by the node's egress
  proxy (``vmm.net.egress``), which judges each new TCP connection that no CIDR allows (any
  port) by its TLS SNI or HTTP Host and connects only to the address the node's resolver gives
  for it.
- ``dnsServers`` (IPv4 addresses, at most 10): the resolvers the sandbox's DNS (53, and 853
  for DNS over TLS) may reach whatever the CIDRs say, enforced by its slot (``vmm.net.policy``
  has the semantics). As in E2B, omitted means 8.8.8.8 (the guest's resolv.conf; the slot
  sends it to the node's resolver) when allowOut names a domain and ``[]`` none; DNS to any
  other address is then dropped. aenv also honours a list without domains (E2B ignores it)
  and opens only DNS ports, not every port. An address no guest can ever reach (loopback,
  link-local such as the metadata service, multicast, reserved) is refused (400); a private
  one is kept and stays unreachable unless the node's operator reopened its range
  (AENV_NET_ALLOW_EXTRA, e.g. an internal resolver), like a private allowOut entry.
- ``allowPublicTraffic: false``: the sandbox gets a ``trafficAccessToken`` that the data plane
  requires on every port but envd's; ``maskRequestHost``: kept, the data plane applies it.
  An update leaves both alone.
- ``rules`` (E2B's ``{host: [{"transform": {"headers": {...}}}]}``): checked (``_rules``) and
  kept as given, hosts normalised; the node's egress proxy sets the headers on requests to
  those hosts, intercepting TLS for them alone with the node's CA (installed in the guest),
  and fills ``${e2b.secrets.NAME}`` markers from the API (team_secrets.resolve). They need
  allowOut to name domains (only then does the sandbox's traffic pass the proxy: E2B too
  says a host in rules must be in allowOut); a node whose proxy cannot apply them refuses
  them (400), like domains.
- ``egressProxy`` (E2B's upstream SOCKS5 proxy; aenv also chains to an HTTP proxy): checked
  and stored with its password sealed (``lifecycle.sandboxes.egress_proxy``, which also says
  where the password may go); every TCP connection the policy lets out leaves through it from
  the node's egress proxy. An update replaces it like the other egress fields (omitted: the
  sandbox's traffic goes out directly again). ``egressProxy.tls``: the node speaks TLS to the
  upstream, verifying its certificate (an IPv6 upstream is refused: nodes reach it over IPv4).
- refused with 400: non-empty ``httpsPorts`` (the data plane speaks plain HTTP to guest ports).
"""
from __future__ import annotations

import asyncio
import logging
import re
import secrets
import time
from dataclasses import dataclass
from datetime import timedelta

from asgiref.sync import sync_to_async
from django.db import transaction
from django.utils import timezone

from vmm.net import domains, policy
from vmm.net.spec import NetworkSpec

from sandboxes.models import Sandbox, SandboxEvent, Team
from lifecycle.sandboxes import core, egress_proxy
from lifecycle.sandboxes.core import S
from sandboxes.errors import Conflict, Invalid, NotFound, Unavailable

log = logging.getLogger(__name__)

# How long an update waits for the node: replacing a slot's egress table takes milliseconds.
NODE_DEADLINE = 30.0
# Updates of one sandbox go one at a time: a later one waits while an earlier one's event
# says "started" (at most this long: an API process that died mid-update frees it then).
IN_FLIGHT_WINDOW = NODE_DEADLINE + 15

# What an update replaces (omitted = cleared) and what it keeps from the create.
EGRESS_KEYS = ("allowOut", "denyOut", "dnsServers", "rules", "egressProxy")
# network.rules limits: a rule's headers go into every matching request
MAX_RULE_HOSTS = 64
MAX_RULES_PER_HOST = 16
MAX_RULE_HEADERS = 32
MAX_HEADER_VALUE = 8192
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,256}")
# headers the proxy itself owns on the way out: a rule may not set them
_RESERVED_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection", "upgrade",
                               "te", "trailer", "keep-alive", "proxy-connection"})
KEPT_BY_UPDATE = ("allowPublicTraffic", "maskRequestHost")

def camel(key: str) -> str:
    head, *rest = key.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def _in_camel(obj: dict, what: str) -> dict:
    """``obj`` with its keys in camelCase (the SDKs send camelCase; some builds snake_case);
    the same key given both ways with different values is refused."""
    out: dict = {}
    for key, value in obj.items():
        name = camel(key)
        if name in out and out[name] != value:
            raise Invalid(f"{what}{name} is given twice with different values")
        out[name] = value
    return out


def _strings(value, what: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(e, str) for e in value):
        raise Invalid(f"{what} must be a list of strings")
    return value


def _dns_servers(value) -> list[str] | None:
    """E2B's ``dnsServers`` as stored (normalised; None: not given), or Invalid: an address no
    guest can ever reach is refused here rather than accepted and left unreachable."""
    try:
        servers = policy.nameservers(_strings(value, "dnsServers") if value is not None else None)
    except policy.PolicyError as exc:
        raise Invalid(str(exc)) from None
    for server in servers or ():
        denied = policy.never_reachable(server)
        if denied:
            raise Invalid(f"invalid DNS server {server}: sandboxes can never reach {denied} (loopback, link-local, "
                          "multicast and reserved addresses); name a resolver on the internet")
    return None if servers is None else list(servers)


def _headers(value, where: str) -> dict[str, str]:
    if not isinstance(value, dict):
        raise Invalid(f"{where}.headers must be an object of header names to strings")
    if len(value) > MAX_RULE_HEADERS:
        raise Invalid(f"{where}.headers takes at most {MAX_RULE_HEADERS} headers")
    seen: set[str] = set()
    for name, text in value.items():
        if not _TOKEN.fullmatch(name) or name.lower() in _RESERVED_HEADERS or name.lower() in seen:
            raise Invalid(f"{where}.headers: {name[:64]!r} is not a header a rule may set")
        seen.add(name.lower())
        if (not isinstance(text, str) or len(text.encode()) > MAX_HEADER_VALUE
                or any(c in text for c in "\r\n\x00")):
            raise Invalid(f"{where}.headers.{name}: a string of at most {MAX_HEADER_VALUE} bytes without CR, LF "
                          "or NUL")
    return dict(value)


def _rules(value, domain_entries: tuple[str, ...]) -> dict:
    """E2B's ``rules`` (``{host: [{"transform": {"headers": {name: value}}}]}``) checked, hosts
    normalised; {} for none. Hosts are domain patterns (the proxy judges by name; an address
    key is refused), and the sandbox's allowOut must name domains (else its traffic does not
    pass the proxy and a rule would silently not apply)."""
    if value in (None, {}):
        return {}
    if not isinstance(value, dict):
        raise Invalid("network.rules must be an object of hosts to lists of rules")
    if len(value) > MAX_RULE_HOSTS:
        raise Invalid(f"network.rules takes at most {MAX_RULE_HOSTS} hosts")
    if not domain_entries:
        raise Invalid("network.rules apply to requests that pass aenv's egress proxy: allowOut must name the rules' "
                      "hosts as domains (with 0.0.0.0/0 in denyOut)")
    out: dict = {}
    for host, entries in value.items():
        pattern = domains.normalise(host) if isinstance(host, str) else None
        if pattern is None:
            raise Invalid(f"network.rules: {str(host)[:100]!r} is not a domain name or pattern (aenv applies rules by "
                          "name: the TLS SNI or HTTP Host)")
        if not isinstance(entries, list) or len(entries) > MAX_RULES_PER_HOST:
            raise Invalid(f"network.rules.{pattern} must be a list of at most {MAX_RULES_PER_HOST} rules")
        checked = []
        for i, rule in enumerate(entries):
            where = f"network.rules.{pattern}[{i}]"
            if not isinstance(rule, dict) or set(rule) - {"transform"}:
                raise Invalid(f"{where} must be an object with only a transform")
            transform = rule.get("transform")
            if transform is None:
                checked.append({})
                continue
            if not isinstance(transform, dict) or set(transform) - {"headers"}:
                raise Invalid(f"{where}.transform takes only headers")
            checked.append({"transform": {"headers": _headers(transform.get("headers") or {}, f"{where}.transform")}})
        if pattern in out:
            raise Invalid(f"network.rules names {pattern} twice")
        out[pattern] = checked
    return out


def _egress(fields: dict, allow_internet_access: bool | None) -> dict:
    """The egress part of a create's ``network`` or an update's body (camelCase), checked;
    returns what is stored of it (only what says something)."""
    allow_out = _strings(fields.get("allowOut"), "allowOut")
    deny_out = _strings(fields.get("denyOut"), "denyOut")
    try:
        parsed = policy.parse(allow_out, deny_out, allow_internet_access)
    except policy.PolicyError as exc:
        raise Invalid(str(exc)) from None
    stored = {"allowOut": allow_out, "denyOut": deny_out, "dnsServers": _dns_servers(fields.get("dnsServers")),
              "rules": _rules(fields.get("rules"), parsed.domains),
              "egressProxy": egress_proxy.checked(fields.get("egressProxy"))}
    return {k: v for k, v in stored.items() if v or (k == "dnsServers" and v is not None)}


def rules_spec(rules: dict | None) -> tuple:
    """Stored ``rules`` → NetworkSpec.rules: each rule's headers, in order, per host pattern."""
    return tuple((pattern, tuple(tuple(((r.get("transform") or {}).get("headers") or {}).items()) for r in entries))
                 for pattern, entries in (rules or {}).items())


def checked_create(network, allow_internet_access: bool | None) -> dict | None:
    """A create's ``network`` object → what the row stores (camelCase; None when it asks for
    nothing), or Invalid with E2B's message. Unknown keys are ignored like unknown fields."""
    if allow_internet_access is not None and not isinstance(allow_internet_access, bool):
        raise Invalid("allow_internet_access must be a boolean")
    if network is None:
        return None
    if not isinstance(network, dict):
        raise Invalid("network must be a JSON object")
    fields = _in_camel(network, "network.")
    stored = _egress(fields, allow_internet_access)
    public = fields.get("allowPublicTraffic")
    if public is not None and not isinstance(public, bool):
        raise Invalid("network.allowPublicTraffic must be a boolean")
    mask = fields.get("maskRequestHost")
    if mask is not None and not isinstance(mask, str):
        raise Invalid("network.maskRequestHost must be a string")
    https_ports = fields.get("httpsPorts")
    if https_ports not in (None, []):
        raise Invalid("network.httpsPorts is not supported: aenv's data plane reaches guest ports over plain HTTP "
                      "and cannot open TLS to a service in the sandbox; serve plain HTTP on those ports")
    if public is not None:
        stored["allowPublicTraffic"] = public
    if mask:
        stored["maskRequestHost"] = mask
    return stored or None


@dataclass(frozen=True)
class NetworkUpdate:
    """A checked ``PUT /sandboxes/{id}/network`` body: the egress config that replaces the
    sandbox's (omitted fields are cleared; ``{}`` allows everything)."""

    allow_internet_access: bool | None
    egress: dict  # allowOut / denyOut / dnsServers as stored

    def network_after(self, current: dict | None) -> dict | None:
        """The row's new ``network``: this egress, with what an update does not touch
        (allowPublicTraffic, maskRequestHost) kept from ``current``."""
        kept = {k: v for k, v in (current or {}).items() if k in KEPT_BY_UPDATE}
        return {**kept, **self.egress} or None


def checked_update(body) -> NetworkUpdate:
    """E2B's ``SandboxNetworkUpdateConfig`` (``allowOut``, ``denyOut``, ``dnsServers``,
    ``egressProxy``, ``rules``, ``allow_internet_access``; snake_case accepted) → a
    NetworkUpdate, or Invalid with E2B's message."""
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise Invalid("the body must be a JSON object")
    fields = _in_camel(body, "")
    allow = fields.get("allowInternetAccess")
    if allow is not None and not isinstance(allow, bool):
        raise Invalid("allow_internet_access must be a boolean")
    return NetworkUpdate(allow, _egress(fields, allow))


def spec_of(sandbox) -> dict:
    """The NetworkSpec (JSON, as the node tasks take it) a sandbox row (or SandboxOptions)
    must run with, through the same parse that checked the request: normalised CIDRs, and
    ``allow_internet_access: false`` as deny-all with allowOut kept."""
    network = sandbox.network or {}
    try:
        egress = policy.parse(network.get("allowOut"), network.get("denyOut"), sandbox.allow_internet_access,
                              network.get("dnsServers"))
    except policy.PolicyError as exc:
        raise Invalid(str(exc)) from None
    return NetworkSpec(allow_internet_access=sandbox.allow_internet_access is not False,
                       allow_out=(*egress.allow, *egress.domains), deny_out=egress.deny,
                       rules=rules_spec(network.get("rules")),
                       egress_proxy=tuple(sorted((egress_proxy.spec(network.get("egressProxy")) or {}).items())),
                       dns_servers=egress.dns_servers).to_json()


def is_private(network: dict | None) -> bool:
    """E2B: only an explicit ``allowPublicTraffic: false`` makes a sandbox's ports private."""
    return (network or {}).get("allowPublicTraffic") is False


def new_traffic_access_token() -> str:
    """A random token (256 bits). E2B derives it by HMAC from the id and a seed so it need not
    store it; aenv stores it on the row (the data plane reads the row for every request
    anyway), so it does not depend on the secret key: rotating that key does not silently
    change the token of every private sandbox, and a fork or restore gets an unrelated one."""
    return secrets.token_urlsafe(32)


def traffic_access_token_for(network: dict | None) -> str:
    return new_traffic_access_token() if is_private(network) else ""


# --------------------------------------------------------------------------- the update


async def update_network(team: Team, sandbox_id: str, update: NetworkUpdate, actor: str = "") -> Sandbox:
    """Replaces a running sandbox's egress policy: stored durably (with its event) first, then
    applied by the node within its deadline.

    Not running (paused included, as in E2B): Conflict; unknown or another team's: NotFound;
    a transitional state (pause, resume, snapshot, fork) is waited for first, and so is an
    update of the same sandbox still in flight (one at a time, so each knows the policy the
    VM had before it). Node not alive: Unavailable and nothing changes. The node refused or
    failed (e.g. its backend cannot enforce the policy: Invalid): the previous policy is
    put back. No answer: the row keeps the new policy (a resume re-applies the row's, and a
    retried update is harmless) and the error says the node did not confirm it."""
    # past the window by two polls: an update left "started" by a dead process is looked at
    # again once it is older than the window, before this one gives up
    deadline = time.monotonic() + IN_FLIGHT_WINDOW + 2 * core.SETTLE_POLL
    while True:
        sandbox = await core.settle(team, sandbox_id)
        if sandbox.state != S.RUNNING:
            raise core.not_running(sandbox_id, sandbox.state)
        node = await core.node_of(sandbox)
        if not node.is_alive():
            raise Unavailable(f"node {node.id} is not alive (no recent heartbeat); the network was not changed")
        stored = await _store(sandbox.id, update, actor)
        if isinstance(stored, tuple):
            break
        # another update of this sandbox is on its way to the node, or the sandbox left
        # "running" meanwhile (a pause, snapshot or fork began): look again
        if time.monotonic() > deadline:
            raise Conflict(f'sandbox "{sandbox_id}" is busy ({stored}); the network was not changed')
        await asyncio.sleep(core.SETTLE_POLL)
    before, after = stored
    sandbox.allow_internet_access, sandbox.network = after
    return await core.shielded(_apply(sandbox, node, before, after, actor))


def _details(values: tuple) -> dict:
    return {"allow_internet_access": values[0], "network": egress_proxy.public(values[1])}


@sync_to_async
def _store(sandbox_id: str, update: NetworkUpdate, actor: str) -> tuple[tuple, tuple] | str:
    """The new policy and its ``network`` (started) event in one transaction, while the
    sandbox runs and no other update of it is in flight → (before, after); else why not."""
    with transaction.atomic():
        row = Sandbox.objects.select_for_update().filter(pk=sandbox_id).first()
        if row is None or row.state != S.RUNNING:
            return "not running"
        last = SandboxEvent.objects.filter(sandbox_id=sandbox_id, operation="network").order_by("-id").first()
        if (last is not None and last.outcome == "started"
                and last.started_at > timezone.now() - timedelta(seconds=IN_FLIGHT_WINDOW)):
            return "another network update is in progress"
        before = (row.allow_internet_access, row.network)
        after = (update.allow_internet_access, update.network_after(row.network))
        Sandbox.objects.filter(pk=sandbox_id).update(allow_internet_access=after[0], network=after[1],
                                                     updated_at=timezone.now())
        core.event(sandbox_id, "network", outcome="started", from_state=S.RUNNING, to_state=S.RUNNING,
                   actor=actor, details={"before": _details(before), "after": _details(after)}).save()
    return before, after


@sync_to_async
def _put_back(sandbox_id: str, expected: tuple, previous: tuple) -> bool:
    """The previous policy again (the node changed nothing), unless the row no longer holds
    ours (e.g. an admin edit meanwhile)."""
    with transaction.atomic():
        row = Sandbox.objects.select_for_update().filter(pk=sandbox_id).first()
        if row is None or (row.allow_internet_access, row.network) != expected:
            return False
        Sandbox.objects.filter(pk=sandbox_id).update(allow_internet_access=previous[0], network=previous[1],
                                                     updated_at=timezone.now())
    return True


async def _apply(sandbox: Sandbox, node, before: tuple, after: tuple, actor: str) -> Sandbox:
    """The node call; every outcome ends the update with its event (which lets the next
    update of this sandbox go)."""
    client, _ = core.node_api()
    t0, started = time.monotonic(), timezone.now()
    details = {"node": node.id}
    try:
        details["spec"] = spec_of(sandbox)
        result = await asyncio.wait_for(
            client.update_network(node, sandbox_id=sandbox.id, network=details["spec"], deadline=NODE_DEADLINE,
                                  access_token=sandbox.envd_access_token or None),
            timeout=NODE_DEADLINE + 5)
    except Exception as exc:  # mapped below, never a bare 500
        error = exc if isinstance(exc, Invalid) else core.node_failure(client, exc, node, "network update",
                                                                      NODE_DEADLINE)
        details["kind"] = error.kind
        if isinstance(exc, (client.NodeTaskFailed, Invalid)):
            # The node answered (its driver changed nothing) or nothing was sent: the row goes back.
            details["restored"] = await _put_back(sandbox.id, after, before)
            outcome = "error"
        else:
            outcome = "unconfirmed"
            error.message = (f"{error.message}; the new network policy is stored but the node did not confirm "
                             "that it is in force (it is applied again when the sandbox resumes): retry the update")
            error.args = (error.message,)
        log.warning("network update of sandbox %s failed (%s): %s", sandbox.id, outcome, error.message)
        await core.record(core.event(sandbox.id, "network", outcome=outcome, from_state=S.RUNNING,
                                     to_state=S.RUNNING, started_at=started, duration_ms=core.ms(t0),
                                     message=error.message, actor=actor, details=details))
        if error is exc:
            raise
        raise error from exc
    details["timings"] = (result or {}).get("timings") or {}
    await core.record(core.event(sandbox.id, "network", from_state=S.RUNNING, to_state=S.RUNNING,
                                 started_at=started, duration_ms=core.ms(t0), actor=actor, details=details))
    row = await Sandbox.objects.select_related("template").filter(pk=sandbox.pk).afirst()
    if row is None:
        raise NotFound(f'sandbox "{sandbox.id}" not found')
    return row
