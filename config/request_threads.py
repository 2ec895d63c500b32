"""The API's requests run their sync code (ORM calls, Django's signals, sync middleware) on a
thread lent from a small pool instead of on a thread made for each request.

Django's ASGI handler enters an asgiref ``ThreadSensitiveContext`` per request: every
``sync_to_async`` call of the request then runs on one thread of its own, made at its first
call (a ``ThreadPoolExecutor`` with one worker) and joined at the end by yet another thread
made for that. Two threads started per request cost ~1.2 ms of the API's CPU (in-process,
loaded host: 1.48 → 0.25 ms per request-like cycle; docs/benchmarks.md, fourth round) —
several times what the request's SQLite connection costs to open with ``config.sqlite_wal``'s
keeper (~0.05 ms). ``PooledThreadContext`` is that context with its one-worker executor taken
from ``POOL`` at the start of a request and given back at its end, so the request still has a
thread of its own while it runs (its sync calls in order, on one thread; concurrent requests
on different threads), and the thread lives on for the next one.

The database connection is checked at the request's end on the request's thread (Django's
``request_finished``): with PostgreSQL (CONN_MAX_AGE=0, the pool) it goes back to the pool;
with SQLite the API keeps it open for the thread's next request (config.asgi) unless an error
broke it or a transaction was left open, so no broken connection crosses requests. A task
that outlives its request runs in a context of its own (``lifecycle.own_thread``:
``lifecycle``'s shielded transitions when the client goes away), on a thread of another pool.
A call of the request still running on the lent thread when the request ends finishes before
the next request's calls there start: the executor has one worker, in order.

``POOL`` keeps at most ``AENV_REQUEST_THREADS_IDLE`` idle threads (default 16); with more
requests at once, more executors are made and the surplus is shut down when given back."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from asgiref.sync import SyncToAsync, ThreadSensitiveContext
from django.core.handlers.asgi import ASGIHandler

from lifecycle.own_thread import ExecutorPool


POOL = ExecutorPool(int(os.environ.get("AENV_REQUEST_THREADS_IDLE", "16")), "aenv-request")


class PooledThreadContext(ThreadSensitiveContext):
    """asgiref's per-request context with its executor lent by ``POOL`` (see the module)."""

    _lent: ThreadPoolExecutor | None = None

    async def __aenter__(self):
        await super().__aenter__()
        if self.token is not None:  # the outermost context (not inside another one)
            self._lent = POOL.take()
            SyncToAsync.context_to_thread_executor[self] = self._lent
        return self

    async def __aexit__(self, exc, value, tb):
        if self._lent is None:
            return await super().__aexit__(exc, value, tb)
        if SyncToAsync.context_to_thread_executor.get(self) is self._lent:
            del SyncToAsync.context_to_thread_executor[self]
        SyncToAsync.thread_sensitive_context.reset(self.token)
        self.token = None
        lent, self._lent = self._lent, None
        POOL.give(lent)


class PooledThreadsASGIHandler(ASGIHandler):
    """Django's ASGI handler with ``PooledThreadContext`` for each request."""

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            raise ValueError(f"Django can only handle ASGI/HTTP connections, not {scope['type']}.")
        async with PooledThreadContext():
            await self.handle(scope, receive, send)


def get_asgi_application() -> PooledThreadsASGIHandler:
    """``django.core.asgi.get_asgi_application`` with the pooled request threads."""
    import django  # noqa: PLC0415

    django.setup(set_prefix=False)
    no_check_at_request_start()
    return PooledThreadsASGIHandler()


def no_check_at_request_start() -> None:
    """Django checks the database connection at each request's start and at its end
    (``close_old_connections`` on ``request_started`` and ``request_finished``). In an async
    request the start's check is a thread hand-off and back before the view runs, on every API
    call (issue 26: one of the hops counted per request). Here it checks nothing the end's did not: a
    request thread is lent by ``POOL`` only after its last request's end ran that check on it,
    and nothing else runs on an idle lent thread. So only the end's check stays. Without
    DEBUG, ``reset_queries`` (the start's other receiver) has no query log to clear; with it,
    it stays."""
    from django.conf import settings  # noqa: PLC0415
    from django.core import signals  # noqa: PLC0415
    from django.db import close_old_connections, reset_queries  # noqa: PLC0415

    signals.request_started.disconnect(close_old_connections)
    if not settings.DEBUG:
        signals.request_started.disconnect(reset_queries)
