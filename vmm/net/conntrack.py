"""Connection tracking limits for guests: how many flows a guest may hold and how fast it may
start new ones, and how long the node keeps its flows.

Why: every flow a guest starts is tracked twice, in its slot's netns and, once the slot has
forwarded it and the node masqueraded it, in the node's own table, whose size
(``net.netfilter.nf_conntrack_max``) the node and every guest share. A full table makes the
kernel drop every new connection of the node, the data plane's into guests included. So:

- the slot's table (vmm.net.slots, chain ``ct_limits``) refuses a guest's new flow while the
  guest already holds ``max_flows`` tracked flows (nft ``ct count``; the kernel does not
  count TCP flows in TIME_WAIT or CLOSE) or when it starts them faster than ``new_rate`` a
  second after a burst of ``new_burst`` (nft ``limit``). A TCP connect gets a reset, any
  other flow an ICMP admin-prohibited: the guest's program fails at once (ECONNREFUSED,
  EHOSTUNREACH) instead of hanging, its other flows go on. DNS to 8.8.8.8 counts like any
  flow (the guard sees it before the DNAT to the node's resolver). Only what enters at
  ``tap0`` is counted: the node's connections into the guest come in at ``vpeer``.
- every flow a guest can start passes there, so it holds at most ``max_flows`` live entries in
  the node's table as long as no node entry outlives the slot's: the node's table
  (vmm.net.host_table) gives the guests' TCP flows a timeout policy (``NODE_TCP_TIMEOUTS``)
  no longer than the kernel defaults the slot keeps, established 2 h 4 min (RFC 5382's
  least for a NAT) instead of 5 days and TIME_WAIT 10 s instead of 120, so the uncounted
  TIME_WAIT entries stay under ``new_rate`` × 10 + ``new_burst`` per guest.
- a slot that goes away takes its entries out of the node's table (``forget``): a guest
  paused and resumed gets a new slot each time and would otherwise leave its flows behind.

Per guest the node's table holds at most about ``max_flows + 10 × new_rate + new_burst``
entries (7096 by default); size ``nf_conntrack_max`` for the sandboxes a node runs."""
from __future__ import annotations

import logging
import socket
from dataclasses import dataclass

log = logging.getLogger(__name__)

DEFAULT_MAX_FLOWS = 4096
DEFAULT_NEW_RATE = 200  # new flows a second
DEFAULT_NEW_BURST = 1000
LIMIT_MAX = 1_000_000  # above any sane value: a typo, not a setting
NODE_TCP_TIMEOUTS = {"established": 7440, "time_wait": 10, "close": 10}
TIMEOUT_POLICY = "guest_tcp"  # the node table's ct timeout object


class LimitsError(ValueError):
    """A limit that cannot be enforced (the message names the setting)."""


@dataclass(frozen=True)
class GuestLimits:
    """Per sandbox: tracked flows at once (AENV_NET_CT_MAX_PER_SANDBOX), new flows a second
    (AENV_NET_CT_NEW_RATE) and the burst allowed above that rate (AENV_NET_CT_NEW_BURST)."""

    max_flows: int = DEFAULT_MAX_FLOWS
    new_rate: int = DEFAULT_NEW_RATE
    new_burst: int = DEFAULT_NEW_BURST

    def __post_init__(self):
        for name, value, least in (("AENV_NET_CT_MAX_PER_SANDBOX", self.max_flows, 1),
                                   ("AENV_NET_CT_NEW_RATE", self.new_rate, 1),
                                   ("AENV_NET_CT_NEW_BURST", self.new_burst, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= LIMIT_MAX:
                raise LimitsError(f"{name}={value!r}: a whole number from {least} to {LIMIT_MAX}")


def slot_rules(limits: GuestLimits) -> list[str]:
    """The rules of a slot's ``ct_limits`` chain (the guard jumps there for every new flow)."""
    return [f"ct count over {limits.max_flows} jump refuse",
            f"limit rate over {limits.new_rate}/second burst {limits.new_burst} packets jump refuse"]


REFUSE_RULES = ["meta l4proto tcp reject with tcp reset", "reject with icmpx admin-prohibited"]


def limits_script(limits: GuestLimits, table: str = "inet aenv") -> str:
    """Replaces a slot's limits in one transaction. Counting starts again from zero, so the
    node sets limits only on a slot no guest has used yet (tests lower them on a fresh one)."""
    lines = [f"flush chain {table} ct_limits", *(f"add rule {table} ct_limits {r}" for r in slot_rules(limits))]
    return "\n".join(lines) + "\n"


def node_timeout_object() -> str:
    """The node table's timeout policy for guests' TCP flows (nft syntax)."""
    policy = ", ".join(f"{state}: {seconds}" for state, seconds in NODE_TCP_TIMEOUTS.items())
    return (f"    ct timeout {TIMEOUT_POLICY} {{\n        protocol tcp\n        l3proto ip\n"
            f"        policy = {{ {policy} }}\n    }}\n")


def forget(address: str) -> int:
    """Deletes the node's conntrack entries of a slot address that went away (its guest's
    flows, masqueraded from it, and the node's connections to it). Returns how many."""
    from pyroute2 import Conntrack, NetlinkError  # noqa: PLC0415 - netlink only where it is used
    from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple  # noqa: PLC0415

    gone = 0
    try:
        with Conntrack() as ct:
            for match in (NFCTAttrTuple(family=socket.AF_INET, saddr=address),
                          NFCTAttrTuple(family=socket.AF_INET, daddr=address)):
                for entry in list(ct.dump_entries(tuple_orig=match)):
                    try:
                        ct.delete(entry)
                        gone += 1
                    except NetlinkError:
                        pass  # expired meanwhile
    except (NetlinkError, OSError):  # a slot goes away all the same; its entries time out
        log.warning("could not delete the conntrack entries of %s", address, exc_info=True)
    return gone
