"""A node's pool of network slots: made ahead of time so that a create is a restore plus a
slot handover, not a restore plus netns setup (issue 10).

Why a pool: making a slot (netns, veth, tap, addresses, two nft transactions) costs tens of
milliseconds; taking a made one costs nothing. ``acquire`` hands out a warm slot (making one
only when the pool is empty) and a background thread refills the pool to ``warm``; ``release``
hands a slot to that thread to destroy (a slot is never reused: a fresh netns carries no
conntrack state or rules of a previous sandbox; the node's conntrack entries of its address
go with it). At node start ``adopt`` keeps the slots its VMs still use and removes the
rest, with what a crash left half-made. Every slot joins the node's table (``host_table``)
and gets IPv4 forwarding on its host veth only. Where the host's own firewall drops forwarded
traffic (Docker), the slots' accepts are kept in it (``host_firewall``): with the table at
start, for each slot made and every ``host_firewall.RECHECK`` seconds."""
from __future__ import annotations

import logging
import subprocess
import threading
import time

from . import conntrack, host_firewall, host_table, slots
from .conntrack import GuestLimits
from .dns import DNSLimits
from .slots import Slot, SlotError

log = logging.getLogger(__name__)


# Released slots waiting for the background thread at most: past this, a release destroys its
# slot itself (~40 ms). Without a bound, a background thread that fell behind (the soak's node,
# busy making warm slots on a loaded host) let 1,600 dead slots pile up until the pool's
# addresses ran out and creates failed with "no free slot left".
DYING_MAX = 32


