"""A task that may outlive its request runs its ORM calls on a thread of its own, its database
connections closed at the task's end as a request's are.

Why: ``lifecycle``'s shielded transitions go on when the client goes away mid-transition. In
the ended request's asgiref context their ``sync_to_async`` calls would get a new thread that
nothing ends and whose connection nothing closes: with PostgreSQL's pool, one pooled
connection lost for good per client that went away, until the API's pool ran dry.

The thread is lent by a pool of idle one-worker executors (``ExecutorPool``, which the API's
request threads use too: ``config.request_threads``), not started for each create, pause or
resume: a thread's start and join are what the request pool saved (issue 26, the fourth round:
two per request cost ~1.2 ms of the API's CPU on a loaded host). Before it goes back its
connections get the check a request's get at its end (``close_old_connections``): closed, unless
persistent (the API on SQLite, config.asgi) and sound (no error, no transaction left open), so
no broken connection and no open transaction reaches the next user of the thread."""
from __future__ import annotations

import logging
import os
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from asgiref.sync import SyncToAsync, ThreadSensitiveContext
from django.db import close_old_connections

log = logging.getLogger(__name__)


class ExecutorPool:
    """Idle one-worker executors, most recently used first (its thread's caches are warm)."""

    def __init__(self, idle_max: int, thread_name: str):
        self.idle_max = idle_max
        self.thread_name = thread_name
        self._idle: deque[ThreadPoolExecutor] = deque()
        self._lock = threading.Lock()
        self.made = 0  # tests and benchmarks: how many executors (threads) were ever made

    def take(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._idle:
                return self._idle.pop()
            self.made += 1
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix=self.thread_name)

    def give(self, executor: ThreadPoolExecutor) -> None:
        with self._lock:
            if len(self._idle) < self.idle_max:
                self._idle.append(executor)
                return
        executor.shutdown(wait=False)  # its thread ends once what was queued on it has run

    def idle(self) -> int:
        return len(self._idle)


POOL = ExecutorPool(int(os.environ.get("AENV_TRANSITION_THREADS_IDLE", "8")), "aenv-transition")


class _OwnThreadContext(ThreadSensitiveContext):
    """asgiref's thread-sensitive context, entered even inside a request's (asgiref's own
    does nothing when nested), with a one-worker executor lent by ``POOL``."""

    def __init__(self):
        super().__init__()
        self.executor = POOL.take()

    async def __aenter__(self):
        self.token = SyncToAsync.thread_sensitive_context.set(self)
        SyncToAsync.context_to_thread_executor[self] = self.executor
        return self

    async def __aexit__(self, exc, value, tb):
        SyncToAsync.context_to_thread_executor.pop(self, None)
        SyncToAsync.thread_sensitive_context.reset(self.token)
        self.token = None
        POOL.give(self.executor)  # its connections were checked on it (on_a_thread_of_its_own)


async def on_a_thread_of_its_own(coro):
    """Awaits ``coro`` with its thread-sensitive ``sync_to_async`` calls on a thread of its own,
    not on its caller's request's, and that thread's database connections closed at the end
    as a request's are (``close_old_connections``: closed unless persistent and still sound)."""
    async with _OwnThreadContext() as context:
        try:
            return await coro
        finally:
            # on that thread itself (not through sync_to_async: inside an async_to_sync bridge
            # that would be the caller's thread, whose connection is not ours to close). Not
            # waited for: the executor has one worker, so the check runs before anything its
            # next user hands it, and the answer does not wait a thread round trip more for it
            # (every create, pause, resume, snapshot and fork: issue 26).
            context.executor.submit(close_old_connections).add_done_callback(_log_failure)


def _log_failure(done) -> None:
    if not done.cancelled() and done.exception() is not None:
        log.warning("closing a transition thread's database connections failed: %r", done.exception())
