"""Keeps the hot path's HAProxy equal to the database: which sandbox ports HAProxy may serve
itself (a server per port, ``<id>_<port>.<serial>``, named by its entry in ``PORTS_MAP``), at which guest
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
(as ``dataplane.watch`` breaks the data plane's own), and deleted only once HAProxy shows no
connection to them (``_collect``): a server is never freed while a client's session may still
hold an idle connection to it, and every route gets a server of its own name
(``<id>_<port>.<serial>``), so a sandbox back at once never waits for its old server
(``dataplane.hotpath_config``, above its timeouts, says why).

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
import time
from dataclasses import dataclass

from asgiref.sync import sync_to_async

from dataplane.haproxy_admin import SAFE, Admin, AdminError
from dataplane.hotpath_config import GUEST_BACKEND, PORTS_MAP, TOKENS_MAP
from dataplane.routes import close_unusable
from sandboxes.route_nudge import SOCKET_NAME as NUDGE
from sandboxes.states import ROUTABLE

log = logging.getLogger(__name__)

INTERVAL = 0.1
# How often the retired servers' connections are looked for (``show fd``, a line per
# descriptor); a server is deleted after two looks in a row found none.
RETIRED_CHECK = 0.5
# Retired servers waiting for their last connection beyond this many: said in the log (each is
# a few kB of HAProxy's memory; they wait for their clients' sessions, or for TCP keep-alive to
# find a stopped VM's connection dead).
RETIRED_WARN = 1000


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
        # route key "<id>_<port>" → (sandbox id, address, its server's name)
        self.servers: dict[str, tuple[str, str, str]] = {}
        # servers taken out, not deleted yet → whether in maintenance, and unconnected so far
        self.retired: dict[str, Retired] = {}
        self._serial = 0  # the last server name's suffix: names are never used twice
        self._checked_at = 0.0
        self._lock = asyncio.Lock()  # one writer at a time: the order of writes is the safety
        self.nudge_path = f"{maps_dir}/{NUDGE}"
        self._nudged = asyncio.Event()  # a state write was announced: read the database now
        self._nudges: socket.socket | None = None

    def published(self, sandbox_id: str, address: str, generation: int, port: int | None = None) -> bool:
        """Whether HAProxy serves this sandbox (and ``port`` of it) at this address and VM generation now."""
        entry = (self.pushed or {}).get(sandbox_id)
        if entry is None or entry.address != address or entry.generation != generation:
            return False
        return port is None or self.servers.get(route_key(sandbox_id, port), ())[:2] == (sandbox_id, address)

    async def ensure_port(self, sandbox_id: str, address: str, generation: int, port: int) -> bool:
        """Makes HAProxy able to serve ``port`` of the sandbox (its server, then its map
        entry), if the sandbox is published at this address and generation. True when it can."""
        key = route_key(sandbox_id, port)
        if self.published(sandbox_id, address, generation, port):
            return True
        async with self._lock:
            if not self.published(sandbox_id, address, generation) or key in self.servers:
                return self.published(sandbox_id, address, generation, port)
            self._serial += 1
            name = f"{key}.{self._serial}"
            try:
                await self.admin.run(*self.admin.add_server(GUEST_BACKEND, name, address, port))
                self.servers[key] = (sandbox_id, address, name)
                await self.admin.run(self.admin.set_entry(self.ports_map, key, name, known=False))
            except AdminError as exc:
                log.info("hot path: could not add %s: %r", name, exc)
                self.servers.pop(key, None)
                self.retired[name] = Retired()  # maybe added: taken out as any other
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
            self._retire(self.servers)
            have = {}
        gone = {sid: e for sid, e in have.items() if want.get(sid) != e}
        if gone:
            # out first: no handoff trusts them, no request finds their ports, their servers
            # (and so the streams HAProxy relays to them) are shut, then their tokens go
            self.pushed = {sid: e for sid, e in have.items() if sid not in gone}
            keys = [k for k, (sid, _, _) in self.servers.items() if sid in gone]
            if keys:
                await self.admin.run(*(self.admin.del_entry(self.ports_map, k) for k in keys))
                self._retire(keys)
            tokens = [self.admin.del_entry(self.tokens_map, sid) for sid, e in gone.items() if e.token_digest]
            if tokens:
                await self.admin.run(*tokens)
        await self._collect()
        adding = [self.admin.set_entry(self.tokens_map, sid, e.token_digest, known=False)
                  for sid, e in want.items() if e.token_digest and have.get(sid) != e]
        if adding:
            await self.admin.run(*adding)
        self.pushed = want

    def _retire(self, keys) -> None:
        """These routes' servers leave ``servers`` for ``retired`` (``_collect`` does the rest)."""
        for key in list(keys):
            _, _, name = self.servers.pop(key)
            self.retired[name] = Retired()

    async def _collect(self, now: float | None = None) -> None:
        """Retired servers: put in maintenance and their streams shut at once; deleted once two
        looks at HAProxy's descriptors, ``RETIRED_CHECK`` s apart, found no connection to them
        (none can appear meanwhile: in maintenance and out of ``PORTS_MAP``, nothing picks them)."""
        for name, state in sorted(self.retired.items()):
            if state.maint:
                continue
            try:
                await self.admin.run(*self.admin.retire_server(GUEST_BACKEND, name))
            except AdminError as exc:
                if "No such server" in str(exc):
                    del self.retired[name]
                else:  # the next round tries again
                    log.info("hot path: %s not retired yet: %r", name, exc)
                continue
            state.maint = True
        now = time.monotonic() if now is None else now
        waiting = [name for name, state in self.retired.items() if state.maint]
        if not waiting or now - self._checked_at < RETIRED_CHECK:
            return
        self._checked_at = now
        connected = await self.admin.connected_servers(GUEST_BACKEND)
        for name in sorted(waiting):
            state = self.retired[name]
            if name in connected:
                state.unconnected = 0
                continue
            state.unconnected += 1
            if state.unconnected < 2:
                continue
            try:
                await self.admin.run(self.admin.del_server(GUEST_BACKEND, name))
            except AdminError as exc:
                if "No such server" not in str(exc):  # busy still: the next look tries again
                    log.info("hot path: %s not deleted yet: %r", name, exc)
                    continue
            del self.retired[name]
        if len(self.retired) > RETIRED_WARN:
            log.warning("hot path: %d retired servers still have connections", len(self.retired))

    async def fail_closed(self) -> None:
        """The database or HAProxy could not be read: empty maps (everything goes to the data
        plane, which judges every request itself) rather than entries nobody can vouch for."""
        self.pushed = None  # unknown: the next round starts from clear maps
        try:
            async with self._lock:
                await self.admin.run(self.admin.clear(self.ports_map), self.admin.clear(self.tokens_map))
                self._retire(self.servers)
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


def route_key(sandbox_id: str, port: int) -> str:
    """One port of one sandbox in ``PORTS_MAP`` (ids have no '/'; the port is last); its
    server's name is this and a serial."""
    return f"{sandbox_id}_{port}"


@dataclass
class Retired:
    maint: bool = False  # in maintenance, its streams shut
    unconnected: int = 0  # looks in a row that found no connection to it
