"""The data plane: an ASGI app that streams SDK and user traffic to the right sandbox.

Routing is by the ``E2b-Sandbox-Id`` / ``E2b-Sandbox-Port`` headers, by a
``{port}-{sandboxId}.{domain}`` host or, for the SDK's signed file URLs (which carry
neither), by the sandbox whose envd token made the URL's signature; AgentENV's
``x-agentenv-sandbox-id`` / ``x-agentenv-target-port`` are answered in AgentENV's contract
(also at ``/proxy`` on the API's port: ``dataplane.mount``). envd's port
(49983) goes to the sandbox's envd (``envd_host:envd_port``) with its access token,
auto-resume and CORS; any other port goes to ``guest_host:port`` with E2B's traffic
access token, the client's Host (or the sandbox's ``maskRequestHost``) and a short retry
for services that start listening a moment late. Bodies stream in both directions without buffering (Connect streams stay
open for minutes), which is why this is a raw ASGI app under uvicorn and not a Django
view under daphne. WebSocket upgrades are bridged by ``dataplane.websockets`` (uvicorn
needs a WebSocket implementation: the ``websockets`` package, picked by its default
``--ws auto``). What a request addresses is ``dataplane.addressing``; whether it may
pass, ``dataplane.access``; what is answered here, ``dataplane.answers``; the headers sent
upstream, ``dataplane.headers``; a sandbox's route, ``dataplane.routes``.

Routes are read from the database on every request, never from a cache: a pause,
resume or kill changes the VM process behind a sandbox, and a route (or a pooled
connection) from before it would reach a process that is gone or, worse, whatever
now listens at its address. Concurrent requests share those reads, never one older than
the request (``dataplane.routes.RouteTable``). Upstream connections are pooled per
sandbox and VM generation (``dataplane.pools``) for the same reason.

Note: the upstream client (httpx's transport over httpcore) is half-duplex over HTTP/1.1 — it reads
the response after the request body is complete. The request body is still
forwarded chunk by chunk as it arrives; E2B clients are half-duplex too.
"""
import asyncio
import logging
import socket
import struct
from contextlib import aclosing

import httpx
from asgiref.sync import sync_to_async

from envd import ENVD_PORT

from dataplane import access, addressing, answers
from dataplane import cookies as proxy_cookies
from dataplane.answers import ResumeFailed, Refused, Why
from dataplane.handoff import Handoff
from dataplane.headers import API_KEY_HEADER, response_headers, upstream_headers, with_cors
from dataplane.pools import UpstreamPools
from dataplane.routes import Route, RouteTable, close_unusable
from dataplane.signers import SignerLookup
from dataplane.watch import RouteWatch
from dataplane.websockets import WebSocketBridge
from sandboxes.states import RESUMABLE

__all__ = ["EnvdProxy", "Route", "RouteTable", "UpstreamBroken"]

log = logging.getLogger(__name__)

CONNECT_TIMEOUT = 3.0
# A refused (or timed-out) connect to a user port is tried this many more times after
# these pauses, as E2B does: a service started a moment ago, or one bound to
# 127.0.0.1 that envd re-exposes about a second after it appears, is still reached.
USER_PORT_RETRY_DELAYS = (0.1, 0.2, 0.3, 0.4)
# How long connects that time out (each after CONNECT_TIMEOUT) are tried again while the
# sandbox is still running at the same place: a fork burst on an overloaded host.
SLOW_GUEST_PATIENCE = 20.0


