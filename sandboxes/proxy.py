"""The data plane: an ASGI app that streams SDK traffic to the right sandbox's envd.

Routing is by the ``E2b-Sandbox-Id`` / ``E2b-Sandbox-Port`` headers or by a
``{port}-{sandboxId}.{domain}`` host. Bodies stream in both directions without
buffering (Connect streams stay open for minutes), which is why this is a raw
ASGI app under uvicorn and not a Django view under daphne. "Sandbox gone" answers
are the 502s the E2B SDK matches on (spec §1.5, §4.6).

Note: the upstream client (httpx/httpcore) is half-duplex over HTTP/1.1 — it reads
the response after the request body is complete. The request body is still
forwarded chunk by chunk as it arrives; E2B clients are half-duplex too.
"""
import asyncio
import hmac
import json
import logging
import re
import time
from dataclasses import dataclass
from http.cookiejar import CookieJar, DefaultCookiePolicy

import httpx
from asgiref.sync import sync_to_async
from django.db import connections

log = logging.getLogger(__name__)

ENVD_PORT = 49983
CACHE_TTL = 1.0
CONNECT_TIMEOUT = 3.0

MSG_NOT_FOUND = "The sandbox was not found"
MSG_PORT_CLOSED = "The sandbox is running but port is not open"

HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"proxy-connection",
    b"te", b"trailer", b"trailers", b"transfer-encoding", b"upgrade", b"expect",
})
ROUTING_HEADERS = frozenset({b"e2b-sandbox-id", b"e2b-sandbox-port", b"host"})
# uvicorn writes its own; the upstream's would be duplicates.
RESPONSE_DROP = frozenset({b"date", b"server"})
# Sandbox states whose VM runs and whose envd takes traffic. "killing" is not one:
# a stream broken by a kill must probe as "was not found" (spec §4.6).
ROUTABLE_STATES = frozenset({"running", "snapshotting", "forking"})
PAUSED_STATES = frozenset({"pausing", "paused", "resuming"})

HOST_RE = re.compile(r"^(?P<port>\d{1,5})-(?P<id>[A-Za-z0-9_-]+)\.")


@dataclass(frozen=True)
class Route:
    sandbox_id: str
    state: str
    host: str
    port: int | None
    secure: bool
    token: str


def _lookup_sync(sandbox_id: str) -> Route | None:
    from sandboxes.models import Sandbox

    try:
        row = (Sandbox.objects.filter(pk=sandbox_id)
               .values_list("state", "envd_host", "envd_port", "secure", "envd_access_token").first())
    finally:
        # This runs on executor threads outside Django's request cycle: nothing else
        # would close (or drop a broken) connection.
        _close_unusable()
    if row is None:
        return None
    state, host, port, secure, token = row
    return Route(sandbox_id, state, host or "", port, bool(secure), token or "")


class RouteCache:
    """Routable sandboxes for ≤ CACHE_TTL seconds. Only *running* routes are cached,
    so a resumed or newly created sandbox is never hidden by a stale miss."""

    def __init__(self, ttl: float = CACHE_TTL, max_entries: int = 10000):
        self.ttl = ttl
        self.max_entries = max_entries
        self._entries: dict[str, tuple[float, Route]] = {}

    async def get(self, sandbox_id: str) -> Route | None:
        hit = self._entries.get(sandbox_id)
        now = time.monotonic()
        if hit and hit[0] > now:
            return hit[1]
        route = await sync_to_async(_lookup_sync, thread_sensitive=False)(sandbox_id)
        if route is not None and route.state in ROUTABLE_STATES and route.host and route.port:
            if len(self._entries) >= self.max_entries:
                self._entries = {k: v for k, v in self._entries.items() if v[0] > now}
            self._entries[sandbox_id] = (now + self.ttl, route)
        else:
            self._entries.pop(sandbox_id, None)
        return route

    def invalidate(self, sandbox_id: str) -> None:
        self._entries.pop(sandbox_id, None)


def _json_response(status: int, body: dict):
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    return status, headers, data


def not_found(sandbox_id: str):
    return _json_response(502, {"sandboxId": sandbox_id, "message": MSG_NOT_FOUND, "code": 502})


def port_closed(sandbox_id: str):
    return _json_response(502, {"sandboxId": sandbox_id, "message": MSG_PORT_CLOSED, "code": 502})


