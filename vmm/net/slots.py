"""Network slots: one network namespace per sandbox, the ground the netns + TAP backend
(vmm.net.netns) stands on.

Why slots: a guest is hostile, so its network must be fenced outside the guest. Each slot
is a named netns holding ``tap0`` (where QEMU attaches, launched through ``nsenter``) and
``vpeer``, one end of a veth pair whose other end is in the node's netns. Every slot gives
the guest the same address and MACs (restored and forked guests need no reconfiguration);
only the /31 on the veth differs per slot. The slot's own nftables table pins the guest's
source, refuses new flows past the guest's conntrack limits (vmm.net.conntrack), drops
everything to the always-denied ranges (the node included: its addresses sit in 10/8 and
loopback) and lets only the node open connections into the guest (a DNAT of the slot
address). Layout and rules: ``../shared/research/networking.md`` §1–2.

Names are the claim: ``ip netns add`` of an existing name fails, so two processes never get
the same slot, and a node that restarts finds its slots by prefix (``list_slots``) and
removes what no VM uses (``destroy``)."""
from __future__ import annotations

import errno
import ipaddress
import os
import subprocess
from dataclasses import dataclass

from pyroute2 import IPRoute, NetlinkError, NetNS, netns

from . import conntrack
from .cidrs import checked_ipv4
from .conntrack import GuestLimits
from .dns import DNSLimits
from .policy import ALWAYS_DENIED, EgressPolicy

# The guest's view, the same in every slot (a snapshot's ABI: never per slot).
GUEST_IP = "169.254.0.21"
GATEWAY_IP = "169.254.0.22"
GUEST_PREFIX = 30
GUEST_MAC = "02:fc:00:00:00:05"
GATEWAY_MAC = "02:fc:00:00:00:06"
TAP = "tap0"
PEER = "vpeer"
DEFAULT_POOL = "10.12.0.0/16"
DEFAULT_PREFIX = "aenv"
# What AENV_NET_ALLOW_EXTRA may never reopen besides the node's addresses and the pool: the
# guests' link-local side (every slot's gateway, a cloud's metadata service at 169.254.169.254).
NEVER_ALLOWED = ("169.254.0.0/16",)


class SlotError(Exception):
    """A slot could not be set up or found (the half-made slot is removed first)."""


@dataclass(frozen=True)
class Slot:
    """Slot ``index`` of the instance ``prefix``: where the node reaches the guest
    (``address``: the netns end of the veth, DNATed to the guest) and what it is called."""

    prefix: str
    index: int
    pool: str = DEFAULT_POOL

    @property
    def netns(self) -> str:
        return f"{self.prefix}-{self.index}"

    @property
    def host_veth(self) -> str:
        return f"{self.prefix}v{self.index}"  # ≤ 15 characters for any index of a /16 pool

    @property
    def host_ip(self) -> str:
        return str(ipaddress.ip_network(self.pool)[2 * self.index])

    @property
    def address(self) -> str:
        return str(ipaddress.ip_network(self.pool)[2 * self.index + 1])

    @property
    def netns_path(self) -> str:
        return f"/run/netns/{self.netns}"

    def nsenter(self, *argv: str) -> list[str]:
        """The command line that runs ``argv`` in this slot's network namespace (QEMU's too)."""
        return ["nsenter", f"--net={self.netns_path}", "--", *argv]


def max_slots(pool: str = DEFAULT_POOL) -> int:
    return ipaddress.ip_network(pool).num_addresses // 2 - 1  # slot 0 is never used