class SlotPool:
    def __init__(self, prefix: str = slots.DEFAULT_PREFIX, pool: str = slots.DEFAULT_POOL, warm: int = 4,
                 deny_extra: tuple[str, ...] = (), dns_ip: str | None = None, allow_extra: tuple[str, ...] = (),
                 ingress: tuple[str, ...] = (), limits: GuestLimits = GuestLimits(),
                 dns_limits: DNSLimits = DNSLimits()):
        self.prefix, self.pool, self.warm, self.deny_extra = prefix, pool, warm, deny_extra
        self.limits = limits  # each guest's conntrack limits (vmm.net.conntrack)
        self.dns_ip, self.allow_extra = dns_ip, allow_extra
        self.dns_limits = dns_limits  # each guest's share of the node's resolver (vmm.net.dns)
        self.ingress = ingress  # sources besides the node that may open connections into a slot (host_table)
        self._lock = threading.Lock()
        self._ready: list[Slot] = []
        self._dying: list[Slot] = []  # released, destroyed by the background thread
        self._in_use: set[int] = set()
        self._making: set[int] = set()  # indexes a _make is creating now (concurrent makers skip them)
        self._refill = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._table_ready = False
        self._cursor = 1  # where the search for the next free index starts
        self._firewall_checked = 0.0  # monotonic time of the last host_firewall check
        self._firewall_error = ""  # its last error (logged once)

    # -- node start -------------------------------------------------------------------------------

    def adopt(self, in_use: set[int], chained: set[int] = frozenset()) -> list[Slot]:
        """At node start: (re)builds the node's table, keeps the slots in ``in_use`` (VMs that
        outlived the worker; ``chained``: those of them whose TCP goes to an upstream proxy,
        host_table) and removes every other slot and stray veth of this instance.
        Returns the slots removed."""
        removed = []
        for slot in slots.list_slots(self.prefix, self.pool):
            if slot.index not in in_use:
                slots.destroy(slot)
                removed.append(slot)
        for name in slots.stray_veths(self.prefix):
            slots.remove_link(name)
        kept = tuple(Slot(self.prefix, i, self.pool).host_veth for i in sorted(in_use))
        upstream = tuple(Slot(self.prefix, i, self.pool).host_veth for i in sorted(set(chained) & set(in_use)))
        host_table.install(self.prefix, self.pool, kept, self.dns_ip, self.ingress, upstream)  # with the accepts
        self._table_ready = True
        self._firewall_checked = time.monotonic()
        with self._lock:
            self._in_use = set(in_use)
            self._ready = []
            self._dying = []
        return removed

    def start(self) -> None:
        """Starts the background refill (after ``adopt``)."""
        self._thread = threading.Thread(target=self._refill_loop, name=f"{self.prefix}-slots", daemon=True)
        self._thread.start()
        self._refill.set()

    def close(self) -> None:
        """Stops the refill and removes the warm and released slots (slots in use stay with
        their VMs, and so do the host firewall's accepts while there are any)."""
        self._stop.set()
        self._refill.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        with self._lock:
            gone, self._ready, self._dying = self._ready + self._dying, [], []
        for slot in gone:
            self._destroy(slot)
        if not self.in_use():
            try:
                host_firewall.remove(self.prefix)
            except host_firewall.HostFirewallError as exc:  # best effort: the next start puts them right
                log.warning("could not remove the slots' accepts from the host firewall: %s", exc)

    # -- handing slots out ------------------------------------------------------------------------

    def acquire(self) -> Slot:
        """A ready slot for a new VM (warm if there is one)."""
        with self._lock:
            slot = self._ready.pop() if self._ready else None
            if slot is not None:
                self._in_use.add(slot.index)
        self._refill.set()
        if slot is None:
            slot = self._make()
            with self._lock:
                self._in_use.add(slot.index)
        return slot

    def release(self, slot: Slot) -> None:
        """The VM's process is gone: its slot is destroyed — by the background thread when it
        runs (a pause or kill does not wait ~30 ms for netlink and nft; nothing sends from a
        slot whose VM is gone, and its index is not handed out until it is destroyed), else,
        or when DYING_MAX slots already wait for it, here."""
        with self._lock:
            self._in_use.discard(slot.index)
            later = (self._thread is not None and self._thread.is_alive() and not self._stop.is_set()
                     and len(self._dying) < DYING_MAX)
            if later:
                self._dying.append(slot)
        if later:
            self._refill.set()
        else:
            self._destroy(slot)

    def settle(self, timeout: float = 30.0) -> bool:
        """Waits until released slots are destroyed (tests, node shutdown); False on timeout."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self._lock:
                if not self._dying:
                    return True
            time.sleep(0.02)
        return False

    def in_use(self) -> set[int]:
        with self._lock:
            return set(self._in_use)

    def ready(self) -> int:
        with self._lock:
            return len(self._ready)

    # -- inside -----------------------------------------------------------------------------------

    def _make(self) -> Slot:
        """A new slot at the next free index after the last one made (the netns name is the
        claim, so another process taking the same index only moves us on). Indexes rotate
        through the pool rather than reusing the lowest: an address just given back is not
        handed out again at once, so a client still holding a connection to it gets no
        stranger's guest."""
        if not self._table_ready:
            host_table.ensure(self.prefix, self.pool, self.dns_ip, self.ingress)
            self._table_ready = True
        total = slots.max_slots(self.pool)
        with self._lock:
            start = self._cursor
        for step in range(total):
            index = (start - 1 + step) % total + 1
            with self._lock:  # claimed here, so concurrent makers (refill, acquires) never race for it
                if (index in self._in_use or index in self._making
                        or any(s.index == index for s in (*self._ready, *self._dying))):
                    continue
                self._making.add(index)
                self._cursor = index % total + 1
            try:
                slot = slots.create(Slot(self.prefix, index, self.pool), self.deny_extra, self.dns_ip,
                                    self.allow_extra, self.limits, self.dns_limits)
            except SlotError as exc:
                if "taken" in str(exc):
                    continue
                raise
            finally:
                with self._lock:
                    self._making.discard(index)
            try:
                subprocess.run(["sysctl", "-q", "-w", f"net.ipv4.conf.{slot.host_veth}.forwarding=1"],
                               check=True, capture_output=True, timeout=10)
                host_table.add_veth(self.prefix, slot.host_veth)
            except BaseException:
                slots.destroy(slot)
                raise
            self._host_firewall()
            return slot
        raise SlotError(f"no free slot left in {self.pool}")

    def _host_firewall(self) -> None:
        """The slots' accepts where the host's firewall would drop their forwarded traffic
        (vmm.net.host_firewall). A failure is logged, not raised: a host without that
        firewall needs nothing, and the next check tries again."""
        self._firewall_checked = time.monotonic()
        try:
            host_firewall.ensure(self.prefix, self.pool)
            self._firewall_error = ""
        except host_firewall.HostFirewallError as exc:
            if str(exc) != self._firewall_error:  # once per new error, not every check
                log.warning("could not keep the slots' accepts in the host firewall: %s", exc)
            self._firewall_error = str(exc)

    def _destroy(self, slot: Slot) -> None:
        try:
            host_table.remove_veth(self.prefix, slot.host_veth)
        except host_table.HostTableError:
            pass  # not in the set (never added, or the table was rebuilt)
        slots.destroy(slot)
        conntrack.forget(slot.address)  # its guest's flows leave the node's table with it

    def _refill_loop(self) -> None:
        while not self._stop.is_set():
            self._refill.wait(timeout=host_firewall.RECHECK)
            self._refill.clear()
            if not self._stop.is_set() and time.monotonic() - self._firewall_checked >= host_firewall.RECHECK:
                self._host_firewall()  # Docker recreates its chains when it restarts
            while not self._stop.is_set():
                with self._lock:
                    slot = self._dying[0] if self._dying else None
                if slot is None:
                    break
                try:
                    self._destroy(slot)
                except Exception:  # noqa: BLE001 - logged; node start removes what is left
                    log.exception("could not remove network slot %s", slot.netns)
                with self._lock:
                    self._dying.remove(slot)
            while not self._stop.is_set() and self.ready() < self.warm:
                try:
                    slot = self._make()
                except Exception:  # noqa: BLE001 - logged; the next acquire makes one itself
                    log.exception("could not make a warm network slot")
                    break
                with self._lock:
                    self._ready.append(slot)