def parse_target(headers: dict[bytes, bytes]) -> tuple[str, int] | None:
    """(sandbox_id, port) from the routing headers, else from the Host, else None."""
    sandbox_id = headers.get(b"e2b-sandbox-id", b"").decode("latin-1").strip()
    if sandbox_id:
        port = headers.get(b"e2b-sandbox-port", b"").decode("latin-1").strip()
        return sandbox_id, int(port) if port.isdigit() else ENVD_PORT
    host = headers.get(b"host", b"").decode("latin-1").strip().lower()
    m = HOST_RE.match(host)
    if m:
        return m.group("id"), int(m.group("port"))
    return None


def needs_token(path: str, query: bytes) -> bool:
    """Secure sandboxes: every envd call needs X-Access-Token, except /health and
    signed /files URLs (envd verifies the signature itself)."""
    path = path.rstrip("/")
    if path.endswith("/health"):
        return False
    return not (path.endswith("/files") and re.search(rb"(^|&)signature=", query))


def _forward_headers(raw_headers) -> list[tuple[bytes, bytes]]:
    listed = set()
    for name, value in raw_headers:
        if name.lower() == b"connection":
            listed.update(t.strip().lower().encode() for t in value.decode("latin-1").split(","))
    return [(n, v) for n, v in raw_headers
            if n.lower() not in HOP_BY_HOP and n.lower() not in ROUTING_HEADERS and n.lower() not in listed]


def _response_headers(raw_headers) -> list[tuple[bytes, bytes]]:
    return [(n, v) for n, v in _forward_headers(raw_headers) if n.lower() not in RESPONSE_DROP]


def _has_body(headers: dict[bytes, bytes]) -> bool:
    if b"transfer-encoding" in headers:
        return True
    length = headers.get(b"content-length", b"0").strip()
    return length.isdigit() and int(length) > 0


