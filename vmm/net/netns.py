"""NetnsBackend: every VM in a network slot of its own (vmm.net.slots), the default wherever
the node runs as root with nft and nsenter (``choose_backend``).

Why: a guest is hostile, so its network is fenced outside it: the slot's table and the
node's table (vmm.net.host_table) keep it off the node and its neighbours, and enforce the
E2B egress policy (vmm.net.policy). The node reaches every guest port at the slot address
(``Attachment.guest_host``), so nothing is forwarded per port and the data plane can serve
any port; where the data plane runs elsewhere, its addresses are ``ingress_from``
(``AENV_NET_INGRESS_FROM``): they may open connections into slots (vmm.net.host_table) and,
like the node, are never reachable from a guest. The hypervisor runs inside the slot
(``launch_prefix``: nsenter), where it opens ``tap0``. Slots come warm from a SlotPool; a
VM that stops for good or is paused to disk gives its slot back (destroyed, never reused)
and gets a fresh one when it runs again: the guest's address and MAC are the same in every
slot, so nothing in the guest changes.
"""
from __future__ import annotations

import logging
from pathlib import Path

from pyroute2 import IPRoute

from envd import ENVD_PORT
from vmm.errors import UnsupportedNetworkPolicy
from vmm.net import host_table
from vmm.net import policy as egress
from vmm.net import slots
from vmm.net.backend import Attachment, NetworkBackend
from vmm.net.conntrack import GuestLimits
from vmm.net.dns import DNSLimits, NodeDNS, service_ip
from vmm.net.egress import EgressProxy, EgressProxyError
from vmm.net.slot_pool import SlotPool
from vmm.net.slots import Slot
from vmm.net.spec import NetworkSpec

log = logging.getLogger(__name__)


def node_addresses() -> tuple[str, ...]:
    """Every IPv4 address of this host (netns) as a /32, for the slots' deny set (they are
    also dropped by the node's table; this keeps them closed if that table is flushed)."""
    with IPRoute() as ipr:
        found = {a.get_attr("IFA_ADDRESS") for a in ipr.get_addr(family=2)}
    return tuple(sorted(f"{a}/32" for a in found if a))


