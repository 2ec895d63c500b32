"""Upstream connection pools of the data plane, one per sandbox and VM generation.

Why: a keep-alive connection belongs to one VM process. After a pause, resume, fork
or restore the sandbox's envd is a new process (maybe at the same address, or its old
address now serves someone else), so a connection pooled before must never carry a
request after. A pool serves exactly one (sandbox, generation, host, port); when a
sandbox's route moves on, its old pool is closed and never used again.
"""
import asyncio
import functools
import ssl
import time
from collections import OrderedDict

import httpx

# A lane (or pool) nobody used for this long is closed (its connections would have expired too).
IDLE_SECONDS = 60.0
# How often idle lanes are looked for, by a timer of their own while any pool exists. Why a
# timer: httpcore closes a connection past its keep-alive expiry only when its pool is used
# again, and a guest that was killed sends no FIN or RST; swept only on a request, the last
# pools of a quiet data plane held their connections (and descriptors) for ever (soak, eighth
# run: +22 descriptors after the load ended).
SWEEP_SECONDS = IDLE_SECONDS / 4
# Lanes per sandbox (one per client connection); at most this many idle connections each.
MAX_LANES = 64


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """One for every pool: httpx builds (and loads the CA store into) a context per
    transport otherwise, tens of ms per new sandbox generation. Upstreams are plain HTTP."""
    return ssl.create_default_context()


class Connections:
    """A pool's connections: httpx's transport, without the client around it. Why: the
    client's per-request layers (auth, redirects, cookie jar, event hooks) do nothing here
    (the data plane follows no redirect and keeps no guest's cookies: a transport has no
    cookie jar) yet cost CPU on every request (bench/dataplane.py)."""

    def __init__(self, connect_timeout: float):
        self.timeout = httpx.Timeout(connect=connect_timeout, read=None, write=None, pool=connect_timeout)
        self.transport = httpx.AsyncHTTPTransport(
            verify=_tls_context(), trust_env=False, retries=0,
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=4, keepalive_expiry=30))

    async def send(self, request: httpx.Request) -> httpx.Response:
        """The response to ``request`` once its head is in; the body is read as it streams."""
        request.extensions = {**request.extensions, "timeout": self.timeout.as_dict()}
        response = await self.transport.handle_async_request(request)
        response.request = request
        return response

    async def aclose(self) -> None:
        await self.transport.aclose()


class _Lane:
    """The connections of one client connection's requests (see ``UpstreamPools``)."""

    __slots__ = ("upstream", "active", "last_used")

    def __init__(self, upstream: Connections):
        self.upstream, self.active, self.last_used = upstream, 0, time.monotonic()


class _Pool:
    __slots__ = ("key", "lanes")

    def __init__(self, key):
        self.key, self.lanes = key, OrderedDict()  # lane → _Lane, least recently used first

    @property
    def active(self) -> int:
        return sum(lane.active for lane in self.lanes.values())


class UpstreamPools:
    """``async with pools.use(sandbox_id, key, lane) as upstream`` lends the connections of
    that VM generation; a different ``key`` for the same sandbox retires the old pool first.

    Each pool is split into lanes, one per client connection (``lane``: the client's
    address and port), up to ``MAX_LANES`` per sandbox (the least recently used idle one
    is closed for a new one). Why: httpcore checks every idle connection of a pool (a
    poll each) on every request and on every response's end, and closes idle ones past its
    keep-alive limit however many are busy; one pool for 64 clients costs more per
    request than the exchange, and churns connections. A lane usually holds one
    connection, kept alive as long as its client's (a relay, request after request)."""

    def __init__(self, connect_timeout: float):
        self.connect_timeout = connect_timeout
        self._pools: dict[str, _Pool] = {}
        self._closing: set[asyncio.Task] = set()
        self._sweeper: asyncio.Task | None = None

    def __len__(self) -> int:
        return len(self._pools)

    def key_of(self, sandbox_id: str):
        pool = self._pools.get(sandbox_id)
        return pool.key if pool else None

    def use(self, sandbox_id: str, key, lane=None) -> "_Lease":
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.ensure_future(self._sweep_while_pooled())
        pool = self._pools.get(sandbox_id)
        if pool is None or pool.key != key:
            if pool is not None:
                self._retire(sandbox_id)
            pool = self._pools[sandbox_id] = _Pool(key)
        found = pool.lanes.get(lane)
        if found is None:
            if len(pool.lanes) >= MAX_LANES:
                idle = next((k for k, v in pool.lanes.items() if v.active == 0), None)
                if idle is None:  # every lane busy: share the oldest rather than grow
                    lane = next(iter(pool.lanes))
                else:
                    self._close(pool.lanes.pop(idle).upstream)
            found = pool.lanes.get(lane)
            if found is None:
                found = pool.lanes[lane] = _Lane(Connections(self.connect_timeout))
        pool.lanes.move_to_end(lane)
        return _Lease(found)

    def forget(self, sandbox_id: str) -> None:
        """The sandbox has no route any more (killed, paused): close its pool."""
        if sandbox_id in self._pools:
            self._retire(sandbox_id)

    def _retire(self, sandbox_id: str) -> None:
        for lane in self._pools.pop(sandbox_id).lanes.values():
            self._close(lane.upstream)

    def _close(self, upstream: Connections) -> None:
        task = asyncio.ensure_future(upstream.aclose())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _sweep_while_pooled(self) -> None:
        while self._pools:
            await asyncio.sleep(SWEEP_SECONDS)
            self._sweep()

    def _sweep(self) -> None:
        """Close every lane idle for ``IDLE_SECONDS``, and a pool left without lanes."""
        now = time.monotonic()
        for sandbox_id, pool in list(self._pools.items()):
            for name, lane in list(pool.lanes.items()):
                if lane.active == 0 and now - lane.last_used > IDLE_SECONDS:
                    self._close(pool.lanes.pop(name).upstream)
            if not pool.lanes:
                del self._pools[sandbox_id]

    async def aclose(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        for sandbox_id in list(self._pools):
            self._retire(sandbox_id)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)


class _Lease:
    def __init__(self, lane: _Lane):
        self.lane = lane

    async def __aenter__(self) -> Connections:
        self.lane.active += 1
        return self.lane.upstream

    async def __aexit__(self, *exc) -> None:
        self.lane.active -= 1
        self.lane.last_used = time.monotonic()
