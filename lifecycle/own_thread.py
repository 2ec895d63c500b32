"""A task that may outlive its request runs its ORM calls on a thread of its own, closed with
its database connections at the task's end.

Why: ``lifecycle``'s shielded transitions go on when the client goes away mid-transition. In
the ended request's asgiref context their ``sync_to_async`` calls would get a new thread that
nothing ends and whose connection nothing closes: with PostgreSQL's pool, one pooled
connection lost for good per client that went away, until the API's pool ran dry. A
transition takes seconds, so one thread made for it (well under a millisecond) costs
nothing worth pooling."""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from asgiref.sync import SyncToAsync, ThreadSensitiveContext
from django.db import connections


class _OwnThreadContext(ThreadSensitiveContext):
    """asgiref's thread-sensitive context, entered even inside a request's (asgiref's own
    does nothing when nested), with a one-worker executor of its own."""

    def __init__(self):
        super().__init__()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aenv-transition")

    async def __aenter__(self):
        self.token = SyncToAsync.thread_sensitive_context.set(self)
        SyncToAsync.context_to_thread_executor[self] = self.executor
        return self

    async def __aexit__(self, exc, value, tb):
        SyncToAsync.context_to_thread_executor.pop(self, None)
        SyncToAsync.thread_sensitive_context.reset(self.token)
        self.token = None
        self.executor.shutdown(wait=False)  # its thread ends once what was queued on it has run


async def on_a_thread_of_its_own(coro):
    """Awaits ``coro`` with its thread-sensitive ``sync_to_async`` calls on a thread of its own,
    not on its caller's request's, and that thread's database connections closed at the end."""
    async with _OwnThreadContext() as context:
        try:
            return await coro
        finally:
            # on that thread itself (not through sync_to_async: inside an async_to_sync bridge
            # that would be the caller's thread, whose connection is not ours to close)
            await asyncio.wrap_future(context.executor.submit(connections.close_all))
