"""Which sandbox signed a ``/files`` URL that names none, at a bounded cost.

Why: with ``E2B_SANDBOX_URL`` the SDK's signed file URLs are
``{E2B_SANDBOX_URL}/files?path=…&signature=…``: no sandbox id in the URL or its headers (a
browser or curl fetches them as they are), and E2B's signature format cannot carry one.
The signature is a SHA-256 over the path, operation, user, expiration and the sandbox's
envd token, so it names exactly one sandbox — found only by hashing with each secured
sandbox's token in turn. Unbounded, every request with a made-up signature would cost a
database read of every secured token and one hash per secured sandbox, on the event loop.

So, per request: a signature seen before goes straight to its sandbox (one hash, verified
against the token the database has now); anything else is hashed against an in-memory
list of secured tokens (read from the database at most once per ``REFRESH`` s, one read
shared by all waiting requests), in a worker thread, and only while a process-wide budget
of hashes per second (``AENV_SIGNED_URL_SCAN_RATE``) lasts: past it, 429 until it refills.
A signature that no listed token made waits for the next read (a sandbox created since
the list was read) and is tried against the new tokens only. A flood of random signatures
thus costs O(1) per request beyond a fixed number of hashes per second, and at most a
few database reads per second. A URL that names its sandbox (its ``{port}-{id}`` host, the
``E2b-Sandbox-Id`` header) never comes here.
"""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict

from asgiref.sync import sync_to_async
from django.conf import settings

from dataplane.access import SignedFile
from dataplane.answers import Refused, json_response
from dataplane.routes import RouteTable, close_unusable
from sandboxes.states import RESUMABLE, ROUTABLE

# Sandboxes a signed file URL without a sandbox id may reach.
SIGNED_REACHABLE = ROUTABLE | RESUMABLE

MSG_BUSY = ("too many signed file URLs that name no sandbox: retry shortly, or address the sandbox "
            "(its {port}-{sandboxId} host or the E2b-Sandbox-Id header)")


def _secured_tokens_sync() -> dict[str, str]:
    """id → envd token of every secured sandbox a signed URL may reach (routable, or
    paused and maybe auto-resumable)."""
    from sandboxes.models import Sandbox

    try:
        return dict(Sandbox.objects.filter(secure=True, state__in=SIGNED_REACHABLE)
                    .exclude(envd_access_token="").values_list("id", "envd_access_token"))
    finally:
        close_unusable()


def _first_signer(signed: SignedFile, tokens: dict[str, str]) -> str | None:
    """The id of the sandbox among ``tokens`` whose token made ``signed``'s signature."""
    return next((sandbox_id for sandbox_id, token in tokens.items() if signed.signed_by(token)), None)


class HashBudget:
    """A token bucket of hashes: ``rate`` per second, at most ``rate`` saved up. A scan may
    take the bucket below zero (one larger than a second's worth still runs, once it is
    full), so the long-run cost stays ``rate`` hashes per second."""

    def __init__(self, rate: float):
        self.rate = float(rate)
        self._tokens = self.rate
        self._at = time.monotonic()

    def take(self, cost: int) -> bool:
        now = time.monotonic()
        self._tokens = min(self.rate, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens <= 0:
            return False
        self._tokens -= cost
        return True


class SignerLookup:
    """``await lookup.signer(signed)``: the id of the sandbox whose envd token made a signed
    URL's signature, or None. Raises Refused (429) when the hash budget is spent."""

    HINTS = 4096  # signatures remembered with their sandbox
    REFRESH = 0.5  # s between two reads of the secured tokens

    def __init__(self, routes: RouteTable, rate: float | None = None):
        self.routes = routes
        self.budget = HashBudget(settings.AENV_SIGNED_URL_SCAN_RATE if rate is None else rate)
        # A hint only: every use is verified against that sandbox's token as the database has it now.
        self._hints: OrderedDict[str, str] = OrderedDict()
        self._tokens: dict[str, str] = {}
        self._read_at = float("-inf")  # loop time the last read started
        self._reading: asyncio.Future | None = None

    async def signer(self, signed: SignedFile) -> str | None:
        hint = self._hints.get(signed.signature)
        if hint is not None:
            if await self._verified(hint, signed):
                self._hints.move_to_end(signed.signature)
                return hint
            self._hints.pop(signed.signature, None)
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        tokens = await self._tokens_read_since(arrived - self.REFRESH)
        match = await self._scan(signed, tokens)
        if match is None:
            newer = await self._tokens_read_since(arrived)
            match = await self._scan(signed, {i: t for i, t in newer.items() if tokens.get(i) != t})
        if match is None or not await self._verified(match, signed):
            return None
        self._hints[signed.signature] = match
        while len(self._hints) > self.HINTS:
            self._hints.popitem(last=False)
        return match

    async def _verified(self, sandbox_id: str, signed: SignedFile) -> bool:
        route = await self.routes.get(sandbox_id)
        return bool(route is not None and route.secure and route.state in SIGNED_REACHABLE and route.token
                    and signed.signed_by(route.token))

    async def _scan(self, signed: SignedFile, tokens: dict[str, str]) -> str | None:
        if not tokens:
            return None
        if not self.budget.take(len(tokens)):
            status, headers, body = json_response(429, {"code": 429, "message": MSG_BUSY})
            raise Refused(answer=(status, [*headers, (b"retry-after", b"1")], body))
        return await asyncio.to_thread(_first_signer, signed, tokens)

    async def _tokens_read_since(self, since: float) -> dict[str, str]:
        """The secured tokens from a database read that started at or after ``since`` (loop
        time): one read at a time, at most one per REFRESH s, shared by all who wait."""
        loop = asyncio.get_running_loop()
        while self._read_at < since:
            if self._reading is None:
                self._reading = asyncio.ensure_future(self._read(max(0.0, self._read_at + self.REFRESH - loop.time())))
            await asyncio.shield(self._reading)
        return self._tokens

    async def _read(self, delay: float) -> None:
        try:
            if delay:
                await asyncio.sleep(delay)
            started = asyncio.get_running_loop().time()
            self._tokens = await sync_to_async(_secured_tokens_sync, thread_sensitive=False)()
            self._read_at = started
        finally:
            self._reading = None
