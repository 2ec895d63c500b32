"""Django's stock middlewares run in the event loop while they do no I/O
(config.inline_middleware), and in a thread when they do (a session to save, messages to
store, a CSRF check of a form); the process's SQLite keeper (config.sqlite_wal) keeps the WAL
from being checkpointed away and rebuilt by every request's close."""
import asyncio
import sqlite3
import threading
from types import SimpleNamespace
from unittest import mock

import pytest
from asgiref.sync import SyncToAsync
from django.http import HttpResponse
from django.test import RequestFactory

from config import inline_middleware as im
from config import sqlite_wal

pytestmark = pytest.mark.django_db(transaction=True)


def _middleware_hops(calls: list) -> list:
    from django.utils.deprecation import MiddlewareMixin  # noqa: PLC0415

    return [f for f in calls if isinstance(getattr(f, "__self__", None), MiddlewareMixin)]


async def test_an_api_request_takes_no_middleware_thread_hop(api):
    calls = []
    real = SyncToAsync.__init__

    def spy(self, func, *a, **kw):
        calls.append(func)
        real(self, func, *a, **kw)

    with mock.patch.object(SyncToAsync, "__init__", spy):
        resp = await api.get("/sandboxes")
    assert resp.status_code == 200, resp.text
    assert calls, "the request made no sync_to_async call at all: the spy saw nothing"
    assert _middleware_hops(calls) == []
    assert resp.headers["x-frame-options"] == "DENY"  # the inline hooks still did their work


def _loop_and_save_threads(middleware_cls, prepare, session=None):
    """Runs ``middleware_cls`` on an async request; returns (loop thread, thread that saved)."""
    seen = {}
    request = RequestFactory().get("/dashboard/")
    if session is not None:
        request.session = session

    async def view(req):
        prepare(req, seen)
        return HttpResponse("ok")

    async def run():
        seen["loop"] = threading.get_ident()
        mw = middleware_cls(view)
        return await mw(request)

    asyncio.run(run())
    return seen["loop"], seen.get("saved")


def test_a_modified_session_is_saved_in_a_thread():
    def prepare(req, seen):
        req.session["k"] = "v"
        req.session.save = lambda *a, **k: seen.__setitem__("saved", threading.get_ident())

    loop, saved = _loop_and_save_threads(im.Session, prepare)
    assert saved is not None and saved != loop


def test_an_untouched_session_is_answered_inline():
    calls = []
    with mock.patch("config.inline_middleware.sync_to_async", side_effect=lambda f, **k: calls.append(f)):
        loop, saved = _loop_and_save_threads(im.Session, lambda req, seen: None)
    assert saved is None and calls == []


def test_added_messages_are_stored_in_a_thread():
    from django.contrib import messages  # noqa: PLC0415

    def prepare(req, seen):
        messages.info(req, "hello")
        store = req._messages._store
        req._messages._store = lambda *a, **k: (seen.__setitem__("saved", threading.get_ident()), store(*a, **k))[1]

    loop, saved = _loop_and_save_threads(im.Messages, prepare, session={})  # messages overflow into it
    assert saved is not None and saved != loop


async def test_a_form_post_without_a_csrf_token_is_still_refused(anon):
    resp = await anon.post("/dashboard/login/", data={"username": "x", "password": "y"})
    assert resp.status_code == 403, resp.text


def _wal_after_close(path, keeper: bool) -> bool:
    setup = sqlite3.connect(path, isolation_level=None)
    setup.execute("PRAGMA journal_mode=WAL")
    setup.execute("CREATE TABLE IF NOT EXISTS t (x)")
    setup.close()
    if keeper:
        conn = SimpleNamespace(vendor="sqlite", is_in_memory_db=lambda: False, settings_dict={"NAME": path})
        sqlite_wal._hold(None, conn)
        sqlite_wal._hold(None, conn)  # once per file and process
    c = sqlite3.connect(path, isolation_level=None)
    c.execute("INSERT INTO t VALUES (1)")
    c.close()
    return (path.parent / (path.name + "-wal")).exists()


def test_the_keeper_keeps_the_wal_across_closes(tmp_path):
    assert _wal_after_close(tmp_path / "plain.sqlite3", keeper=False) is False  # the cost it avoids
    assert _wal_after_close(tmp_path / "kept.sqlite3", keeper=True) is True
    assert sqlite_wal.held().count(str(tmp_path / "kept.sqlite3")) == 1


def test_in_memory_databases_get_no_keeper():
    before = list(sqlite_wal.held())
    memory = SimpleNamespace(vendor="sqlite", is_in_memory_db=lambda: True, settings_dict={"NAME": ":memory:"})
    sqlite_wal._hold(None, memory)
    sqlite_wal._hold(None, SimpleNamespace(vendor="postgresql", settings_dict={"NAME": "aenv"}))
    assert sqlite_wal.held() == before
