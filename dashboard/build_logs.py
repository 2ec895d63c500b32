"""The live log of a template build: a WebSocket
(``/ws/templates/<template_id>/builds/<build_id>/logs?offset=N``) that the build page
reads.

Protocol (server → browser only; whatever the browser sends is ignored). Text frames,
JSON: ``{"type": "log", "index", "timestamp", "level", "step", "message"}`` for each
entry from ``offset`` on, in order; ``{"type": "status", "status", "reason", "step"}``
first and whenever the status changes; last ``{"type": "close", "code", "reason"}``
before the close (daphne drops close reasons). Once the build is ``ready`` or ``error``
and every entry was sent it closes normally (1000); a client whose socket drops resumes
with ``offset`` = the index after the last entry it got.

The log's writer is a node's builder in another process (``template_builds.progress``),
so the database is the truth: the consumer polls it (``index >= next``) every
``POLL_SECONDS`` while the socket is open, and stops when it closes. Like the API's
status poll it fails a build whose node or builder went away
(``lifecycle.templates.common.settle_stale``), so a watched build always ends.
Only members of the build's team (the dashboard's current team) may open it; anything
else looks like a missing build."""
from __future__ import annotations

import asyncio
import json
import logging
import uuid
from types import SimpleNamespace
from urllib.parse import parse_qsl

from channels.db import database_sync_to_async

from lifecycle.templates.common import settle_stale
from template_builds.models import BuildLogEntry, BuildStatus, TemplateBuild

from dashboard.teams import current_team
from dashboard.sockets import CLOSE_BAD_MESSAGE, CLOSE_NOT_FOUND, CLOSE_UNAUTHENTICATED, TaskSocket

log = logging.getLogger(__name__)

CLOSE_NORMAL = 1000
CLOSE_FAILED = 4500  # a bug in the consumer: the page may reconnect
POLL_SECONDS = 0.4
STALE_CHECK_SECONDS = 5.0  # how often a building build's node and deadlines are checked
BATCH = 500  # entries per query; a longer backlog is read in several without sleeping
FINISHED = (BuildStatus.READY, BuildStatus.ERROR)
TASK_PREFIX = "build-log-"


def parse_offset(scope) -> int | None:
    """The ``offset`` query parameter (default 0); None if it is not a count."""
    raw = dict(parse_qsl(scope.get("query_string", b"").decode("latin1"))).get("offset", "0")
    try:
        value = int(raw)
    except ValueError:
        return None
    return value if value >= 0 else None


def log_message(entry: BuildLogEntry) -> dict:
    return {"type": "log", "index": entry.index, "timestamp": entry.timestamp.isoformat(),
            "level": entry.level, "step": entry.step, "message": entry.message}


@database_sync_to_async
def _find_build_id(scope, template_id: str, build_id: str):
    """The build's id if it is a build of a live template of the user's current dashboard
    team, else None."""
    user = scope.get("user")
    if user is None or not user.is_authenticated:
        return None
    team = current_team(SimpleNamespace(user=user, session=scope["session"]))
    if team is None:
        return None
    try:
        bid = uuid.UUID(build_id)
    except ValueError:
        return None
    return (TemplateBuild.objects.filter(pk=bid, template_id=template_id, template__team=team,
                                         template__deleted_at__isnull=True)
            .values_list("pk", flat=True).first())


class BuildLogConsumer(TaskSocket):

    async def connect(self):
        kwargs = self.scope["url_route"]["kwargs"]
        user = self.scope.get("user")
        # Accept first, then close: a close before accept reaches the browser as a bare
        # failed handshake, without the code and reason the page shows.
        await self.accept()
        if user is None or not user.is_authenticated:
            return await self._finish(CLOSE_UNAUTHENTICATED, "sign in to see the build log")
        self.build_id = await _find_build_id(self.scope, kwargs["template_id"], kwargs["build_id"])
        if self.build_id is None:
            return await self._finish(CLOSE_NOT_FOUND, "build not found")
        offset = parse_offset(self.scope)
        if offset is None:
            return await self._finish(CLOSE_BAD_MESSAGE, "offset must be a whole number ≥ 0")
        self._task = asyncio.create_task(self._run(offset), name=f"{TASK_PREFIX}{self.build_id}")

    async def receive(self, text_data=None, bytes_data=None):
        """Nothing to receive: the log flows one way."""

    async def _run(self, offset: int) -> None:
        try:
            code, reason = await self._stream(offset)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never leave the socket open on a bug
            log.exception("build log %s failed", self.build_id)
            code, reason = CLOSE_FAILED, f"build log failed: {type(exc).__name__}"
        await self._finish(code, reason)

    async def _stream(self, next_index: int) -> tuple[int, str]:
        """Sends entries from ``next_index`` and status changes until the build has
        ended and its whole log was sent; returns the close code and reason."""
        loop = asyncio.get_running_loop()
        sent_status = None
        checked_at = loop.time()
        while True:
            # The row first: entries below its log_count were committed with it.
            row = await (TemplateBuild.objects.filter(pk=self.build_id)
                         .values("status", "reason_message", "reason_step", "log_count").afirst())
            if row is None:
                return CLOSE_NOT_FOUND, "the build was deleted"
            entries = [e async for e in BuildLogEntry.objects.filter(
                build_id=self.build_id, index__gte=next_index, index__lt=row["log_count"]).order_by("index")[:BATCH]]
            for entry in entries:
                await self.send(text_data=json.dumps(log_message(entry)))
                next_index = entry.index + 1
            if len(entries) == BATCH:
                continue  # more backlog: read on before anything else
            status = (row["status"], row["reason_message"], row["reason_step"])
            if status != sent_status:
                await self.send(text_data=json.dumps({"type": "status", "status": row["status"],
                                                      "reason": row["reason_message"], "step": row["reason_step"]}))
                sent_status = status
            if row["status"] in FINISHED and next_index >= row["log_count"]:
                return CLOSE_NORMAL, f"build {row['status']}"
            if row["status"] == BuildStatus.BUILDING and loop.time() - checked_at >= STALE_CHECK_SECONDS:
                checked_at = loop.time()
                build = await TemplateBuild.objects.filter(pk=self.build_id).afirst()
                if build is not None:
                    await settle_stale(build)
                continue  # a failed build's last entry and status go out now
            await asyncio.sleep(POLL_SECONDS)