class EnvdProxy:
    """ASGI app. One instance per process (it owns the upstream connection pool)."""

    def __init__(self, cache: RouteCache | None = None):
        self.cache = cache or RouteCache()
        self._client: httpx.AsyncClient | None = None
        # sandbox id → the auto-resume in progress, so concurrent requests join one.
        self._resuming: dict[str, asyncio.Future] = {}

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(connect=CONNECT_TIMEOUT, read=None, write=None, pool=CONNECT_TIMEOUT),
                limits=httpx.Limits(max_connections=4096, max_keepalive_connections=256, keepalive_expiry=30),
                follow_redirects=False,
                trust_env=False,
                # One client serves every sandbox and user: never keep their cookies.
                cookies=CookieJar(policy=DefaultCookiePolicy(allowed_domains=[])),
            )
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            await self.handle_http(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1003})

    async def _lifespan(self, receive, send):
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def handle_http(self, scope, receive, send):
        headers = {n.lower(): v for n, v in scope["headers"]}
        target = parse_target(headers)
        if target is None:
            return await _send_simple(send, *_json_response(400, {
                "code": 400,
                "message": "missing E2b-Sandbox-Id header (or a {port}-{sandboxId}.{domain} host)",
            }))
        sandbox_id, port = target
        route = await self.cache.get(sandbox_id)
        if route is not None and route.state in PAUSED_STATES:
            try:
                route = await self.on_paused(route)
            except ResumeFailed as exc:
                return await _send_simple(send, *_json_response(exc.status, {
                    "sandboxId": sandbox_id, "code": exc.status, "message": exc.message}))
        if route is None or route.state not in ROUTABLE_STATES or not route.host or not route.port:
            return await _send_simple(send, *not_found(sandbox_id))
        if port != ENVD_PORT:
            # Guest port forwarding arrives in a later issue.
            return await _send_simple(send, *port_closed(sandbox_id))
        query = scope.get("query_string", b"")
        if route.secure and needs_token(scope["path"], query):
            given = headers.get(b"x-access-token", b"")
            if not hmac.compare_digest(given, route.token.encode()):
                return await _send_simple(send, *_json_response(401, {
                    "code": 401,
                    "message": "missing or invalid X-Access-Token" if given else "missing X-Access-Token header",
                }))
        await self._forward(scope, receive, send, route, headers, query)

    async def on_paused(self, route: Route) -> Route | None:
        """Traffic for a paused (or pausing / resuming) sandbox. With ``autoResume`` it
        is resumed through the lifecycle service — the same transitions, events and node
        calls as a connect — and the running Route is returned so the request is served;
        concurrent requests join one resume. Without autoResume: None, answered with
        E2B's 502 'was not found'. A failed resume raises ResumeFailed."""
        pending = self._resuming.get(route.sandbox_id)
        if pending is None:
            pending = asyncio.ensure_future(self._auto_resume(route.sandbox_id))
            self._resuming[route.sandbox_id] = pending
            pending.add_done_callback(lambda _f, sid=route.sandbox_id: self._resuming.pop(sid, None))
        # shield: a client that goes away does not cancel the resume others wait for
        return await asyncio.shield(pending)

    async def _auto_resume(self, sandbox_id: str) -> Route | None:
        from sandboxes import services  # noqa: PLC0415 - Django must be set up first
        from sandboxes.errors import ApiError  # noqa: PLC0415

        try:
            sandbox = await services.auto_resume(sandbox_id)
        except ApiError as exc:
            log.info("auto-resume of %s failed: %s", sandbox_id, exc.detail)
            raise ResumeFailed(504 if exc.status_code == 504 else 502, f"auto-resume failed: {exc.detail}") from None
        finally:
            await sync_to_async(_close_unusable, thread_sensitive=True)()
        if sandbox is None:
            return None
        self.cache.invalidate(sandbox_id)
        return await self.cache.get(sandbox_id)

    async def _forward(self, scope, receive, send, route: Route, headers: dict, query: bytes):
        body_queue: asyncio.Queue = asyncio.Queue(maxsize=8)
        disconnected = asyncio.Event()
        pump = asyncio.create_task(_pump_request(receive, body_queue, disconnected))
        exchange = asyncio.create_task(self._exchange(scope, send, route, headers, query, body_queue))
        watch = asyncio.create_task(disconnected.wait())
        try:
            await asyncio.wait({exchange, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not exchange.done():
                exchange.cancel()  # client went away: closes the upstream stream too
            try:
                await exchange
            except asyncio.CancelledError:
                if not disconnected.is_set():
                    raise
        finally:
            for task in (pump, watch, exchange):
                task.cancel()
            await asyncio.gather(pump, watch, return_exceptions=True)

    async def _exchange(self, scope, send, route: Route, headers: dict, query: bytes, body_queue):
        async def body():
            while True:
                chunk = await body_queue.get()
                if chunk is None:
                    return
                yield chunk

        target = scope.get("raw_path") or scope["path"].encode()
        if query:
            target += b"?" + query
        url = httpx.URL(scheme="http", host=route.host, port=route.port, raw_path=target)
        request = httpx.Request(
            scope["method"], url, headers=_forward_headers(scope["headers"]),
            content=body() if _has_body(headers) else None,
            extensions={"timeout": self.client.timeout.as_dict()},
        )
        try:
            upstream = await self.client.send(request, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout,
                httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            log.info("upstream %s:%s of %s failed: %r", route.host, route.port, route.sandbox_id, exc)
            self.cache.invalidate(route.sandbox_id)
            current = await self.cache.get(route.sandbox_id)
            gone = current is None or current.state not in ROUTABLE_STATES
            return await _send_simple(send, *(not_found if gone else port_closed)(route.sandbox_id))
        try:
            await send({"type": "http.response.start", "status": upstream.status_code,
                        "headers": _response_headers(upstream.headers.raw)})
            async for chunk in upstream.aiter_raw():
                if chunk:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except httpx.HTTPError as exc:
            # The sandbox died mid-stream. Raising makes uvicorn drop the connection, so
            # the client sees a broken stream (and probes /health) instead of a clean end.
            self.cache.invalidate(route.sandbox_id)
            log.info("upstream of %s broke mid-response (%r); dropping the client connection", route.sandbox_id, exc)
            raise UpstreamBroken(f"upstream of {route.sandbox_id} broke mid-response: {exc!r}") from exc
        finally:
            await upstream.aclose()


class ResumeFailed(Exception):
    """Auto-resume of a paused sandbox failed; answered with ``status`` and ``message``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def _close_unusable() -> None:
    for conn in connections.all(initialized_only=True):
        conn.close_if_unusable_or_obsolete()


class UpstreamBroken(Exception):
    """The upstream stream failed after the response started; the client connection is dropped."""


async def _pump_request(receive, body_queue: asyncio.Queue, disconnected: asyncio.Event):
    """Moves ASGI request messages into the upstream body as they arrive, then keeps
    listening so a client disconnect is noticed while the response streams."""
    ended = False
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            disconnected.set()
            return
        if message["type"] == "http.request" and not ended:
            chunk = message.get("body", b"")
            if chunk:
                await body_queue.put(chunk)
            if not message.get("more_body", False):
                ended = True
                await body_queue.put(None)


async def _send_simple(send, status: int, headers, body: bytes):
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
