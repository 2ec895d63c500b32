"""The only writer of a build's status and of its log.

Why one place (like ``sandboxes.transitions`` for sandboxes): a status change must be
legal (the table below), must win against concurrent writers (a conditional ``UPDATE …
WHERE status IN expected``: a builder finishing a build that a delete just cancelled
loses) and must be on disk, with the log entries that explain it, before anyone can
read it. The API, the node's builder (``progress``) and the staleness checks all write
through here; a build row is inserted ``waiting`` (not a transition).

The record of each change (what ``SandboxEvent`` is for a sandbox) is the build's own
log: every status change the code makes comes with a log entry saying why ("Build
started on node …", "could not hand the build to node …", "Build failed: …", "Build
finished, took …"), appended in the same transaction, so the log the SDK streams is
also the build's history. No separate event table: it would say the same thing twice.
``tests/unit/test_build_states.py`` checks that every caller passes one (test fixtures
may move a build without). An operation that does not start from the build's status is
refused like a lost race: False, nothing written.

Log entries get consecutive indices (the SDK's ``logsOffset`` counts them): an append
first bumps the build's ``log_count`` (which takes the row's write lock, on SQLite the
database's) and numbers its entries below the new count, so concurrent appends never
share an index.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from asgiref.sync import sync_to_async
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from template_builds.models import BuildLogEntry, BuildStatus as B, LogLevel, TemplateBuild

# operation → (the statuses it may start from, the status it sets)
TRANSITIONS: dict[str, tuple[frozenset[str], str]] = {
    # the control plane handed the build to a node
    "start": (frozenset({B.WAITING}), B.BUILDING),
    # the node could not be reached: the build may be started again
    "requeue": (frozenset({B.BUILDING}), B.WAITING),
    # the builder produced the result
    "succeed": (frozenset({B.BUILDING}), B.READY),
    # the builder failed it, the start body names something impossible, a newer build
    # superseded it, its template was deleted, or its node went away
    "fail": (frozenset({B.WAITING, B.BUILDING}), B.ERROR),
}
# Derived from the table: moving on (some operation starts from them), or done.
ACTIVE = frozenset().union(*(start for start, _ in TRANSITIONS.values()))
FINISHED = frozenset(B) - ACTIVE
MAX_MESSAGE = 64 * 1024
MAX_STEP = 32


class IllegalTransition(Exception):
    """An operation the table does not know: a bug in the caller."""


def is_legal(operation: str, status: str) -> bool:
    """Whether ``operation`` may move a build whose status is ``status``."""
    start, _ = TRANSITIONS.get(operation, (frozenset(), ""))
    return status in start


@dataclass(frozen=True)
class Log:
    """A log entry to append."""

    level: str
    message: str
    step: str = ""
    timestamp: datetime | None = None

    def checked(self) -> "Log":
        if self.level not in LogLevel.values:
            raise ValueError(f"log level must be one of {', '.join(LogLevel.values)}, not {self.level!r}")
        return Log(self.level, str(self.message)[:MAX_MESSAGE], str(self.step or "")[:MAX_STEP], self.timestamp)


def _append(build_id, logs: list[Log], only_if=None) -> bool:
    """Appends ``logs`` (inside the caller's transaction); with ``only_if``, only while the
    build's status is one of those. False if the build is gone (or not in ``only_if``)."""
    qs = TemplateBuild.objects.filter(pk=build_id)
    if only_if is not None:
        qs = qs.filter(status__in=list(only_if))
    if not logs:
        return qs.exists()
    if not qs.update(log_count=F("log_count") + len(logs)):
        return False
    end = TemplateBuild.objects.filter(pk=build_id).values_list("log_count", flat=True).get()
    first = end - len(logs)
    now = timezone.now()
    BuildLogEntry.objects.bulk_create([
        BuildLogEntry(build_id=build_id, index=first + i, timestamp=log.timestamp or now, level=log.level,
                      message=log.message, step=log.step)
        for i, log in enumerate(logs)
    ])
    return True


def transition_sync(build_id, operation: str, *, logs=(), where: dict | None = None, **fields) -> bool:
    """Moves the build along ``operation`` if its status allows it (and it matches the
    extra lookups in ``where``), setting ``fields`` and appending ``logs`` (the change's
    record) in the same transaction. False if another writer won, the status is not one
    the operation starts from, or the build is gone."""
    if operation not in TRANSITIONS:
        raise IllegalTransition(f"unknown build operation {operation!r}")
    start, to = TRANSITIONS[operation]
    logs = [log.checked() for log in logs]
    with transaction.atomic():
        updated = TemplateBuild.objects.filter(pk=build_id, status__in=list(start), **(where or {})).update(
            status=to, updated_at=timezone.now(), **fields)
        if updated:
            _append(build_id, logs)
    return bool(updated)


def append_sync(build_id, logs, *, only_if=ACTIVE) -> bool:
    """Appends log entries to a build still in ``only_if`` (default: not finished);
    False when it is not (any more)."""
    logs = [log.checked() for log in logs]
    with transaction.atomic():
        return _append(build_id, logs, only_if)


def mark_accepted_sync(build_id, node_id: str) -> bool:
    """The node's builder picked the build up (no status change); False unless the build
    is building on that node."""
    return bool(TemplateBuild.objects.filter(pk=build_id, status=B.BUILDING, node_id=node_id).update(
        accepted_at=timezone.now(), updated_at=timezone.now()))


transition = sync_to_async(transition_sync)
append = sync_to_async(append_sync)
