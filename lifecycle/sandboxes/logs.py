"""Reading the sandbox logs the nodes collect from their guests' consoles
(``agent.console_logs``): E2B's ``GET /sandboxes/{id}/logs`` (v1: from a millisecond
``start``, oldest first) and ``GET /v2/sandboxes/{id}/logs`` (v2: from a millisecond
``cursor`` forward or backward, a minimum level, a substring, and an opaque ``pageCursor``
/ ``nextCursor`` for the next page).

Team-scoped like every sandbox read (another team's sandbox is not found), and for any
sandbox the team has had, running, paused or killed, as long as its lines are kept
(``AENV_SANDBOX_LOGS_RETENTION``)."""
from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from datetime import datetime, timezone

from django.db.models import Q, Value
from django.db.models.functions import StrIndex

from lifecycle.sandboxes.core import visible
from sandboxes.errors import Invalid
from sandboxes.models import SandboxLog, Team
from sandboxes.states import SandboxState

LEVELS = ("debug", "info", "warn", "error")
FORWARD, BACKWARD = "forward", "backward"
ANY_STATE = [state.value for state in SandboxState]


def _at(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc)


@dataclass(frozen=True)
class Page:
    lines: list[SandboxLog]
    next_cursor: str | None = None


async def logs_from(team: Team, sandbox_id: str, start: int | None, limit: int) -> list[SandboxLog]:
    """v1: the sandbox's lines from ``start`` (ms, inclusive), oldest first, at most ``limit``."""
    sandbox = await visible(team, sandbox_id, states=ANY_STATE)
    qs = SandboxLog.objects.filter(sandbox=sandbox)
    if start is not None:
        qs = qs.filter(timestamp__gte=_at(start))
    return [line async for line in qs.order_by("timestamp", "id")[:limit]] if limit else []


async def logs_page(team: Team, sandbox_id: str, *, cursor: int | None = None, limit: int = 1000,
                    direction: str = FORWARD, level: str | None = None, search: str | None = None,
                    page_cursor: str | None = None) -> Page:
    """v2: ``forward`` from ``cursor`` (ms, inclusive; default: the first line) oldest
    first, or ``backward`` from it (default: now) newest first; lines of ``level`` and
    above whose message contains ``search``. A full page carries ``next_cursor``, which
    continues exactly after its last line (``page_cursor``; ``cursor`` is then ignored)."""
    sandbox = await visible(team, sandbox_id, states=ANY_STATE)
    qs = SandboxLog.objects.filter(sandbox=sandbox)
    if level:
        qs = qs.filter(level__in=LEVELS[LEVELS.index(level):])
    if search:  # case-sensitive on every database (SQLite's LIKE is not)
        qs = qs.annotate(found_at=StrIndex("message", Value(search))).filter(found_at__gt=0)
    after = _decode(page_cursor, direction) if page_cursor else None
    if direction == FORWARD:
        if after is not None:
            qs = qs.filter(Q(timestamp__gt=after[0]) | Q(timestamp=after[0], id__gt=after[1]))
        elif cursor is not None:
            qs = qs.filter(timestamp__gte=_at(cursor))
        qs = qs.order_by("timestamp", "id")
    else:
        if after is not None:
            qs = qs.filter(Q(timestamp__lt=after[0]) | Q(timestamp=after[0], id__lt=after[1]))
        elif cursor is not None:
            qs = qs.filter(timestamp__lte=_at(cursor))
        qs = qs.order_by("-timestamp", "-id")
    if not limit:
        return Page([])
    lines = [line async for line in qs[:limit + 1]]
    if len(lines) <= limit:
        return Page(lines)
    lines = lines[:limit]
    return Page(lines, _encode(direction, lines[-1]))


def _encode(direction: str, line: SandboxLog) -> str:
    raw = json.dumps({"d": direction, "t": line.timestamp.isoformat(), "i": line.pk}, separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def _decode(token: str, direction: str) -> tuple[datetime, int]:
    try:
        data = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
        at, pk = datetime.fromisoformat(data["t"]), int(data["i"])
        if at.tzinfo is None:
            raise ValueError("naive timestamp")
    except (binascii.Error, ValueError, TypeError, KeyError, UnicodeDecodeError):
        raise Invalid("pageCursor is not a cursor this API returned") from None
    if data.get("d") != direction:
        raise Invalid(f"pageCursor continues a {data.get('d')} page, not a {direction} one")
    return at, pk
