"""Serve registered Connect methods over ASGI (unary, server-stream, client-stream).

Stream lifetimes are owned here: keepalives after ``Keepalive-Ping-Interval`` of
silence, ending at the ``connect-timeout-ms`` deadline, and noticing client
disconnects promptly (which only stops the stream, never the work behind it).
"""

import asyncio
import json
import logging
import time

from .connect import (
    STREAM_CONTENT_TYPE,
    ConnectError,
    EnvelopeReader,
    FLAG_END_STREAM,
    decode_message,
    encode_message,
    end_stream,
    envelope,
    error_from_exception,
)

log = logging.getLogger("envd.rpc")

UNARY, SERVER_STREAM, CLIENT_STREAM = "unary", "server_stream", "client_stream"
MAX_UNARY_BYTES = 64 << 20


class Method:
    """One RPC: its kind, request class, handler and (for streams) keepalive factory."""

    def __init__(self, kind, request_cls, handler, keepalive=None):
        self.kind = kind
        self.request_cls = request_cls
        self.handler = handler
        self.keepalive = keepalive


class Context:
    """Per-call information handed to handlers."""

    def __init__(self, headers, user, deadline, keepalive_interval):
        self.headers = headers
        self.user = user
        self.deadline = deadline  # monotonic seconds or None
        self.keepalive_interval = keepalive_interval

    def remaining(self):
        """Seconds until the deadline (None if unlimited)."""
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - time.monotonic())


def parse_timeout_ms(value):
    """Parse ``connect-timeout-ms``; absent/invalid/0 mean no deadline."""
    if not value:
        return None
    try:
        ms = int(value)
    except ValueError:
        raise ConnectError("invalid_argument", f"invalid connect-timeout-ms {value!r}")
    return ms if ms > 0 else None


def parse_keepalive(value, default=50.0):
    try:
        seconds = float(value) if value else default
    except ValueError:
        seconds = default
    return seconds if seconds > 0 else default


def _content_type(headers):
    return headers.get("content-type", "").split(";")[0].strip().lower()


async def _send_json(send, status, body):
    data = json.dumps(body, separators=(",", ":")).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": data})


async def send_error(send, err):
    """Unary-style error: HTTP status + ``{"code","message"}`` JSON."""
    await _send_json(send, err.http_status, err.to_dict())


async def _read_body(receive, limit):
    chunks, size = [], 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ConnectError("canceled", "client disconnected")
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise ConnectError("resource_exhausted", "request too large")
        chunks.append(chunk)
        if not msg.get("more_body", False):
            return b"".join(chunks)


class _StreamResponse:
    """Lazily starts a 200 ``application/connect+json`` response and writes envelopes."""

    def __init__(self, send):
        self._send = send
        self.started = False
        self.closed = False

    async def _start(self):
        if not self.started:
            self.started = True
            await self._send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", STREAM_CONTENT_TYPE.encode())],
                }
            )

    async def message(self, msg):
        await self._start()
        await self._send({"type": "http.response.body", "body": envelope(encode_message(msg)), "more_body": True})

    async def finish(self, error=None):
        if self.closed:
            return
        await self._start()
        self.closed = True
        await self._send({"type": "http.response.body", "body": end_stream(error), "more_body": False})


async def serve(method, scope, receive, send, ctx):
    """Run one RPC call for an already-authorised request."""
    ctype = _content_type(ctx.headers)
    if method.kind == UNARY:
        if ctype != "application/json":
            await _send_json(send, 415, {"code": "unimplemented", "message": f"unsupported content-type {ctype!r}"})
            return
        try:
            body = await _read_body(receive, MAX_UNARY_BYTES)
            req = decode_message(body, method.request_cls)
            resp = await method.handler(req, ctx)
        except Exception as exc:  # every failure becomes a Connect error body
            err = error_from_exception(exc)
            if err.code == "internal":
                log.exception("unary %s failed", scope.get("path"))
            await send_error(send, err)
            return
        data = encode_message(resp)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": data})
        return

    if ctype != STREAM_CONTENT_TYPE:
        await _send_json(send, 415, {"code": "unimplemented", "message": f"unsupported content-type {ctype!r}"})
        return
    if method.kind == SERVER_STREAM:
        await _serve_server_stream(method, receive, send, ctx)
    else:
        await _serve_client_stream(method, receive, send, ctx)


async def _read_single_envelope(receive, request_cls):
    reader = EnvelopeReader()
    frames = []
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ConnectError("canceled", "client disconnected")
        frames.extend(reader.feed(msg.get("body", b"")))
        if not msg.get("more_body", False):
            break
    data = [p for f, p in frames if not f & FLAG_END_STREAM]
    if len(data) != 1 or reader.pending:
        raise ConnectError("invalid_argument", f"expected exactly one request message, got {len(data)}")
    return decode_message(data[0], request_cls)


async def _wait_disconnect(receive):
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


async def _serve_server_stream(method, receive, send, ctx):
    out = _StreamResponse(send)
    try:
        req = await _read_single_envelope(receive, method.request_cls)
    except Exception as exc:
        await out.finish(error_from_exception(exc))
        return
    agen = method.handler(req, ctx)
    disconnect = asyncio.ensure_future(_wait_disconnect(receive))
    nxt = None
    error = None
    try:
        while True:
            nxt = asyncio.ensure_future(agen.__anext__())
            while True:
                timeout = ctx.keepalive_interval
                remaining = ctx.remaining()
                if remaining is not None:
                    timeout = min(timeout, remaining)
                done, _ = await asyncio.wait({nxt, disconnect}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                if nxt in done:
                    break
                if disconnect in done:
                    out.closed = True  # nobody is listening; skip the trailer
                    return
                if ctx.remaining() == 0:
                    raise ConnectError("deadline_exceeded", "stream deadline exceeded")
                if method.keepalive is not None:
                    await out.message(method.keepalive())
            try:
                msg = nxt.result()
            except StopAsyncIteration:
                nxt = None
                break
            nxt = None
            await out.message(msg)
    except Exception as exc:
        error = error_from_exception(exc)
        if error.code == "internal":
            log.exception("stream failed")
    finally:
        if nxt is not None and not nxt.done():
            nxt.cancel()
            try:
                await nxt
            except (asyncio.CancelledError, StopAsyncIteration, Exception):
                pass
        disconnect.cancel()
        try:
            await agen.aclose()
        except Exception:
            log.exception("closing stream handler failed")
    await out.finish(error)


async def _request_messages(receive, request_cls):
    """Yield client-stream request messages as their envelopes arrive."""
    reader = EnvelopeReader()
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ConnectError("canceled", "client disconnected")
        for flags, payload in reader.feed(msg.get("body", b"")):
            if flags & FLAG_END_STREAM:
                return
            yield decode_message(payload, request_cls)
        if not msg.get("more_body", False):
            if reader.pending:
                raise ConnectError("invalid_argument", "truncated request envelope")
            return


async def _serve_client_stream(method, receive, send, ctx):
    out = _StreamResponse(send)
    try:
        resp = await method.handler(_request_messages(receive, method.request_cls), ctx)
    except Exception as exc:
        err = error_from_exception(exc)
        if err.code == "internal":
            log.exception("client stream failed")
        await out.finish(err)
        return
    await out.message(resp)
    await out.finish()
