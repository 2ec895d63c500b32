"""The network seam between a VM and the host.

Why: per-sandbox networking (a netns + TAP device per VM, an enforced egress policy) comes
next; drivers only ask a backend to attach a VM's network (vmm.net.backend.NetworkBackend:
attach / detach / forward a guest port / apply an egress policy) and build their network
device from the Attachment it returns, so a new backend lands here, not in every driver verb.
BootSpec.network (a NetworkSpec) says what a VM's network must be. Today's only backend is
QEMU's user-mode networking (SlirpBackend); it cannot filter egress, so it refuses a restriction
(UnsupportedNetworkPolicy) rather than accepting and ignoring it.

Modules: spec (NetworkSpec, guest addresses, ENVD_PORT), backend (Attachment, NetworkBackend),
policy (E2B's egress semantics), slirp (SlirpBackend: restricted, the fallback), netns
(NetnsBackend: a slot per VM), slots / slot_pool / host_table / dns (what netns stands on),
ports (host port allocation for slirp forwards). ``choose_backend`` is the one decision of
which backend a node uses.
"""

import logging

from envd import ENVD_PORT
from vmm.errors import UnsupportedNetworkPolicy
from vmm.net.backend import Attachment, NetworkBackend
from vmm.net.slirp import SlirpBackend
from vmm.net.spec import DNS, GATEWAY, GUEST_IP, GUEST_PREFIX, NetworkSpec

log = logging.getLogger(__name__)


def choose_backend(mode: str = "auto", *, home, host_address: str, sandboxes_dir, port_range=None,
                   prefix: str = "aenv", pool: str = "10.12.0.0/16", warm: int = 4, deny_extra: tuple = (),
                   allow_extra: tuple = (), ingress_from: tuple = (), limits=None,
                   dns_limits=None, egress_options: dict | None = None) -> NetworkBackend:
    """``netns`` wherever the node can make slots (root, nft, nsenter), else — or when asked
    for ``slirp`` — restricted slirp, with a warning: guests then have no egress at all and
    only envd's port is reachable. ``auto`` picks; ``netns`` refuses to fall back.
    ``ingress_from``: sources besides the node that may open connections into slots (netns);
    ``limits``: each guest's conntrack limits (vmm.net.conntrack.GuestLimits; None: defaults);
    ``dns_limits``: each guest's share of the node's resolver (vmm.net.dns.DNSLimits; None: defaults);
    ``egress_options``: the egress proxy's node CA, secrets client and upstream CA (vmm.net.egress)."""
    from vmm.net import slots  # noqa: PLC0415 - pyroute2 is imported only where it is used

    if mode not in ("auto", "netns", "slirp"):
        raise ValueError(f"unknown network backend {mode!r} (auto, netns or slirp)")
    if mode in ("auto", "netns") and slots.netns_supported():
        from vmm.net.netns import NetnsBackend  # noqa: PLC0415

        from vmm.net.conntrack import GuestLimits  # noqa: PLC0415
        from vmm.net.dns import DNSLimits  # noqa: PLC0415

        return NetnsBackend(home, prefix=prefix, pool=pool, warm=warm, deny_extra=deny_extra,
                            allow_extra=allow_extra, ingress_from=tuple(ingress_from), limits=limits or GuestLimits(),
                            dns_limits=dns_limits or DNSLimits(), egress_options=egress_options)
    if mode == "netns":
        raise UnsupportedNetworkPolicy("the netns network backend needs root, nft and nsenter")
    if ingress_from:  # a limit slirp could not keep: refused, never ignored
        raise UnsupportedNetworkPolicy(
            f"AENV_NET_INGRESS_FROM ({', '.join(ingress_from)}) needs the netns network backend: slirp's "
            "forwards listen on the node address for whoever reaches it and cannot limit who connects")
    log.warning("network backend: restricted slirp (%s): sandboxes get NO egress and only envd's port is "
                "reachable; run the node as root with nftables and util-linux for per-sandbox networks",
                "asked for" if mode == "slirp" else "this node cannot make network namespaces")
    return SlirpBackend(host_address, sandboxes_dir, *((port_range,) if port_range else ()))


__all__ = ["choose_backend", "ENVD_PORT", "DNS", "GATEWAY", "GUEST_IP", "GUEST_PREFIX", "Attachment", "NetworkBackend", "NetworkSpec",
           "SlirpBackend", "UnsupportedNetworkPolicy"]
