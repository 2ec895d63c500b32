"""A total deadline for the blocking client's calls, not only a timeout per read.

Why: httpx's timeouts bound each socket operation. A guest that answers one byte a second
(headers included) never trips them, and a node thread waits forever on ``/init`` or
``/metrics``. The async client wraps a call in ``asyncio.timeout``; the blocking one cannot
interrupt a read from outside, so its transport's sockets take every timeout as at most
the time left before the deadline of the call under way (a context variable ``within``
sets) and fail at once with a read timeout once it has passed.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
import time

import httpcore
import httpx

_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("envd_deadline", default=None)


@contextlib.contextmanager
def within(seconds: float | None):
    """Calls made inside end within ``seconds`` from now (None: no deadline; an enclosing
    deadline that comes sooner still holds)."""
    if seconds is None:
        yield
        return
    end = time.monotonic() + seconds
    outer = _DEADLINE.get()
    token = _DEADLINE.set(end if outer is None else min(outer, end))
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def _left(timeout: float | None, error: type[Exception]) -> float | None:
    end = _DEADLINE.get()
    if end is None:
        return timeout
    left = end - time.monotonic()
    if left <= 0:
        raise error("the call's total deadline passed")
    return left if timeout is None else min(timeout, left)


class _Stream(httpcore.NetworkStream):
    def __init__(self, inner: httpcore.NetworkStream):
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, _left(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, _left(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, ssl_context, server_hostname=None, timeout=None) -> httpcore.NetworkStream:
        return _Stream(self._inner.start_tls(ssl_context, server_hostname, _left(timeout, httpcore.ConnectTimeout)))

    def get_extra_info(self, info: str):
        return self._inner.get_extra_info(info)


class _Backend(httpcore.NetworkBackend):
    def __init__(self, inner: httpcore.NetworkBackend):
        self._inner = inner

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        return _Stream(self._inner.connect_tcp(host, port, _left(timeout, httpcore.ConnectTimeout),
                                               local_address, socket_options))

    def connect_unix_socket(self, path, timeout=None, socket_options=None):
        return _Stream(self._inner.connect_unix_socket(path, _left(timeout, httpcore.ConnectTimeout),
                                                       socket_options))

    def sleep(self, seconds: float) -> None:
        left = _left(None, httpcore.ConnectTimeout)
        self._inner.sleep(seconds if left is None else min(seconds, left))


def transport(verify) -> httpx.HTTPTransport:
    """httpx's own transport whose connections keep to the deadline of ``within``.
    (httpx takes no network backend as an argument; its pool does, so the pool's is wrapped.)"""
    t = httpx.HTTPTransport(verify=verify)
    pool = t._pool  # noqa: SLF001 - see above; tests/unit/test_envd_client_limits.py guards it
    pool._network_backend = _Backend(pool._network_backend)  # noqa: SLF001
    return t


def seconds_left() -> float:
    """Time left before the current deadline (inf without one)."""
    end = _DEADLINE.get()
    return math.inf if end is None else end - time.monotonic()
