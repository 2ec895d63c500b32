"""WebSocket upgrades through the data plane, bridged to the guest.

A browser or client opening ``ws://{port}-{id}.{domain}/...`` (or sending the routing
headers) reaches a WebSocket server in the sandbox: Jupyter, VS Code, dev servers.
The upgrade is routed, checked and auto-resumes exactly like HTTP (``EnvdProxy.admit``,
the same connect retries via ``EnvdProxy.attempts``); then a WebSocket client
(the ``websockets`` library, sans-I/O protocol on asyncio) opens
``ws://<guest address>:<port><raw path>?<query>`` with the client's headers (Host as
for HTTP: the client's or the sandbox's ``maskRequestHost``) and subprotocols, the
client is accepted with the subprotocol the guest chose, and text and binary messages
flow both ways until one side closes; its close code and reason are passed on.

Refusals before the client is accepted use the ASGI ``websocket.http.response``
extension when the server offers it (uvicorn does): the client sees the same status
and JSON body as over HTTP (a guest that rejects the handshake is relayed as it
answered; unreachable → 502, no handshake answer in time → 504). Without the
extension the handshake is closed, which uvicorn answers with 403.
"""
import asyncio
import logging
from contextlib import aclosing

from websockets.asyncio.client import ClientConnection
from websockets.client import ClientProtocol
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus
from websockets.frames import CloseCode
from websockets.uri import WebSocketURI

from dataplane import addressing, answers
from dataplane import cookies as proxy_cookies
from dataplane.answers import Refused, Why
from dataplane.headers import response_headers, upstream_headers
from dataplane.routes import Route

log = logging.getLogger(__name__)

CONNECT_TIMEOUT = 3.0
# From connected to the guest's 101: longer means the service is stuck (→ 504).
HANDSHAKE_TIMEOUT = 10.0
# The largest message taken from the guest (uvicorn's default limit for the client side).
MAX_MESSAGE = 16 * 1024 * 1024
# The bridge makes its own handshake with the guest: the client's are not passed on.
HANDSHAKE_HEADERS = frozenset({
    b"sec-websocket-key", b"sec-websocket-version", b"sec-websocket-extensions", b"sec-websocket-protocol",
    b"sec-websocket-accept", b"content-length",
})
# Codes a close frame may carry (RFC 6455 §7.4); others are stand-ins for "no code" or
# "connection lost" that only an endpoint reports.
_SENDABLE = frozenset({1000, 1001, 1002, 1003, 1007, 1008, 1009, 1010, 1011, 1012, 1013, 1014})


class _Handshake(ClientProtocol):
    """The client side of the guest handshake, carrying the client's headers: its Host
    replaces the upstream address the library would send."""

    def __init__(self, uri: WebSocketURI, headers: list[tuple[bytes, bytes]], **kwargs):
        super().__init__(uri, **kwargs)
        self._client_headers = [(n.decode("latin-1"), v.decode("latin-1")) for n, v in headers]

    def connect(self):
        request = super().connect()
        if any(name.lower() == "host" for name, _ in self._client_headers):
            del request.headers["Host"]
        for name, value in self._client_headers:
            request.headers[name] = value
        return request


class _NotSent(Exception):
    """The TCP connect failed: nothing reached the guest, another attempt may follow."""


class WebSocketBridge:
    """The ``websocket`` scope of ``EnvdProxy`` (``proxy``: its routing, checks,
    auto-resume and connect attempts)."""

    def __init__(self, proxy):
        self.proxy = proxy

    async def handle(self, scope, receive, send):
        if (await receive())["type"] != "websocket.connect":
            return
        headers = {n.lower(): v for n, v in scope["headers"]}
        scope = addressing.addressed(scope, headers)
        try:
            route, port = await self.proxy.admit(scope, headers)
            upstream = await self._open(scope, route, port)
        except Refused as refused:
            return await _deny(scope, send, *refused.answer_in(addressing.dialect_of(scope)))
        try:
            await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol,
                        "headers": _accept_headers(upstream.response.headers.raw_items(), scope)})
            await _bridge(receive, send, upstream)
        finally:
            await upstream.close()

    async def _open(self, scope, route: Route, port: int) -> ClientConnection:
        failures: list[Exception] = []
        async with aclosing(self.proxy.attempts(route, port, failures)) as attempts:
            async for route in attempts:
                try:
                    return await _connect(scope, route, port)
                except _NotSent as exc:
                    log.info("websocket upstream of %s port %s refused (%r)", route.sandbox_id, port, exc.__cause__)
                    failures.append(exc.__cause__)
        raise AssertionError("attempts() ends by raising Refused")  # pragma: no cover


