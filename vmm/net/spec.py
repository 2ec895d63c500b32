"""What a sandbox's network must be (NetworkSpec) and the guest-side constants every backend
shares. Plain data, no I/O: vmm.driver carries it in BootSpec, the API edge can build it from
E2B's create fields (allow_internet_access, network.allowOut / denyOut).
"""

from __future__ import annotations

from dataclasses import dataclass

from envd import ENVD_PORT

# The guest's side of the restricted slirp fallback (QEMU user-mode networking defaults), set by
# the guest init when the kernel says aenv.net=slirp; a netns slot's are in vmm.net.slots.
GUEST_IP = "10.0.2.15"
GUEST_PREFIX = 24
GATEWAY = "10.0.2.2"
DNS = "10.0.2.3"

# Network slots a netns node keeps made ahead (AENV_NET_WARM_SLOTS): enough for a fork ×16
# (AgentENV's "up to 16 children on one node") to find every child's slot ready.
DEFAULT_WARM_SLOTS = 16


@dataclass(frozen=True)
class NetworkSpec:
    """A VM's network. The default is what every sandbox gets today: internet access, no
    egress filter, envd's port forwarded to the host."""

    allow_internet_access: bool = True  # E2B allow_internet_access; False: no egress at all
    allow_out: tuple[str, ...] = ()  # E2B network.allowOut: the only destinations (CIDRs / hosts)
    deny_out: tuple[str, ...] = ()  # E2B network.denyOut: destinations refused
    forward_ports: tuple[int, ...] = (ENVD_PORT,)  # guest TCP ports reachable from the host
    # E2B network.rules as the egress proxy applies them: (host pattern, (headers, ...)) with
    # each headers a tuple of (name, value); values may hold ``${e2b.secrets.NAME}`` markers
    rules: tuple[tuple[str, tuple[tuple[tuple[str, str], ...], ...]], ...] = ()
    # E2B network.egressProxy as the node needs it: (key, value) pairs of scheme ("socks5" /
    # "http"), host, port, username and credential (names the sealed password the node's proxy
    # asks the API for; never the password itself); empty: egress goes out directly
    egress_proxy: tuple[tuple[str, object], ...] = ()
    # E2B network.dnsServers: resolvers the guest's DNS may go to (vmm.net.policy); None: not
    # given (E2B's default, 8.8.8.8 when allow_out names domains), (): none
    dns_servers: tuple[str, ...] | None = None

    def restrictions(self) -> list[str]:
        """The egress restrictions this spec asks for, in words (empty: none)."""
        out = []
        if not self.allow_internet_access:
            out.append("no internet access (allow_internet_access: false)")
        if self.allow_out:
            out.append(f"egress only to {', '.join(self.allow_out)} (allowOut)")
        if self.deny_out:
            out.append(f"no egress to {', '.join(self.deny_out)} (denyOut)")
        if self.rules:
            out.append(f"request rules for {', '.join(p for p, _ in self.rules)} (rules)")
        if self.dns_servers is not None and out:
            out.append(f"DNS to {', '.join(self.dns_servers) or 'no resolver'} (dnsServers)")
        if self.egress_proxy:
            upstream = self.upstream()
            out.append(f"egress through the proxy {upstream['host']}:{upstream['port']} (egressProxy)")
        return out

    def upstream(self) -> dict | None:
        """The upstream proxy as a dict (None: none)."""
        return dict(self.egress_proxy) if self.egress_proxy else None

    def rules_json(self) -> dict[str, list[dict[str, str]]]:
        """The rules as the proxy's slot file holds them: ``{pattern: [{header: value}]}``."""
        return {pattern: [dict(headers) for headers in sets] for pattern, sets in self.rules}

    def to_json(self) -> dict:
        return {"allow_internet_access": self.allow_internet_access, "allow_out": list(self.allow_out),
                "deny_out": list(self.deny_out), "forward_ports": list(self.forward_ports),
                **({"rules": self.rules_json()} if self.rules else {}),
                **({"egress_proxy": self.upstream()} if self.egress_proxy else {}),
                **({"dns_servers": list(self.dns_servers)} if self.dns_servers is not None else {})}

    @classmethod
    def from_json(cls, data: dict | None) -> "NetworkSpec":
        data = data or {}
        return cls(allow_internet_access=bool(data.get("allow_internet_access", True)),
                   allow_out=tuple(data.get("allow_out") or ()), deny_out=tuple(data.get("deny_out") or ()),
                   forward_ports=tuple(int(p) for p in data.get("forward_ports") or (ENVD_PORT,)),
                   rules=tuple((str(pattern), tuple(tuple((str(k), str(v)) for k, v in headers.items())
                                                    for headers in sets))
                               for pattern, sets in (data.get("rules") or {}).items()),
                   egress_proxy=tuple(sorted((data.get("egress_proxy") or {}).items())),
                   dns_servers=None if data.get("dns_servers") is None else tuple(str(a) for a in data["dns_servers"]))
