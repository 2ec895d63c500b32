"""config.request_threads: each API request's sync code on a thread lent from a pool, not on
two threads made per request (asgiref's ThreadSensitiveContext): one thread per request while
it runs, concurrent requests on different threads, threads reused, the database connection
checked at the request's end (closed, or kept when persistent and sound), a task outliving its
request still served."""
from __future__ import annotations

import asyncio
import threading

import pytest
from asgiref.sync import sync_to_async
from django.db import connection

from config import request_threads
from config.request_threads import ExecutorPool, PooledThreadContext


@pytest.fixture
def pool(monkeypatch):
    fresh = ExecutorPool(idle_max=4, thread_name="aenv-request")
    monkeypatch.setattr(request_threads, "POOL", fresh)
    return fresh


async def _idents(n: int = 2) -> list[int]:
    async with PooledThreadContext():
        return [await sync_to_async(threading.get_ident)() for _ in range(n)]


def test_a_request_runs_on_one_thread_and_the_next_reuses_it(pool):
    first = asyncio.run(_idents(3))
    second = asyncio.run(_idents(3))
    assert len(set(first)) == 1 and first == second
    assert pool.made == 1 and pool.idle() == 1


def test_concurrent_requests_get_threads_of_their_own(pool):
    barrier = threading.Barrier(2, timeout=10)  # both sync calls at once: deadlocks on one thread

    async def request():
        async with PooledThreadContext():
            return await sync_to_async(lambda: barrier.wait() is not None and threading.get_ident())()

    async def both():
        return await asyncio.gather(request(), request())

    a, b = asyncio.run(both())
    assert a != b and pool.made == 2 and pool.idle() == 2
    assert asyncio.run(_idents(1))[0] in (a, b) and pool.made == 2


def test_a_nested_context_keeps_the_outer_thread(pool):
    async def nested():
        async with PooledThreadContext():
            outer = await sync_to_async(threading.get_ident)()
            async with PooledThreadContext():
                inner = await sync_to_async(threading.get_ident)()
            return outer, inner, await sync_to_async(threading.get_ident)()

    outer, inner, after = asyncio.run(nested())
    assert outer == inner == after and pool.made == 1


def test_a_task_outliving_its_request_gets_a_thread_of_its_own(pool):
    async def main():
        release = asyncio.Event()

        async def shielded():  # as lifecycle's shielded transitions: writes after the request
            await release.wait()
            return await sync_to_async(threading.get_ident)()

        async with PooledThreadContext():
            lent = await sync_to_async(threading.get_ident)()
            task = asyncio.ensure_future(shielded())
        release.set()
        return lent, await asyncio.wait_for(task, 10)

    lent, later = asyncio.run(main())
    assert later != lent and pool.idle() == 1


def test_the_idle_threads_are_capped(pool):
    async def many():
        gate = threading.Barrier(6, timeout=10)

        async def request():
            async with PooledThreadContext():
                await sync_to_async(gate.wait)()

        await asyncio.gather(*(request() for _ in range(6)))

    asyncio.run(many())
    assert pool.made == 6 and pool.idle() == 4


async def _status(app, path: str, headers: tuple = ()) -> int:
    """One request through ``app`` (Django's ASGI handler); its status."""
    sent, asked = [], []

    async def receive():
        if asked:  # after the body: the client waits (Django listens for a disconnect)
            await asyncio.Event().wait()
        asked.append(1)
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"testserver"), *headers], "client": ("127.0.0.1", 1), "server": ("testserver", 80)}
    await app(scope, receive, send)
    return sent[0]["status"]


@pytest.fixture
def opened():
    """The threads on which a database connection was opened, in order."""
    from django.db.backends.signals import connection_created  # noqa: PLC0415

    threads = []

    def created(sender, connection, **kwargs):
        threads.append(threading.get_ident())

    connection_created.connect(created)
    yield threads
    connection_created.disconnect(created)


KEY = (b"x-api-key", b"e2b_" + b"0" * 40)  # looked up in the database: a statement per request