class NetnsBackend(NetworkBackend):
    name = "netns"
    enforces_egress = True

    def __init__(self, home: Path, prefix: str = slots.DEFAULT_PREFIX, pool: str = slots.DEFAULT_POOL,
                 warm: int = 4, deny_extra: tuple[str, ...] = (), allow_extra: tuple[str, ...] = (),
                 dns: bool = True, ingress_from: tuple[str, ...] = (), limits: GuestLimits = GuestLimits(),
                 dns_limits: DNSLimits = DNSLimits(), egress_options: dict | None = None):
        self.prefix, self.pool_cidr = prefix, pool
        self.ingress_from = host_table.ingress_sources(ingress_from, pool)  # refused at start if unfit
        self.dns = NodeDNS(prefix, pool, Path(home) / "net", dns_limits) if dns else None
        dns_ip = service_ip(pool) if dns else None
        node = (*node_addresses(), *self.ingress_from)
        allow_extra = slots.allow_extra_ranges(allow_extra, pool, node)  # refused at start if it reopens these
        # domain rules: the node's egress proxy on the resolver's address (none without a resolver);
        # ``egress_options``: its ca_pem / secrets / upstream_ca (vmm.net.egress), for network.rules
        self.egress = (EgressProxy(prefix, dns_ip, Path(home) / "net", node=(*node, *deny_extra),
                                   reopened=allow_extra, **(egress_options or {})) if dns else None)
        self.egress_error = "" if self.egress else "the node runs no resolver of its own"
        self.slots = SlotPool(prefix, pool, warm=warm, deny_extra=(*node, *deny_extra), allow_extra=allow_extra,
                              dns_ip=dns_ip, ingress=self.ingress_from, limits=limits,
                              dns_limits=dns_limits)
        self.host_address = ""  # per VM: its slot address

    # -- node start / stop --------------------------------------------------------------------

    def start(self, in_use: set[int]) -> list[Slot]:
        """At node start: the resolver, the node's table rebuilt with the slots of VMs that
        outlived the worker, every other slot of this instance removed, warm slots made.
        Returns the slots removed."""
        if self.dns is not None:
            self.dns.ensure()
        if self.egress is not None:
            try:
                self.egress.ensure()
            except (EgressProxyError, OSError, KeyError) as exc:
                self.egress_error = str(exc)
                log.warning("egress proxy: %s: domain names in allowOut are refused on this node", exc)
        chained = self.egress.chained() if self.egress is not None else set()
        removed = self.slots.adopt(in_use, {i for i in in_use
                                            if Slot(self.prefix, i, self.pool_cidr).address in chained})
        self.slots.start()
        return removed

    def close(self) -> None:
        self.slots.close()

    # -- one VM ---------------------------------------------------------------------------------

    def check(self, spec: NetworkSpec) -> None:
        try:
            policy = egress_of(spec)
        except egress.PolicyError as exc:
            raise UnsupportedNetworkPolicy(str(exc)) from None
        if policy.domains and not self._proxy_ready():
            raise UnsupportedNetworkPolicy(
                f"domain names in allowOut ({', '.join(policy.domains)}) need the node's egress proxy, which is not "
                f"running here: {self.egress_error or 'it stopped'}")
        if spec.rules:
            if not policy.domains:
                raise UnsupportedNetworkPolicy(
                    "network.rules apply to the connections the node's egress proxy judges: allowOut must name "
                    "the rules' hosts as domains (with 0.0.0.0/0 in denyOut)")
            if not self._proxy_ready() or not self.egress.intercepts:
                raise UnsupportedNetworkPolicy(
                    "network.rules need the node's egress proxy with the node's CA, which this node does not run: "
                    f"{self.egress_error or 'no CA was given to it'}")
        if spec.egress_proxy:
            if not self._proxy_ready():
                raise UnsupportedNetworkPolicy(
                    "network.egressProxy needs the node's egress proxy, which is not running here: "
                    f"{self.egress_error or 'it stopped'}")
            if not self.egress.chains() or not host_table.has_chained(self.prefix):
                raise UnsupportedNetworkPolicy(
                    "network.egressProxy: this node's egress proxy cannot chain to an upstream proxy (python-socks "
                    "missing from .venv-egress, or a node table from before: restart the node worker)")

    def _proxy_ready(self) -> bool:
        if self.egress is None or self.egress.pid() is None:
            return False
        self.egress_error = ""
        return True

    def _set_policy(self, slot: Slot, sandbox_id: str, policy: egress.EgressPolicy, rules: dict | None = None,
                    upstream: dict | None = None) -> None:
        """The slot's policy, and the proxy's file (domains, rules, upstream proxy) for it: the
        file is written before the slot or the node's table send anything to the proxy and
        removed after they stop. ``upstream``: every TCP connection the policy lets out goes
        to the proxy (the node's ``chained`` set), which chains it to that proxy."""
        was_chained = self.egress is not None and self.egress.upstream_of(slot.address)
        if policy.domains or upstream:
            # the relay sees TCP DNS to the resolvers too (the slot lets only DNS ports out to them)
            resolvers = tuple(f"{r}/32" for r in policy.resolvers)
            self.egress.allow(slot.address, sandbox_id, policy.domains, rules, upstream, (*policy.allow, *resolvers),
                              policy.deny)
        try:
            if not upstream and was_chained:
                host_table.set_chained(self.prefix, slot.host_veth, False)
            slots.apply_policy(slot, policy)
            if upstream:
                host_table.set_chained(self.prefix, slot.host_veth, True)
        except (slots.SlotError, host_table.HostTableError) as exc:
            raise UnsupportedNetworkPolicy(str(exc)) from None
        if not policy.domains and not upstream and self.egress is not None:
            self.egress.forget(slot.address)

    def slot(self, attachment: Attachment) -> Slot:
        return Slot(self.prefix, int(attachment.slot), self.pool_cidr)

    def launch_prefix(self, attachment: Attachment) -> list[str]:
        """What the hypervisor's command line runs under: its slot's network namespace."""
        return self.slot(attachment).nsenter()

    def attach(self, sandbox_id: str, state_dir: Path, spec: NetworkSpec) -> Attachment:
        self.check(spec)
        policy = egress_of(spec)  # a bad policy is refused before a slot is taken
        slot = self.slots.acquire()
        try:
            if not policy.open or policy.allow or policy.resolvers or spec.egress_proxy:  # a new slot's: open
                self._set_policy(slot, sandbox_id, policy, spec.rules_json(), spec.upstream())
        except BaseException:
            self.slots.release(slot)
            if self.egress is not None:
                self.egress.forget(slot.address)
            raise
        return self.attachment_of(sandbox_id, slot.index)

    def attachment_of(self, sandbox_id: str, slot_index: int) -> Attachment:
        """The Attachment of a VM that has slot ``slot_index`` (rebuilt from its record)."""
        address = Slot(self.prefix, slot_index, self.pool_cidr).address
        return Attachment(self.name, sandbox_id, address, {ENVD_PORT: ENVD_PORT}, slot=slot_index,
                          guest_host=address)

    def forward(self, attachment: Attachment, state_dir: Path, guest_port: int) -> int:
        attachment.forwards[guest_port] = guest_port  # every port is reachable at the slot address
        return guest_port

    def apply_egress(self, attachment: Attachment, spec: NetworkSpec) -> None:
        self.check(spec)
        if attachment.slot:
            self._set_policy(self.slot(attachment), attachment.sandbox_id, egress_of(spec), spec.rules_json(),
                             spec.upstream())

    def detach(self, attachment: Attachment, state_dir: Path) -> None:
        if attachment.slot:
            slot = self.slot(attachment)
            self.slots.release(slot)
            if self.egress is not None:
                self.egress.forget(slot.address)

    def in_use(self) -> set[int]:
        return self.slots.in_use()


def egress_of(spec: NetworkSpec) -> egress.EgressPolicy:
    """The slot policy of a NetworkSpec (vmm.net.policy: E2B's semantics)."""
    return egress.parse(list(spec.allow_out), list(spec.deny_out), spec.allow_internet_access, spec.dns_servers)


def remove_instance(prefix: str, pool: str, home: Path) -> dict:
    """Removes everything an aenv instance's network left on this host: every slot and
    stray veth of ``prefix``, its nftables table, its resolver. For an instance going away
    for good (a test stack, an uninstall) once its VMs are gone; never while they run."""
    removed = [s.netns for s in slots.list_slots(prefix, pool) if slots.destroy(s)]
    for name in slots.stray_veths(prefix):
        slots.remove_link(name)
    table = host_table.remove(prefix)
    NodeDNS(prefix, pool, Path(home) / "net").stop()
    EgressProxy(prefix, service_ip(pool), Path(home) / "net").stop()
    return {"slots": removed, "table": table}