async def _connect(scope, route: Route, port: int) -> ClientConnection:
    """The open guest WebSocket. Raises _NotSent (TCP connect failed) or Refused (the
    handshake failed: relayed, 502 or 504)."""
    host, upstream_port = route.address(port)
    target = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
    uri = WebSocketURI(secure=False, host=host, port=upstream_port, path=target,
                       query=scope.get("query_string", b"").decode("latin-1"))
    protocol = _Handshake(uri, upstream_headers(scope["headers"], route, port, drop=HANDSHAKE_HEADERS),
                          subprotocols=list(scope.get("subprotocols") or ()) or None, max_size=MAX_MESSAGE,
                          logger=log)
    connection = ClientConnection(protocol)
    loop = asyncio.get_running_loop()
    try:
        await asyncio.wait_for(loop.create_connection(lambda: connection, host, upstream_port), CONNECT_TIMEOUT)
    except (OSError, asyncio.TimeoutError) as exc:
        raise _NotSent() from exc
    try:
        await asyncio.wait_for(connection.handshake(user_agent_header=None), HANDSHAKE_TIMEOUT)
    except InvalidStatus as exc:
        connection.transport.abort()
        raise Refused(answer=_relayed(exc.response, scope)) from None
    except asyncio.TimeoutError:
        connection.transport.abort()
        raise Refused(Why.UPSTREAM_TIMEOUT, route.sandbox_id, port) from None
    except (InvalidHandshake, OSError, EOFError) as exc:
        connection.transport.abort()
        log.info("websocket handshake with %s port %s failed: %r", route.sandbox_id, port, exc)
        raise answers.gone(route.sandbox_id, port, route) from None
    except BaseException:
        connection.transport.abort()
        raise
    connection.start_keepalive()
    return connection


def _relayed(response, scope):
    """The guest's answer to a handshake it rejected, as the client's (its cookies
    confined: ``dataplane.cookies``)."""
    body = bytes(response.body or b"")
    headers = [(n.encode("latin-1"), v.encode("latin-1")) for n, v in response.headers.raw_items()]
    headers = [(n, v) for n, v in response_headers(headers) if n.lower() not in HANDSHAKE_HEADERS]
    return response.status_code, proxy_cookies.confine(headers, scope), body


def _accept_headers(raw_items, scope) -> list[tuple[bytes, bytes]]:
    """The guest's 101 headers worth passing on (cookies, for instance: confined to the
    sandbox's own host, ``dataplane.cookies``)."""
    headers = [(n.encode("latin-1"), v.encode("latin-1")) for n, v in raw_items]
    return proxy_cookies.confine(
        [(n, v) for n, v in response_headers(headers) if n.lower() not in HANDSHAKE_HEADERS], scope)


async def _deny(scope, send, status: int, headers, body: bytes):
    if "websocket.http.response" in (scope.get("extensions") or {}):
        await send({"type": "websocket.http.response.start", "status": status, "headers": headers})
        await send({"type": "websocket.http.response.body", "body": body})
    else:
        await send({"type": "websocket.close", "code": 1008})


async def _bridge(receive, send, upstream: ClientConnection):
    """Messages both ways until one side closes; the other side is then closed with
    the same code and reason."""
    from_client = asyncio.create_task(_client_to_upstream(receive, upstream))
    from_upstream = asyncio.create_task(_upstream_to_client(upstream, send))
    try:
        done, _ = await asyncio.wait({from_client, from_upstream}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (from_client, from_upstream):
            task.cancel()
        await asyncio.gather(from_client, from_upstream, return_exceptions=True)
    if from_client in done and not from_client.cancelled() and from_client.exception() is None:
        code, reason = from_client.result()  # the client closed (or went away)
        await upstream.close(*_close_args(code, reason, lost=CloseCode.GOING_AWAY))
        return
    if (from_upstream in done and not from_upstream.cancelled()
            and not isinstance(from_upstream.exception(), (type(None), ConnectionClosed))):
        return  # sending to the client failed: it is gone; the caller closes the guest side
    # The guest closed (or its connection broke): tell the client.
    await upstream.close()
    rcvd = upstream.protocol.close_rcvd
    if rcvd is None:
        code, reason = _close_args(1006, "", lost=CloseCode.BAD_GATEWAY)
    else:
        code, reason = _close_args(rcvd.code, rcvd.reason, lost=CloseCode.NORMAL_CLOSURE)
    try:
        await send({"type": "websocket.close", "code": code, "reason": reason})
    except Exception:  # noqa: BLE001 - the client went away meanwhile
        pass


async def _client_to_upstream(receive, upstream: ClientConnection) -> tuple[int, str]:
    while True:
        message = await receive()
        if message["type"] == "websocket.receive":
            data = message.get("bytes")
            await upstream.send(data if data is not None else message.get("text", ""))
        elif message["type"] == "websocket.disconnect":
            return message.get("code", 1005), message.get("reason") or ""


async def _upstream_to_client(upstream: ClientConnection, send) -> None:
    while True:
        data = await upstream.recv()  # raises ConnectionClosed when the guest closes
        if isinstance(data, str):
            await send({"type": "websocket.send", "text": data})
        else:
            await send({"type": "websocket.send", "bytes": data})


def _close_args(code: int, reason: str, lost: int) -> tuple[int, str]:
    """A close code and reason that may be sent on: 1005 (none given) becomes a normal
    closure, 1006 (connection lost) and other reserved codes become ``lost``."""
    if code in _SENDABLE or 3000 <= code < 5000:
        return code, reason
    if code == CloseCode.NO_STATUS_RCVD:
        return CloseCode.NORMAL_CLOSURE, ""
    return lost, ""
