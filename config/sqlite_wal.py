"""What a new SQLite connection costs, kept off the request path: one idle connection per
process and database file, held open for the process's life; and, in the servers whose threads
are pooled, each thread's connection kept across requests (``keep_thread_connections``).

Why: Django opens a connection per request thread (a new thread per ASGI request) and closes
it when the request ends (CONN_MAX_AGE=0). In WAL mode the *last* connection to a database
that closes checkpoints the WAL into the file and deletes the WAL and its index, and the next
open builds them again: ~2.5 ms per request on this host against ~0.2 ms with another
connection still open (docs/benchmarks.md, bench/control_plane.py), 13 % of the API's CPU on
a lifecycle call. This connection is that other one: it read once (so it holds the WAL's
shared lock) and never runs a transaction, so it blocks no writer and no checkpoint; commits
still checkpoint the WAL when it grows (SQLite's automatic checkpoint), and every commit is as
durable as before (same journal mode and synchronous level).

A forked child gets its own; the one it inherited is kept referenced, never closed (closing
a SQLite handle in a child would drop the parent's POSIX locks on the file)."""
from __future__ import annotations

import os
import sqlite3
import threading

from django.db.backends.signals import connection_created

_held: dict[tuple[int, str], sqlite3.Connection] = {}
_lock = threading.Lock()


def _hold(sender, connection, **kwargs) -> None:
    if connection.vendor != "sqlite" or connection.is_in_memory_db():
        return
    key = (os.getpid(), str(connection.settings_dict["NAME"]))
    if key in _held:
        return
    with _lock:
        if key in _held:
            return
        keeper = sqlite3.connect(key[1], timeout=30, check_same_thread=False, isolation_level=None)
        keeper.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchall()  # opens the WAL, ends the read
        _held[key] = keeper


def install() -> None:
    """Every SQLite connection Django opens makes sure its file has a keeper in this process."""
    connection_created.connect(_hold, dispatch_uid="aenv-sqlite-wal-keeper")


def keep_thread_connections(settings) -> None:
    """A server process whose threads are pooled (the API's request and transition threads, the
    data plane's executor) keeps each thread's SQLite connection open across requests, checked
    before reuse and at every request's end (Django's ``close_old_connections``: closed after an
    error or with a transaction left open). Why: a new SQLite connection parses the whole schema
    at its first statement (~0.8 ms of CPU on a loaded host, issue 26), and the API opened two
    per create or pause. PostgreSQL is left to its pool (which persistent connections would
    bypass). Call before the process's first connection."""
    if settings.DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
        settings.DATABASES["default"].update(CONN_MAX_AGE=None, CONN_HEALTH_CHECKS=True)


def held() -> list[str]:
    """The files this process holds open (tests)."""
    return [path for pid, path in _held if pid == os.getpid()]