def _run_in(slot: Slot, *argv: str, stdin: str | None = None) -> None:
    done = subprocess.run(slot.nsenter(*argv), input=stdin, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise SlotError(f"{' '.join(argv[:2])} in {slot.netns} failed: {done.stderr.strip() or done.returncode}")


GUEST_DNS = "8.8.8.8"  # the guest's resolv.conf (E2B's); the slot DNATs it to the node's resolver
# A sandbox whose allowOut names domains (vmm.net.egress): its new TCP connections that no
# CIDR allows go to the node's resolver address, port kept; the node hands them to its egress
# proxy (vmm.net.host_table: a DNAT to PROXY_PORT, where SO_ORIGINAL_DST gives the guest's port
# back). If the node's table is gone they reach nothing. DNS goes only to the policy's resolvers
# (``dns_servers``: E2B's dnsServers, by default 8.8.8.8, i.e. the node's resolver).
PROXY_PORT = 15000
# A sandbox with network.egressProxy: its TCP that the policy lets out by address (no name to
# judge) goes to the egress proxy's plain relay here, which chains it to the upstream
# (vmm.net.host_table's ``chained`` DNAT keeps the destination for SO_ORIGINAL_DST).
CHAIN_PORT = 15001
PROXIED_PORTS = "1-65535"
DNS_PORTS = (53, 853)
DEFAULT_DNS_IP = "192.0.2.1"  # the node's resolver, on a dummy interface (vmm.net.dns)


def _elements(cidrs) -> str:
    return f"elements = {{ {', '.join(cidrs)} }}" if cidrs else ""


def rules(lines: list[str]) -> str:
    return "".join(f"        {line}\n" for line in lines)


def allow_extra_ranges(cidrs, pool: str, node: tuple[str, ...] = ()) -> tuple[str, ...]:
    """``cidrs`` (AENV_NET_ALLOW_EXTRA: always-denied ranges the operator opens, e.g. a
    package mirror in 10/8) as normalised IPv4 networks, or SlotError saying which one
    reaches what no guest may: the guests' link-local side (NEVER_ALLOWED), the slot pool
    (the slots and the node's resolver) or ``node`` (the node's addresses and denied ranges).
    The slot table drops ``node`` before it looks at these; refusing says so at node start."""
    forbidden = [(ipaddress.ip_network(c), f"the guests' link-local side {c}") for c in NEVER_ALLOWED]
    forbidden.append((ipaddress.ip_network(pool), f"the slot pool {pool}"))
    forbidden += [(ipaddress.ip_network(c, strict=False), f"the node's {c}") for c in node]
    return checked_ipv4(cidrs, forbidden, "AENV_NET_ALLOW_EXTRA:", "guests may never reach it (list narrower ranges)",
                        SlotError)


def ruleset(slot: Slot, deny_extra: tuple[str, ...] = (), policy: EgressPolicy = EgressPolicy(),
            dns_ip: str | None = DEFAULT_DNS_IP, allow_extra: tuple[str, ...] = (),
            limits: GuestLimits = GuestLimits(), dns_limits: DNSLimits = DNSLimits()) -> str:
    """The slot's own nftables table (one transaction): the guest may send only from its
    address; a new flow passes the guest's conntrack limits (vmm.net.conntrack) or is
    refused; never to the node (``deny_extra``: its addresses and the operator's extra
    ranges; the resolver is reached only through the DNAT of 8.8.8.8:53); never to an
    always-denied range unless the operator allowed it (``allow_extra``, e.g. a package
    mirror); then DNS to the policy's resolvers (``dns_servers``, limited like the node's
    resolver) and no other DNS when allowOut names domains; then E2B's policy (allow list wins
    over deny list, else allowed); never start a connection to the node; and the node's
    connections to the slot address reach the guest."""
    node = ", ".join((*deny_extra, *((f"{dns_ip}/32",) if dns_ip else ()))) or "255.255.255.255/32"
    deny = ", ".join(ALWAYS_DENIED)
    dns = (f"""        iifname "{TAP}" ip daddr {GUEST_DNS} udp dport 53 dnat ip to {dns_ip}
        iifname "{TAP}" ip daddr {GUEST_DNS} tcp dport 53 dnat ip to {dns_ip}
        iifname "{TAP}" ip daddr . tcp dport @dns_servers accept
        iifname "{TAP}" ip daddr != @user_allow tcp dport @proxied dnat ip to {dns_ip}
""" if dns_ip else "")
    proxied, dns_only = _proxy_elements(policy)
    # issue 21: the guest's share of the node's resolver (vmm.net.dns), before anything else
    dns_guard = (f"""    chain dns_limits {{
        type filter hook prerouting priority -160; policy accept;
        iifname "{TAP}" ip daddr {GUEST_DNS} meta l4proto {{ tcp, udp }} th dport 53 limit rate over {dns_limits.rate}/second burst {dns_limits.burst} packets drop
        iifname "{TAP}" ip daddr {GUEST_DNS} tcp dport 53 ct state new ct count over {dns_limits.tcp} reject with tcp reset
        iifname "{TAP}" ip daddr != {GUEST_DNS} meta l4proto {{ tcp, udp }} ip daddr . th dport @dns_servers limit rate over {dns_limits.rate}/second burst {dns_limits.burst} packets drop
        iifname "{TAP}" ip daddr != {GUEST_DNS} ip daddr . tcp dport @dns_servers ct state new ct count over {dns_limits.tcp} reject with tcp reset
    }}
""" if dns_ip else "")
    return f"""
table inet aenv
delete table inet aenv
table inet aenv {{
    set node_deny {{ type ipv4_addr; flags interval; auto-merge; elements = {{ {node} }} }}
    set always_deny {{ type ipv4_addr; flags interval; auto-merge; elements = {{ {deny} }} }}
    set site_allow {{ type ipv4_addr; flags interval; auto-merge; {_elements(allow_extra)} }}
    set user_allow {{ type ipv4_addr; flags interval; auto-merge; {_elements(policy.allow)} }}
    set user_deny {{ type ipv4_addr; flags interval; auto-merge; {_elements(policy.deny)} }}
    set proxied {{ type inet_service; flags interval; {_elements(proxied)} }}
    set dns_only {{ type inet_service; {_elements(dns_only)} }}
    set dns_servers {{ type ipv4_addr . inet_service; {_elements(resolver_elements(policy))} }}
{dns_guard}    chain guard {{
        type filter hook prerouting priority -150; policy accept;
        iifname != "{TAP}" accept
        meta nfproto ipv6 drop
        ip saddr != {GUEST_IP} drop
        ct state established,related accept
        ct state invalid drop
        ct state new jump ct_limits
        ip daddr @node_deny drop
        ip daddr @always_deny ip daddr != @site_allow drop
        meta l4proto {{ tcp, udp }} ip daddr . th dport @dns_servers accept
        meta l4proto {{ tcp, udp }} th dport @dns_only drop
        ip daddr @user_allow accept
        tcp dport @proxied accept
        ip daddr @user_deny drop
    }}
    chain ct_limits {{
{rules(conntrack.slot_rules(limits))}    }}
    chain refuse {{
{rules(conntrack.REFUSE_RULES)}    }}
    chain to_guest {{
        type nat hook prerouting priority dstnat; policy accept;
        iifname "{PEER}" ip daddr {slot.address} dnat ip to {GUEST_IP}
{dns}    }}
    chain from_guest {{
        type nat hook postrouting priority srcnat; policy accept;
        oifname "{PEER}" ip saddr {GUEST_IP} snat ip to {slot.address}
    }}
    chain forwarding {{
        type filter hook forward priority 0; policy drop;
        iifname "{TAP}" oifname "{PEER}" accept
        iifname "{PEER}" oifname "{TAP}" ct status dnat accept
        iifname "{PEER}" oifname "{TAP}" ct state established,related accept
    }}
    chain to_slot {{
        type filter hook input priority 0; policy accept;
        iifname "{TAP}" ct state established,related accept
        iifname "{TAP}" drop
    }}
}}
"""


def _proxy_elements(policy: EgressPolicy) -> tuple[list[str], list[str]]:
    """The slot's ``proxied`` and ``dns_only`` ports for a policy: empty unless it names
    domains, so a sandbox without them never meets the proxy."""
    if not policy.domains:
        return [], []
    return [PROXIED_PORTS], [str(p) for p in DNS_PORTS]


def resolver_elements(policy: EgressPolicy) -> list[str]:
    """The slot's ``dns_servers`` set (address . port) for a policy: DNS and DNS over TLS to
    each resolver it names; 8.8.8.8 is the node's resolver (the DNAT above), which serves 53 only."""
    return [f"{r} . {port}" for r in policy.resolvers for port in (DNS_PORTS[:1] if r == GUEST_DNS else DNS_PORTS)]


def policy_script(policy: EgressPolicy) -> str:
    """Replaces the slot's policy sets in one transaction (atomic: no packet sees a half
    policy). Only new flows are judged, as on E2B: an established connection stays."""
    # the proxy's sets are declared first: a slot made before them (a VM that outlived an
    # upgrade) then takes a policy without domains as before (apply_policy refuses domains there)
    lines = ["add set inet aenv proxied { type inet_service; flags interval; }",
             "add set inet aenv dns_only { type inet_service; }",
             "add set inet aenv dns_servers { type ipv4_addr . inet_service; }",
             "flush set inet aenv user_allow", "flush set inet aenv user_deny", "flush set inet aenv proxied",
             "flush set inet aenv dns_only", "flush set inet aenv dns_servers"]
    proxied, dns_only = _proxy_elements(policy)
    for name, elements in (("user_allow", policy.allow), ("user_deny", policy.deny), ("proxied", proxied),
                           ("dns_only", dns_only), ("dns_servers", resolver_elements(policy))):
        if elements:
            lines.append(f"add element inet aenv {name} {{ {', '.join(elements)} }}")
    return "\n".join(lines) + "\n"


def _guard(slot: Slot) -> str:
    done = subprocess.run(slot.nsenter("nft", "list", "chain", "inet", "aenv", "guard"), capture_output=True,
                          text=True, timeout=30)
    return done.stdout if done.returncode == 0 else ""


def has_proxy_rules(slot: Slot) -> bool:
    """Whether the slot's table sends proxied ports to the egress proxy (slots made before
    the proxy existed do not)."""
    return "@proxied" in _guard(slot)


def apply_policy(slot: Slot, policy: EgressPolicy) -> None:
    """Sets the slot's egress policy now (running guests included); SlotError if the slot's
    table is too old for it: domains need it to send connections to the egress proxy, and
    resolvers other than the default its ``dns_servers`` rules (before them, a domain
    sandbox's DNS went to 8.8.8.8 only, anyone else's by the CIDRs)."""
    legacy = policy.resolvers == ((GUEST_DNS,) if policy.domains else ())
    guard = _guard(slot) if policy.domains or not legacy else ""
    if policy.domains and "@proxied" not in guard:
        raise SlotError(f"slot {slot.netns} was made before the egress proxy: domain rules cannot be enforced "
                        "there (restart the sandbox from a pause)")
    if not legacy and "@dns_servers" not in guard:
        raise SlotError(f"slot {slot.netns} was made before dnsServers were enforced: they cannot be applied "
                        "there (restart the sandbox from a pause)")
    _run_in(slot, "nft", "-f", "-", stdin=policy_script(policy))


def apply_limits(slot: Slot, limits: GuestLimits) -> None:
    """Replaces the slot's conntrack limits (its counts start again: a fresh slot only)."""
    _run_in(slot, "nft", "-f", "-", stdin=conntrack.limits_script(limits))


def create(slot: Slot, deny_extra: tuple[str, ...] = (), dns_ip: str | None = DEFAULT_DNS_IP,
           allow_extra: tuple[str, ...] = (), limits: GuestLimits = GuestLimits(),
           dns_limits: DNSLimits = DNSLimits()) -> Slot:
    """Makes the slot: its netns (the claim: SlotError if it exists), the veth pair, tap0,
    addresses, the guest's neighbour entry, routes, sysctls and the nftables table. On any
    failure what was made is removed and SlotError raised."""
    # Looked for first: pyroute2's netns.create forks a child to make it and, when that child
    # fails (the name exists), never reaps it, one zombie per try (a soak's node had 2,300).
    if os.path.exists(slot.netns_path):
        raise SlotError(f"slot {slot.netns} is taken")
    try:
        netns.create(slot.netns)
    except FileExistsError:  # made meanwhile by another process (its zombie is the one left)
        raise SlotError(f"slot {slot.netns} is taken") from None
    try:
        _configure(slot, deny_extra, dns_ip, allow_extra, limits, dns_limits)
    except BaseException as exc:
        destroy(slot)
        if isinstance(exc, SlotError):
            raise
        raise SlotError(f"slot {slot.netns} could not be set up: {exc!r}") from exc
    return slot


def _configure(slot: Slot, deny_extra: tuple[str, ...], dns_ip: str | None, allow_extra: tuple[str, ...],
               limits: GuestLimits, dns_limits: DNSLimits = DNSLimits()) -> None:
    with IPRoute() as ipr:
        ipr.link("add", ifname=slot.host_veth, kind="veth", peer={"ifname": PEER, "net_ns_fd": slot.netns})
        host = ipr.link_lookup(ifname=slot.host_veth)[0]
        ipr.addr("add", index=host, address=slot.host_ip, prefixlen=31)
        ipr.link("set", index=host, state="up")
    with NetNS(slot.netns) as ns:
        lo = ns.link_lookup(ifname="lo")[0]
        ns.link("set", index=lo, state="up")
        peer = ns.link_lookup(ifname=PEER)[0]
        ns.addr("add", index=peer, address=slot.address, prefixlen=31)
        ns.link("set", index=peer, state="up")
        ns.link("add", ifname=TAP, kind="tuntap", mode="tap")
        tap = ns.link_lookup(ifname=TAP)[0]
        ns.link("set", index=tap, address=GATEWAY_MAC)
        ns.addr("add", index=tap, address=GATEWAY_IP, prefixlen=GUEST_PREFIX)
        ns.link("set", index=tap, state="up")
        ns.neigh("add", dst=GUEST_IP, lladdr=GUEST_MAC, ifindex=tap, state="permanent")
        ns.route("add", dst="default", gateway=slot.host_ip)
    # A new netns inherits IPv4 settings from its creator (this host: ip_forward=0).
    _run_in(slot, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=1",
            "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1")
    _run_in(slot, "nft", "-f", "-", stdin=ruleset(slot, deny_extra, dns_ip=dns_ip, allow_extra=allow_extra,
                                                           limits=limits, dns_limits=dns_limits))


def remove_link(name: str) -> bool:
    """Deletes a host interface (a slot's veth) if it exists. A veth whose peer's netns was
    just removed vanishes on its own moments later (the kernel frees the netns
    asynchronously), so "no such device" meanwhile counts as removed."""
    with IPRoute() as ipr:
        found = ipr.link_lookup(ifname=name)
        if not found:
            return False
        try:
            ipr.link("del", index=found[0])
        except NetlinkError as exc:
            if exc.code != errno.ENODEV:
                raise
        return True


def destroy(slot: Slot) -> bool:
    """Removes the slot (its netns takes tap0 and the veth pair with it). False if there was
    nothing to remove."""
    found = remove_link(slot.host_veth)
    if slot.netns in netns.listnetns():
        try:
            netns.remove(slot.netns)
        except FileNotFoundError:
            pass  # removed meanwhile
        found = True
    return found


def list_slots(prefix: str = DEFAULT_PREFIX, pool: str = DEFAULT_POOL) -> list[Slot]:
    """The slots of this instance that exist now (after a restart: what it finds)."""
    found = []
    for name in netns.listnetns():
        head, _, tail = name.rpartition("-")
        if head == prefix and tail.isdigit():
            found.append(Slot(prefix, int(tail), pool))
    return sorted(found, key=lambda s: s.index)


def stray_veths(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Host veths of this instance whose slot netns is gone (a crash between the two)."""
    names = set(netns.listnetns())
    with IPRoute() as ipr:
        veths = [link.get_attr("IFLA_IFNAME") for link in ipr.get_links()]
    out = []
    for name in veths:
        if name and name.startswith(f"{prefix}v") and name[len(prefix) + 1:].isdigit():
            if f"{prefix}-{name[len(prefix) + 1:]}" not in names:
                out.append(name)
    return out


def netns_supported() -> bool:
    """Whether this process can make slots: root, /run/netns writable, nft and nsenter present."""
    from shutil import which  # noqa: PLC0415

    return os.geteuid() == 0 and which("nft") is not None and which("nsenter") is not None