class EnvdProxy:
    """ASGI app. One instance per process (it owns the upstream connection pools)."""

    retry_delays = USER_PORT_RETRY_DELAYS
    slow_guest_patience = SLOW_GUEST_PATIENCE

    def __init__(self, routes: RouteTable | None = None):
        self.routes = routes or RouteTable()
        self.signers = SignerLookup(self.routes)
        self.pools = UpstreamPools(CONNECT_TIMEOUT)
        self.websockets = WebSocketBridge(self)
        self.watch = RouteWatch(self.routes)
        # The hot path (HAProxy), when dataplane.serve started this process behind one.
        self.handoff = Handoff.from_env()
        # sandbox id → the auto-resume in progress, so concurrent requests join one.
        self._resuming: dict[str, asyncio.Future] = {}

    async def aclose(self) -> None:
        await self.watch.aclose()
        await self.pools.aclose()
        if self.handoff is not None:
            await self.handoff.aclose()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            await self.handle_http(scope, receive, send)
        elif scope["type"] == "websocket":
            await self.websockets.handle(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive, send):
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                if self.handoff is not None:
                    self.handoff.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def handle_http(self, scope, receive, send):
        headers = {n.lower(): v for n, v in scope["headers"]}
        scope = addressing.addressed(scope, headers)
        target = scope[addressing.TARGET]
        if answers.is_preflight(scope, headers):
            # Browsers send no custom header (so no E2b-Sandbox-Id) on a preflight; envd's
            # are answered here as E2B's envd would, a user port's go to the guest.
            if not target.sandbox_id or target.port == ENVD_PORT:
                return await _send_simple(send, *answers.preflight(headers))
        try:
            route, port = await self.admit(scope, headers)
        except Refused as refused:
            return await _send_simple(send, *refused.answer_in(target.dialect))
        await self._forward(scope, receive, send, route, port, headers)

    async def admit(self, scope, headers: dict[bytes, bytes]) -> tuple[Route, int]:
        """The route and port a request (HTTP or WebSocket; its scope from
        ``addressing.addressed``) goes to, after every check, auto-resuming a paused
        sandbox that asked for it. Raises Refused otherwise. A platform API key in the
        request is dropped from ``scope["headers"]`` (never forwarded to the guest)."""
        target = scope[addressing.TARGET]
        if target.error is not None:
            raise Refused(target.error)
        sandbox_id, port = (target.sandbox_id, target.port) if target.sandbox_id else await self.signed_target(scope)
        if not addressing.valid_port(port):
            raise Refused(Why.BAD_PORT, sandbox_id, port)
        if port == ENVD_PORT and access.is_node_only(scope["path"]):
            raise Refused(Why.NODE_ONLY, sandbox_id)
        route = await self.routes.get(sandbox_id)
        if route is not None and not await self._same_team(route, scope, headers):
            raise Refused(Why.NOT_FOUND, sandbox_id)
        if route is None or not (route.routable or route.state in RESUMABLE):
            self.pools.forget(sandbox_id)
            raise answers.unavailable(sandbox_id, route)
        # Checked before a resume: traffic without its token wakes nothing.
        refusal = (access.access_token_refusal(route, scope["path"], scope.get("query_string", b""), headers)
                   if port == ENVD_PORT else access.traffic_token_refusal(route, headers))
        if refusal is None and port == ENVD_PORT:
            refusal = access.wake_refusal(route, scope, headers)
        if refusal is not None:
            raise refusal
        route = await self.current_route(sandbox_id, route)
        if route is None:
            raise answers.unavailable(sandbox_id, await self.routes.get(sandbox_id))
        if port != ENVD_PORT and route.address(port) is None:
            raise Refused(Why.PORT_CLOSED, sandbox_id, port)
        return route, port

    async def _same_team(self, route: Route, scope, headers: dict[bytes, bytes]) -> bool:
        """False when the request carries a platform API key of another team than the
        sandbox's (answered as an unknown sandbox: nothing leaks). A platform key is the
        team's credential, not the guest's: it is taken out of the forwarded headers.
        Values that are none of our keys belong to the guest's app and pass."""
        raw_key = headers.get(API_KEY_HEADER)
        if raw_key is None:
            return True
        team_id = await self.routes.key_team(raw_key)
        if team_id is None:
            return True
        scope["headers"] = [(n, v) for n, v in scope["headers"] if n.lower() != API_KEY_HEADER]
        return team_id == route.team_id

    async def signed_target(self, scope) -> tuple[str, int]:
        """A request with no routing header or sandbox host: a signed ``/files`` URL (the
        SDK's ``download_url`` / ``upload_url`` behind ``E2B_SANDBOX_URL``) goes to envd of
        the sandbox whose token signed it; envd checks the signature again. No sandbox
        signed it: envd's 401 "invalid signature"; signed but past its expiration: 401
        "signature is already expired" (nothing is resumed for it); the signer lookup's
        budget spent: 429 (``dataplane.signers``). Anything else: 400."""
        signed = access.signed_file(scope)
        if signed is None:
            raise Refused(Why.NO_TARGET)
        sandbox_id = await self.signers.signer(signed)
        if sandbox_id is None:
            raise Refused(answer=answers.signature_refused(answers.MSG_INVALID_SIGNATURE))
        if signed.expired:
            raise Refused(answer=answers.signature_expired())
        return sandbox_id, ENVD_PORT

    async def current_route(self, sandbox_id: str, route: Route | None = None) -> Route | None:
        """The sandbox's route as the database has it now (or ``route``, just read); a
        paused one with autoResume is resumed first (see ``on_paused``). None: nothing
        to route to (the caller answers it unavailable). Raises ResumeFailed."""
        if route is None:
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
        concurrent requests join one resume. Without autoResume: None, answered as not
        running (E2B's 502 'was not found', AgentENV's 410). A failed resume raises ResumeFailed."""
        pending = self._resuming.get(route.sandbox_id)
        if pending is None:
            pending = asyncio.ensure_future(self._auto_resume(route.sandbox_id))
            self._resuming[route.sandbox_id] = pending
            pending.add_done_callback(lambda _f, sid=route.sandbox_id: self._resuming.pop(sid, None))
        # shield: a client that goes away does not cancel the resume others wait for
        return await asyncio.shield(pending)

    async def _auto_resume(self, sandbox_id: str) -> Route | None:
        from lifecycle.sandboxes import pause  # noqa: PLC0415 - Django must be set up first
        from sandboxes.errors import LifecycleError, Timeout  # noqa: PLC0415

        try:
            sandbox = await pause.auto_resume(sandbox_id)
        except LifecycleError as exc:
            log.info("auto-resume of %s failed: %s", sandbox_id, exc.message)
            raise ResumeFailed(Why.RESUME_TIMEOUT if isinstance(exc, Timeout) else Why.RESUME_FAILED, sandbox_id,
                               detail=exc.message) from None
        finally:
            await sync_to_async(close_unusable, thread_sensitive=True)()
        if sandbox is None:
            return None
        return await self.routes.get(sandbox_id)

    async def attempts(self, route: Route, port: int, failures: list | None = None):
        """The routes to try connecting to, one per attempt. A refused (or timed-out)
        connect sent nothing, so the caller asks for the next (and appends its error to
        ``failures``): on a user port a few more times after short pauses (the service may
        be about to listen), then once on the sandbox's newer route if it has moved on
        meanwhile (paused and auto-resumed, resumed elsewhere). A connect that timed out
        on a sandbox still running at the same place is a guest too busy to answer (an
        overloaded host: dozens of emulated guests on two cores), not a gone one: it is
        tried again until ``slow_guest_patience`` s have passed. When none is left, raises
        Refused: the sandbox is unavailable, or its port is not open (or ResumeFailed)."""
        delays = (0.0, *(self.retry_delays if port != ENVD_PORT else ()))
        patient_until = asyncio.get_running_loop().time() + self.slow_guest_patience
        for attempt in (1, 2):
            for delay in delays:
                if delay:
                    await asyncio.sleep(delay)
                yield route
            if attempt == 1:
                while True:
                    current = await self.current_route(route.sandbox_id)
                    if current is None:  # as the database has it: gone, or paused and not resumed
                        raise answers.gone(route.sandbox_id, port, await self.routes.get(route.sandbox_id))
                    if current.address(port) is None:
                        raise answers.gone(route.sandbox_id, port, current)
                    if current.upstream != route.upstream:
                        break
                    if not (failures and isinstance(failures[-1], SLOW_CONNECT)
                            and asyncio.get_running_loop().time() < patient_until):
                        raise answers.gone(route.sandbox_id, port, current)
                    log.info("sandbox %s port %s slow to accept; trying again", route.sandbox_id, port)
                    yield route
                route = current
        raise answers.gone(route.sandbox_id, port, await self.routes.get(route.sandbox_id))

    async def _forward(self, scope, receive, send, route: Route, port: int, headers: dict):
        body_queue: asyncio.Queue = asyncio.Queue(maxsize=8)
        disconnected = asyncio.Event()
        pump = asyncio.create_task(_pump_request(receive, body_queue, disconnected))
        exchange = asyncio.create_task(self._exchange(scope, send, route, port, headers, body_queue, receive))
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
            except UpstreamBroken:
                _reset_on_close(receive)
                raise
        finally:
            for task in (pump, watch, exchange):
                task.cancel()
            await asyncio.gather(pump, watch, return_exceptions=True)

    async def _exchange(self, scope, send, route: Route, port: int, headers: dict, body_queue, receive=None):
        async def body():
            while True:
                chunk = await body_queue.get()
                if chunk is None:
                    return
                yield chunk

        target = scope.get("raw_path") or scope["path"].encode()
        query = scope.get("query_string", b"")
        if query:
            target += b"?" + query
        try:
            failures: list[Exception] = []
            async with aclosing(self.attempts(route, port, failures)) as attempts:
                async for route in attempts:
                    host, upstream_port = route.address(port)
                    url = httpx.URL(scheme="http", host=host, port=upstream_port, raw_path=target)
                    async with self.pools.use(route.sandbox_id, route.upstream, _lane(scope)) as pool:
                        request = httpx.Request(
                            scope["method"], url, headers=upstream_headers(scope["headers"], route, port),
                            content=body() if _has_body(headers) else None,
                        )
                        try:
                            upstream = await pool.send(request)
                        except NOT_SENT as exc:
                            log.info("upstream %s:%s of %s refused (%r)", host, upstream_port, route.sandbox_id, exc)
                            failures.append(exc)
                            continue
                        except SENT_MAYBE as exc:
                            log.info("upstream %s:%s of %s failed: %r", host, upstream_port, route.sandbox_id, exc)
                            raise await self._gone(route, port)
                        # inside the lease: a pool in use is never retired as idle
                        handoff = (self.handoff if self.handoff is not None and receive is not None
                                   and _keeps_alive(upstream)
                                   and await self.handoff.ready(scope, headers, route, port) else None)
                        with self.watch.moved(route) as moved:
                            return await _relay(send, upstream, route, moved, cors=port == ENVD_PORT, scope=scope,
                                                handoff=handoff and (handoff, receive))
        except Refused as refused:
            return await _send_simple(send, *refused.answer_in(addressing.dialect_of(scope)))

    async def _gone(self, route: Route, port: int) -> Refused:
        """The upstream failed after (part of) the request may have reached it: no
        retry; unavailable if the sandbox has no route any more, else 'port is not open'."""
        current = await self.routes.get(route.sandbox_id)
        if current is None or not current.routable:
            self.pools.forget(route.sandbox_id)
        return answers.gone(route.sandbox_id, port, current)


# Failures before a byte of the request left: safe to retry on a newer route.
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout)
SLOW_CONNECT = (httpx.ConnectTimeout, TimeoutError)  # unanswered, not refused (the WebSocket path's is TimeoutError)
SENT_MAYBE = (httpx.PoolTimeout, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


def _lane(scope):
    """The client connection a request came on (``dataplane.pools``' lanes): its address."""
    client = scope.get("client")
    return tuple(client) if client else None


def _has_body(headers: dict[bytes, bytes]) -> bool:
    if b"transfer-encoding" in headers:
        return True
    length = headers.get(b"content-length", b"0").strip()
    return length.isdigit() and int(length) > 0


async def _relay(send, upstream: httpx.Response, route: Route, moved: asyncio.Event, cors: bool, scope,
                 handoff: tuple[Handoff, object] | None = None):
    """Streams the upstream response to the client until it ends, the upstream breaks, or
    ``moved`` says the sandbox's VM is gone (killed, paused, moved: ``dataplane.watch``).
    In the last two cases the client's connection is reset (UpstreamBroken, then
    ``_reset_on_close``), as E2B's proxy resets the stream of a sandbox that died: both E2B
    SDKs take a reset connection for "the sandbox may be gone", probe ``/health`` (then 502
    "was not found") and report that it was killed or reached its end of life.
    The guest's cookies are confined to its own host (``dataplane.cookies``). With
    ``handoff`` (the hot path's, and the request's ``receive``), the client's connection
    may go to HAProxy after this answer (``dataplane.handoff``)."""
    gone = asyncio.ensure_future(moved.wait())
    chunks = upstream.aiter_raw()
    read = held = None
    # The client must not be able to send its next request before the connection's reading
    # is paused for a handoff: paused before the write that completes the answer.
    length = _body_length(upstream, scope) if handoff else None
    try:
        headers = proxy_cookies.confine(response_headers(upstream.headers.raw), scope)
        if length == 0:
            held = handoff[0].hold(handoff[1])
        await send({"type": "http.response.start", "status": upstream.status_code,
                    "headers": with_cors(headers) if cors else headers})
        while True:
            read = asyncio.ensure_future(anext(chunks, None))
            await asyncio.wait({read, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not read.done():
                raise _VMGone(f"sandbox {route.sandbox_id} was killed, paused or moved")
            chunk = read.result()
            if chunk is None:
                break
            if chunk:
                if length is not None and held is None:
                    length -= len(chunk)
                    if length <= 0:
                        held = handoff[0].hold(handoff[1])
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        if handoff and held is None and length is None:
            held = handoff[0].hold(handoff[1])
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        if held is not None:
            handoff[0].release(held)
    except (httpx.HTTPError, _VMGone) as exc:
        # Raising makes uvicorn close the connection (reset: _forward), so the client sees
        # a broken stream (and probes /health) instead of a clean end.
        log.info("upstream of %s ended mid-response (%r); resetting the client connection", route.sandbox_id, exc)
        raise UpstreamBroken(f"upstream of {route.sandbox_id} ended mid-response: {exc!r}") from exc
    finally:
        gone.cancel()
        if read is not None and not read.done():  # the VM went away, or the client did
            read.cancel()
            await asyncio.gather(read, return_exceptions=True)
        await chunks.aclose()
        await upstream.aclose()


def _keeps_alive(upstream: httpx.Response) -> bool:
    """The guest answered in HTTP/1.1 and keeps its connection (what a handoff needs)."""
    connection = upstream.headers.get("connection", "").lower()
    return upstream.http_version == "HTTP/1.1" and "close" not in connection


def _body_length(upstream: httpx.Response, scope) -> int | None:
    """How many body bytes the client will read before the answer is complete to it, when it
    knows that from the head (no body, or a Content-Length); None: until the chunked end."""
    if scope.get("method") == "HEAD" or upstream.status_code in (204, 304) or upstream.status_code < 200:
        return 0
    lengths = upstream.headers.get_list("content-length")
    if len(lengths) == 1 and lengths[0].strip().isdigit():
        return int(lengths[0])
    return None


class _VMGone(Exception):
    """The sandbox of a relayed response no longer has that VM behind it."""


class UpstreamBroken(Exception):
    """The upstream stream failed after the response started; the client connection is reset."""


def _reset_on_close(receive) -> bool:
    """Makes the server's coming close of this request's connection a reset (RST), not a FIN.

    Why: over HTTP/1.1 (``E2B_SANDBOX_URL``) a FIN in the middle of a chunked body is a
    protocol error to pyqwest, the Python SDK's HTTP client ("error reading a body from
    connection: unexpected EOF"), which E2B's SDK re-raises as it is; a reset is the dropped
    connection it probes ``/health`` for, and Node's fetch reports both as "terminated". A
    reset is also what E2B's proxy sends over HTTP/2 (RST_STREAM). ASGI has no message for
    it, so the socket is reached through uvicorn's request cycle (``receive`` is its bound
    method); under another server nothing changes (False)."""
    transport = getattr(getattr(receive, "__self__", None), "transport", None)
    get_extra_info = getattr(transport, "get_extra_info", None)
    sock = get_extra_info("socket") if callable(get_extra_info) else None
    if sock is None:
        return False
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        return False
    return True


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
