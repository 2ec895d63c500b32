"""Upstream connection pools of the data plane, one per sandbox and VM generation.

Why: a keep-alive connection belongs to one VM process. After a pause, resume, fork
or restore the sandbox's envd is a new process (maybe at the same address, or its old
address now serves someone else), so a connection pooled before must never carry a
request after. A pool serves exactly one (sandbox, generation, host, port); when a
sandbox's route moves on, its old pool is closed and never used again.
"""
import asyncio
import time
from http.cookiejar import CookieJar, DefaultCookiePolicy

import httpx

# A pool nobody used for this long is closed (its connections would have expired too).
IDLE_SECONDS = 60.0


def _new_client(connect_timeout: float) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        timeout=httpx.Timeout(connect=connect_timeout, read=None, write=None, pool=connect_timeout),
        limits=httpx.Limits(max_connections=256, max_keepalive_connections=16, keepalive_expiry=30),
        follow_redirects=False,
        trust_env=False,
        # One client serves many users of a sandbox: never keep their cookies.
        cookies=CookieJar(policy=DefaultCookiePolicy(allowed_domains=[])),
    )


class _Pool:
    __slots__ = ("key", "client", "active", "last_used")

    def __init__(self, key, client):
        self.key, self.client, self.active, self.last_used = key, client, 0, time.monotonic()


class UpstreamPools:
    """``async with pools.use(sandbox_id, key) as client`` lends the pool of that VM
    generation; a different ``key`` for the same sandbox retires the old pool first."""

    def __init__(self, connect_timeout: float):
        self.connect_timeout = connect_timeout
        self._pools: dict[str, _Pool] = {}
        self._closing: set[asyncio.Task] = set()
        self._last_sweep = time.monotonic()

    def __len__(self) -> int:
        return len(self._pools)

    def key_of(self, sandbox_id: str):
        pool = self._pools.get(sandbox_id)
        return pool.key if pool else None

    def use(self, sandbox_id: str, key) -> "_Lease":
        self._sweep()
        pool = self._pools.get(sandbox_id)
        if pool is None or pool.key != key:
            if pool is not None:
                self._retire(sandbox_id)
            pool = self._pools[sandbox_id] = _Pool(key, _new_client(self.connect_timeout))
        return _Lease(pool)

    def forget(self, sandbox_id: str) -> None:
        """The sandbox has no route any more (killed, paused): close its pool."""
        if sandbox_id in self._pools:
            self._retire(sandbox_id)

    def _retire(self, sandbox_id: str) -> None:
        pool = self._pools.pop(sandbox_id)
        task = asyncio.ensure_future(pool.client.aclose())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _sweep(self) -> None:
        now = time.monotonic()
        if now - self._last_sweep < IDLE_SECONDS / 4:
            return
        self._last_sweep = now
        for sandbox_id, pool in list(self._pools.items()):
            if pool.active == 0 and now - pool.last_used > IDLE_SECONDS:
                self._retire(sandbox_id)

    async def aclose(self) -> None:
        for sandbox_id in list(self._pools):
            self._retire(sandbox_id)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)


class _Lease:
    def __init__(self, pool: _Pool):
        self.pool = pool

    async def __aenter__(self) -> httpx.AsyncClient:
        self.pool.active += 1
        return self.pool.client

    async def __aexit__(self, *exc) -> None:
        self.pool.active -= 1
        self.pool.last_used = time.monotonic()