@pytest.mark.django_db(transaction=True)
def test_the_api_handler_reuses_threads_and_closes_a_pooled_connection_each_request(pool, monkeypatch, opened):
    """CONN_MAX_AGE=0 (PostgreSQL's, whose connections come from its pool): closed at each end."""
    from config.asgi import django_asgi_app  # noqa: PLC0415

    monkeypatch.setitem(connection.settings_dict, "CONN_MAX_AGE", 0)
    assert isinstance(django_asgi_app, request_threads.PooledThreadsASGIHandler)
    statuses = [asyncio.run(_status(django_asgi_app, "/health")) for _ in range(2)] + [
        asyncio.run(_status(django_asgi_app, "/sandboxes", (KEY,))) for _ in range(3)]
    # The lent thread's connection was closed at the end of the last request.
    thread = next(iter(pool._idle))
    still_open = thread.submit(lambda: connection.connection is not None).result(timeout=10)
    assert statuses == [204, 204, 401, 401, 401]
    assert pool.made == 1 and not still_open
    # A connection per request that reads (closed at its end), all on the one lent thread.
    assert len(opened) == 3 and len(set(opened)) == 1


@pytest.mark.django_db(transaction=True)
def test_the_api_keeps_a_sound_sqlite_connection_per_thread_and_closes_a_broken_one(pool, opened):
    """SQLite (config.asgi: CONN_MAX_AGE=None): a thread's connection serves its next requests
    (a new one parses the whole schema again); one left with a transaction open is closed.
    PostgreSQL: a connection per request, from and back to its pool."""
    from config.asgi import django_asgi_app  # noqa: PLC0415

    statuses = [asyncio.run(_status(django_asgi_app, "/sandboxes", (KEY,))) for _ in range(3)]
    thread = next(iter(pool._idle))
    still_open = thread.submit(lambda: connection.connection is not None).result(timeout=10)
    assert statuses == [401] * 3
    if connection.vendor != "sqlite":  # PostgreSQL: left to its pool (a persistent one would bypass it)
        assert connection.settings_dict["CONN_MAX_AGE"] == 0
        assert not still_open and len(opened) == 3
        return
    assert connection.settings_dict["CONN_MAX_AGE"] is None  # config.asgi's setting for SQLite
    assert still_open and len(opened) == 1

    def leave_a_transaction_open():
        from django.db import transaction  # noqa: PLC0415

        transaction.set_autocommit(False)
        connection.cursor().execute("SELECT 1")

    # a request's last call leaves a transaction open; the request's end (request_finished, on
    # its thread) closes that connection, and the thread's next request opens a new one
    from django.core import signals  # noqa: PLC0415

    def a_request_that_leaves_a_transaction_open():
        leave_a_transaction_open()
        signals.request_finished.send(sender=request_threads.PooledThreadsASGIHandler)

    thread.submit(a_request_that_leaves_a_transaction_open).result(timeout=10)
    assert thread.submit(lambda: connection.connection is None).result(timeout=10)
    assert asyncio.run(_status(django_asgi_app, "/sandboxes", (KEY,))) == 401
    assert len(opened) == 2 and len(set(opened)) == 1
    assert thread.submit(lambda: connection.get_autocommit()).result(timeout=10)


@pytest.mark.django_db(transaction=True)
def test_a_request_takes_no_thread_hop_before_its_view_for_djangos_start_signal(pool, monkeypatch):
    """Django's start-of-request connection check was a thread hop before every view (the end's
    check is the one that counts: a lent thread's last request ran it, config.request_threads)."""
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

    from django.core import signals  # noqa: PLC0415
    from django.db import close_old_connections  # noqa: PLC0415

    # the API's handler as config.asgi makes it (made again here: Django's test client puts the
    # start's check back after each of its requests, and other tests of this process use it)
    django_asgi_app = request_threads.get_asgi_application()
    assert close_old_connections not in signals.request_started._live_receivers(None)[0]
    assert close_old_connections in signals.request_finished._live_receivers(None)[0]
    submitted = []
    real_submit = ThreadPoolExecutor.submit

    def counting(self, fn, *a, **k):
        submitted.append(fn)
        return real_submit(self, fn, *a, **k)

    monkeypatch.setattr(ThreadPoolExecutor, "submit", counting)
    assert asyncio.run(_status(django_asgi_app, "/health")) == 204
    assert len(submitted) == 1  # the end's check (response.close → request_finished), nothing before
