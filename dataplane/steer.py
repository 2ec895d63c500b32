"""Keeps the hot path's HAProxy equal to the database: which sandbox ports HAProxy may serve
itself (a server per port, ``<id>_<port>``, and its entry in ``PORTS_MAP``), at which guest
address, behind which traffic-token digest (``TOKENS_MAP``).

Why the database, and when: every state write goes through ``sandboxes.transitions`` in
whatever process made it (the API, the sweeper, a node's reconcile, the data plane's own
auto-resume), on any host, so the one truth every process shares is the database. Each
committed write nudges the data planes of its host (``sandboxes.route_nudge``: a datagram to
``NUDGE``'s socket in the run directory), and the steering reads the routable sandboxes again
at once (one query, ~1 ms): a sandbox paused or killed through this host's API is out of the
maps a few ms after its state write, normally well before its node has stopped the VM
(nothing waits for it: it is not guaranteed). The poll every
``interval`` (0.1 s) stays the fallback for writes made on other hosts (a node's reconcile)
or by processes that cannot reach the socket; until then HAProxy reaches the VM the data plane
would have reached a moment earlier: a pausing one still answers, a paused one does not (a
request in that window gets E2B's 502 "port is not open" after HAProxy's connect attempts
instead of an auto-resume). No tenant can reach another through it: a guest address is not
handed to another sandbox before the node has made (and warmed) every other slot of its pool
(``vmm.net.slot_pool``: slots are destroyed, never reused, and the index cursor goes round
the pool). The servers of a sandbox that left are put in maintenance, their streams shut
(as ``dataplane.watch`` breaks the data plane's own) and deleted.

Order of writes, so that no request ever finds a port without its sandbox's token: a token
entry is written in the round that publishes its sandbox, before any of its ports can be
added (``ensure_port``, only for published sandboxes); ports go out before tokens.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import socket
from dataclasses import dataclass

from asgiref.sync import sync_to_async

from dataplane.haproxy_admin import SAFE, Admin, AdminError
from dataplane.hotpath_config import GUEST_BACKEND, PORTS_MAP, TOKENS_MAP
from dataplane.routes import close_unusable
from sandboxes.route_nudge import SOCKET_NAME as NUDGE
from sandboxes.states import ROUTABLE

log = logging.getLogger(__name__)

INTERVAL = 0.1


@dataclass(frozen=True)
class Entry:
    """What HAProxy knows of one sandbox: its guest address, its token's digest ("" = public),
    and the VM generation both came from (``dataplane.handoff`` compares it)."""

    address: str
    token_digest: str
    generation: int


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest() if token else ""


def _servable(sandbox_id: str, guest_host: str, network) -> bool:
    """Whether HAProxy can serve this sandbox's user ports as the data plane would: a guest
    address, no ``maskRequestHost`` (the data plane rewrites the Host), ids and addresses it
    can carry."""
    mask = network.get("maskRequestHost") if isinstance(network, dict) else None
    return bool(guest_host) and not mask and bool(SAFE.fullmatch(sandbox_id)) and bool(SAFE.fullmatch(guest_host))


def read_entries() -> dict[str, Entry]:
    """Every sandbox HAProxy may serve now, from the database (one query)."""
    from sandboxes.models import Sandbox  # noqa: PLC0415 - Django must be set up first

    try:
        rows = list(Sandbox.objects.filter(state__in=ROUTABLE).exclude(guest_host="").values_list(
            "id", "guest_host", "traffic_access_token", "network", "vm_generation"))
    finally:
        close_unusable()
    return {sid: Entry(host, token_digest(token or ""), generation or 0)
            for sid, host, token, network, generation in rows if _servable(sid, host, network)}


class Steer:
    """Pushes the database's entries into HAProxy every ``interval`` s (``run``), or once
    (``sync``); adds a sandbox port's server when the data plane is about to hand a
    connection for it to HAProxy (``ensure_port``)."""

    def __init__(self, admin: Admin, maps_dir: str, interval: float = INTERVAL, read=None):
        self.admin, self.interval = admin, interval
        self.ports_map, self.tokens_map = f"{maps_dir}/{PORTS_MAP}", f"{maps_dir}/{TOKENS_MAP}"
        self._read = read or sync_to_async(read_entries, thread_sensitive=False)
        self.pushed: dict[str, Entry] | None = None  # None: HAProxy's maps are unknown (clear them first)
        self.servers: dict[str, tuple[str, str]] = {}  # server name → (sandbox id, address)
        self.doomed: set[str] = set()  # servers taken out whose deletion HAProxy has not done yet
        self._lock = asyncio.Lock()  # one writer at a time: the order of writes is the safety
        self.nudge_path = f"{maps_dir}/{NUDGE}"
        self._nudged = asyncio.Event()  # a state write was announced: read the database now
        self._nudges: socket.socket | None = None

    def published(self, sandbox_id: str, address: str, generation: int, port: int | None = None) -> bool:
        """Whether HAProxy serves this sandbox (and ``port`` of it) at this address and VM generation now."""
        entry = (self.pushed or {}).get(sandbox_id)
        if entry is None or entry.address != address or entry.generation != generation:
            return False
        return port is None or self.servers.get(server_name(sandbox_id, port)) == (sandbox_id, address)

    async def ensure_port(self, sandbox_id: str, address: str, generation: int, port: int) -> bool:
        """Makes HAProxy able to serve ``port`` of the sandbox (its server, then its map
        entry), if the sandbox is published at this address and generation. True when it can."""
        name = server_name(sandbox_id, port)
        if self.published(sandbox_id, address, generation, port):
            return True
        async with self._lock:
            if not self.published(sandbox_id, address, generation) or name in self.servers or name in self.doomed:
                return self.published(sandbox_id, address, generation, port)
            try:
                await self.admin.run(*self.admin.add_server(GUEST_BACKEND, name, address, port))
                self.servers[name] = (sandbox_id, address)
                await self.admin.run(self.admin.set_entry(self.ports_map, name, address, known=False))
            except AdminError as exc:
                log.info("hot path: could not add %s: %r", name, exc)
                return False
        return True

    async def sync(self) -> None:
        want = await self._read()
        async with self._lock:
            await self._sync(want)

    async def _sync(self, want: dict[str, Entry]) -> None:
        have = self.pushed
        if have is None:
            await self.admin.run(self.admin.clear(self.ports_map), self.admin.clear(self.tokens_map))
            self.doomed |= set(self.servers)
            self.servers = {}
            have = {}
        gone = {sid: e for sid, e in have.items() if want.get(sid) != e}
        if gone:
            # out first: no handoff trusts them, no request finds their ports, their servers
            # (and so the streams HAProxy relays to them) are shut, then their tokens go
            self.pushed = {sid: e for sid, e in have.items() if sid not in gone}
            names = [n for n, (sid, _) in self.servers.items() if sid in gone]
            if names:
                await self.admin.run(*(self.admin.del_entry(self.ports_map, n) for n in names))
                for n in names:
                    del self.servers[n]
                self.doomed |= set(names)
            tokens = [self.admin.del_entry(self.tokens_map, sid) for sid, e in gone.items() if e.token_digest]
            if tokens:
                await self.admin.run(*tokens)
        await self._delete_doomed()
        adding = [self.admin.set_entry(self.tokens_map, sid, e.token_digest, known=False)
                  for sid, e in want.items() if e.token_digest and have.get(sid) != e]
        if adding:
            await self.admin.run(*adding)
        self.pushed = want

    async def _delete_doomed(self) -> None:
        for name in sorted(self.doomed):
            try:
                await self.admin.run(*self.admin.drop_server(GUEST_BACKEND, name))
            except AdminError as exc:  # busy still: the next round tries again
                if "No such server" in str(exc):
                    self.doomed.discard(name)
                else:
                    log.info("hot path: %s not deleted yet: %r", name, exc)
                continue
            self.doomed.discard(name)

    async def fail_closed(self) -> None:
        """The database or HAProxy could not be read: empty maps (everything goes to the data
        plane, which judges every request itself) rather than entries nobody can vouch for."""
        self.pushed = None  # unknown: the next round starts from clear maps
        try:
            async with self._lock:
                await self.admin.run(self.admin.clear(self.ports_map), self.admin.clear(self.tokens_map))
                self.doomed |= set(self.servers)
                self.servers = {}
                self.pushed = {}
        except AdminError:
            pass

    async def run(self) -> None:
        """Syncs every ``interval`` s, and at once when a state write is announced."""
        self._listen()
        try:
            while True:
                self._nudged.clear()  # a nudge during this round brings the next one at once
                try:
                    await self.sync()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - a hiccup must not end the steering
                    log.warning("hot path: could not update HAProxy's maps: %r", exc)
                    await self.fail_closed()
                try:
                    await asyncio.wait_for(self._nudged.wait(), self.interval)
                except asyncio.TimeoutError:
                    pass
        finally:
            self._stop_listening()

    def _listen(self) -> None:
        """Binds ``nudge_path`` (``sandboxes.route_nudge`` writes to it); without it, the poll."""
        try:
            if os.path.exists(self.nudge_path):
                os.unlink(self.nudge_path)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sock.setblocking(False)
            sock.bind(self.nudge_path)
            asyncio.get_running_loop().add_reader(sock.fileno(), self._on_nudge)
        except (OSError, RuntimeError, ValueError) as exc:
            log.info("hot path: no nudges (%r); polling every %s s", exc, self.interval)
            return
        self._nudges = sock

    def _on_nudge(self) -> None:
        while True:  # drain: one read of the database answers every nudge so far
            try:
                self._nudges.recv(256)
            except BlockingIOError:
                break
            except OSError:
                break
        self._nudged.set()

    def _stop_listening(self) -> None:
        if self._nudges is None:
            return
        try:
            asyncio.get_running_loop().remove_reader(self._nudges.fileno())
        except (RuntimeError, ValueError):
            pass
        self._nudges.close()
        self._nudges = None
        try:
            os.unlink(self.nudge_path)
        except OSError:
            pass


def server_name(sandbox_id: str, port: int) -> str:
    """HAProxy's server for one port of one sandbox (ids have no '/'; the port is last)."""
    return f"{sandbox_id}_{port}"
