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

What stays as it was: the database connection is still closed at the request's end (Django's
``request_finished``, CONN_MAX_AGE=0, run on the request's thread), so nothing of a
connection crosses requests. A task that outlives its request (``lifecycle``'s shielded
transitions when the client goes away) and calls ``sync_to_async`` after the end gets a new
thread of its own, as with asgiref's own context (the lent executor is no longer the
context's). A call of the request still running on the lent thread when the request ends
(such a shielded task's) finishes before the next request's calls there start: the executor
has one worker, in order.

``POOL`` keeps at most ``AENV_REQUEST_THREADS_IDLE`` idle threads (default 16); with more
requests at once, more executors are made and the surplus is shut down when given back."""
from __future__ import annotations

import asyncio
import os
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from asgiref.sync import SyncToAsync, ThreadSensitiveContext
from django.core.handlers.asgi import ASGIHandler


class ExecutorPool:
    """Idle one-worker executors, most recently used first (its thread's caches are warm)."""

    def __init__(self, idle_max: int):
        self.idle_max = idle_max
        self._idle: deque[ThreadPoolExecutor] = deque()
        self._lock = threading.Lock()
        self.made = 0  # tests and benchmarks: how many executors (threads) were ever made

    def take(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._idle:
                return self._idle.pop()
            self.made += 1
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix="aenv-request")

    def give(self, executor: ThreadPoolExecutor) -> None:
        with self._lock:
            if len(self._idle) < self.idle_max:
                self._idle.append(executor)
                return
        executor.shutdown(wait=False)  # its thread ends once what was queued on it has run

    def idle(self) -> int:
        return len(self._idle)


POOL = ExecutorPool(int(os.environ.get("AENV_REQUEST_THREADS_IDLE", "16")))


class PooledThreadContext(ThreadSensitiveContext):
    """asgiref's per-request context with its executor lent by ``POOL`` (see the module)."""

    _lent: ThreadPoolExecutor | None = None

    async def __aenter__(self):
        await super().__aenter__()
        if self.token is not None:  # the outermost context (not inside another one)
            self._lend()
        return self

    def _lend(self) -> None:
        """This context's sync calls to an executor taken from ``POOL``."""
        self._lent = POOL.take()
        SyncToAsync.context_to_thread_executor[self] = self._lent

    async def __aexit__(self, exc, value, tb):
        if self._lent is None:
            return await super().__aexit__(exc, value, tb)
        if SyncToAsync.context_to_thread_executor.get(self) is self._lent:
            del SyncToAsync.context_to_thread_executor[self]
        SyncToAsync.thread_sensitive_context.reset(self.token)
        self.token = None
        lent, self._lent = self._lent, None
        POOL.give(lent)


class DetachedThreadContext(PooledThreadContext):
    """A context of its own with a lent thread even inside a request's (``on_a_thread_of_its_own``)."""

    async def __aenter__(self):
        self.token = SyncToAsync.thread_sensitive_context.set(self)
        self._lend()
        return self


async def on_a_thread_of_its_own(coro):
    """Awaits ``coro`` with its thread-sensitive ``sync_to_async`` calls on a lent thread of its
    own, not on its caller's request's, and that thread's database connections closed when it
    is done.

    Why: a task that outlives its request (``lifecycle``'s shielded transitions, when the client
    goes away mid-transition) would call ``sync_to_async`` in the ended request's context:
    asgiref then gives that context a new thread which nothing ends and whose connection nothing
    closes. With PostgreSQL's pool that was one pooled connection lost for good per client that
    went away mid-transition, until the API's pool ran dry."""
    context = DetachedThreadContext()
    async with context:
        lent = context._lent
        try:
            return await coro
        finally:
            from django.db import connections  # noqa: PLC0415

            # on the lent thread itself (not through sync_to_async: inside an async_to_sync
            # bridge that would be the caller's thread, whose connection is not ours to close)
            await asyncio.wrap_future(lent.submit(connections.close_all))


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
    return PooledThreadsASGIHandler()
