"""The data plane: an ASGI app that streams SDK traffic to the right sandbox's envd.

Routing is by the ``E2b-Sandbox-Id`` / ``E2b-Sandbox-Port`` headers or by a
``{port}-{sandboxId}.{domain}`` host. Bodies stream in both directions without
buffering (Connect streams stay open for minutes), which is why this is a raw
ASGI app under uvicorn and not a Django view under daphne. "Sandbox gone" answers
are the 502s the E2B SDK matches on (spec §1.5, §4.6).

Routes are read from the database on every request, never from a cache: a pause,
resume or kill changes the VM process behind a sandbox, and a route (or a pooled
connection) from before it would reach a process that is gone or, worse, whatever
now listens at its address. Upstream connections are pooled per sandbox and VM
generation (``sandboxes.proxy_pools``) for the same reason.

Note: the upstream client (httpx/httpcore) is half-duplex over HTTP/1.1 — it reads
the response after the request body is complete. The request body is still
forwarded chunk by chunk as it arrives; E2B clients are half-duplex too.
"""
import asyncio
import hmac
import json
import logging
import re
from dataclasses import dataclass

import httpx
from asgiref.sync import sync_to_async
from django.db import connections

from envd import ENVD_PORT

from .proxy_pools import UpstreamPools
from .states import RESUMABLE, ROUTABLE

log = logging.getLogger(__name__)

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

HOST_RE = re.compile(r"^(?P<port>\d{1,5})-(?P<id>[A-Za-z0-9_-]+)\.")


@dataclass(frozen=True)
class Route:
    sandbox_id: str
    state: str
    host: str
    port: int | None
    secure: bool
    token: str
    generation: int = 0

    @property
    def routable(self) -> bool:
        return self.state in ROUTABLE and bool(self.host) and bool(self.port)

    @property
    def upstream(self) -> tuple[int, str, int | None]:
        """What identifies the VM process behind the route (and so its connections)."""
        return self.generation, self.host, self.port


def _lookup_sync(sandbox_id: str) -> Route | None:
    from sandboxes.models import Sandbox

    try:
        row = (Sandbox.objects.filter(pk=sandbox_id)
               .values_list("state", "envd_host", "envd_port", "secure", "envd_access_token", "vm_generation")
               .first())
    finally:
        # This runs on executor threads outside Django's request cycle: nothing else
        # would close (or drop a broken) connection.
        _close_unusable()
    if row is None:
        return None
    state, host, port, secure, token, generation = row
    return Route(sandbox_id, state, host or "", port, bool(secure), token or "", generation or 0)


class RouteTable:
    """The current route of a sandbox, read from the database each time it is asked."""

    async def get(self, sandbox_id: str) -> Route | None:
        return await sync_to_async(_lookup_sync, thread_sensitive=False)(sandbox_id)


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
    """ASGI app. One instance per process (it owns the upstream connection pools)."""

    def __init__(self, routes: RouteTable | None = None):
        self.routes = routes or RouteTable()
        self.pools = UpstreamPools(CONNECT_TIMEOUT)
        # sandbox id → the auto-resume in progress, so concurrent requests join one.
        self._resuming: dict[str, asyncio.Future] = {}

    async def aclose(self) -> None:
        await self.pools.aclose()

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
        try:
            route = await self.current_route(sandbox_id)
        except ResumeFailed as exc:
            return await _send_simple(send, *exc.response(sandbox_id))
        if route is None:
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

    async def current_route(self, sandbox_id: str) -> Route | None:
        """The sandbox's route as the database has it now; a paused one with autoResume
        is resumed first (see ``on_paused``). None: nothing to route to (the caller
        answers 'was not found'). Raises ResumeFailed."""
        route = await self.routes.get(sandbox_id)
        if route is not None and route.state in RESUMABLE:
            route = await self.on_paused(route)
        if route is None or not route.routable:
            self.pools.forget(sandbox_id)
            return None
        return route

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
        from sandboxes.lifecycle import pause  # noqa: PLC0415 - Django must be set up first
        from sandboxes.lifecycle.errors import LifecycleError, Timeout  # noqa: PLC0415

        try:
            sandbox = await pause.auto_resume(sandbox_id)
        except LifecycleError as exc:
            log.info("auto-resume of %s failed: %s", sandbox_id, exc.message)
            raise ResumeFailed(504 if isinstance(exc, Timeout) else 502, f"auto-resume failed: {exc.message}") from None
        finally:
            await sync_to_async(_close_unusable, thread_sensitive=True)()
        if sandbox is None:
            return None
        return await self.routes.get(sandbox_id)

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
        # A refused connection sent nothing, so it is retried once if the sandbox's route
        # has moved on meanwhile (paused and auto-resumed, resumed elsewhere).
        for attempt in (1, 2):
            url = httpx.URL(scheme="http", host=route.host, port=route.port, raw_path=target)
            async with self.pools.use(route.sandbox_id, route.upstream) as client:
                request = httpx.Request(
                    scope["method"], url, headers=_forward_headers(scope["headers"]),
                    content=body() if _has_body(headers) else None,
                    extensions={"timeout": client.timeout.as_dict()},
                )
                try:
                    upstream = await client.send(request, stream=True)
                except NOT_SENT as exc:
                    log.info("upstream %s:%s of %s refused (%r)", route.host, route.port, route.sandbox_id, exc)
                except SENT_MAYBE as exc:
                    log.info("upstream %s:%s of %s failed: %r", route.host, route.port, route.sandbox_id, exc)
                    return await self._answer_gone(send, route)
                else:
                    return await _relay(send, upstream, route)
            try:
                current = await self.current_route(route.sandbox_id)
            except ResumeFailed as exc:
                return await _send_simple(send, *exc.response(route.sandbox_id))
            if attempt == 1 and current is not None and current.upstream != route.upstream:
                route = current
                continue
            return await _send_simple(send, *(not_found if current is None else port_closed)(route.sandbox_id))

    async def _answer_gone(self, send, route: Route):
        """The upstream failed after (part of) the request may have reached it: no
        retry; 'was not found' if the sandbox has no route any more, else 'port is not open'."""
        current = await self.routes.get(route.sandbox_id)
        if current is None or not current.routable:
            self.pools.forget(route.sandbox_id)
            return await _send_simple(send, *not_found(route.sandbox_id))
        return await _send_simple(send, *port_closed(route.sandbox_id))


# Failures before a byte of the request left: safe to retry on a newer route.
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout)
SENT_MAYBE = (httpx.PoolTimeout, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


async def _relay(send, upstream: httpx.Response, route: Route):
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

    def response(self, sandbox_id: str):
        return _json_response(self.status, {"sandboxId": sandbox_id, "code": self.status, "message": self.message})


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
