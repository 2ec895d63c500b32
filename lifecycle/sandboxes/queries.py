"""Reads: one sandbox, the v1 list and the keyset-paginated v2 list, and the page tokens
and metadata filters they take (shared with the snapshot list)."""
from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from datetime import datetime

from django.db.models import Q
from django.db.models.fields.json import KeyTransform

from sandboxes.models import Sandbox, Team
from sandboxes.states import E2B_PAUSED, E2B_RUNNING
from lifecycle.sandboxes import core
from sandboxes.errors import Invalid


async def get_sandbox(team: Team, sandbox_id: str) -> Sandbox:
    return await core.visible(team, sandbox_id)


def decode_metadata_filter(raw: str | None) -> dict[str, str]:
    """The SDK's triple-encoded ``metadata`` query value (already URL-decoded once
    by Django) → ``{key: value}``: parse as form data, then percent-decode each
    key and value once more (spec §2.5)."""
    from urllib.parse import parse_qsl, unquote  # noqa: PLC0415

    if not raw:
        return {}
    try:
        pairs = parse_qsl(raw, keep_blank_values=True, strict_parsing=True)
    except ValueError as exc:
        raise Invalid(f"metadata filter must look like key=value&key2=value2: {exc}") from exc
    return {unquote(k): unquote(v) for k, v in pairs}


def _apply_metadata(qs, metadata: dict[str, str]):
    for i, (key, value) in enumerate(metadata.items()):
        alias = f"_meta_{i}"
        qs = qs.annotate(**{alias: KeyTransform(key, "metadata")}).filter(**{alias: value})
    return qs


async def list_running(team: Team, metadata: dict[str, str] | None = None) -> list[Sandbox]:
    """v1 list: every running sandbox of the team, newest first."""
    qs = Sandbox.objects.filter(team=team, state__in=E2B_RUNNING)
    qs = _apply_metadata(qs, metadata or {}).order_by("-started_at", "-id")
    return [s async for s in qs]


@dataclass
class Page:
    items: list
    next_token: str | None


def encode_page_token(when: datetime, pk: str) -> str:
    """Opaque ``nextToken`` of a keyset page: the last row's (timestamp, id)."""
    raw = json.dumps([when.isoformat(), pk]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_page_token(token: str) -> tuple[datetime, str]:
    """``encode_page_token``'s (timestamp, id); anything else is a 400."""
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        stamp, pk = json.loads(raw)
        when = datetime.fromisoformat(stamp)
        if not isinstance(pk, str) or when.tzinfo is None:
            raise ValueError("bad token contents")
        return when, pk
    except (ValueError, TypeError, binascii.Error, UnicodeDecodeError, RecursionError) as exc:
        raise Invalid("invalid nextToken") from exc


async def list_sandboxes(
    team: Team,
    *,
    states: list[str] | None = None,
    metadata: dict[str, str] | None = None,
    order: str = "desc",
    started_after: datetime | None = None,
    template: str | None = None,
    limit: int = 100,
    next_token: str | None = None,
) -> Page:
    """v2 list: keyset pagination on (started_at, id) so pages never repeat or skip
    a sandbox even while others are created or killed between calls."""
    db_states: list[str] = []
    for state in states or ["running", "paused"]:
        db_states += E2B_RUNNING if state == "running" else E2B_PAUSED
    qs = Sandbox.objects.filter(team=team, state__in=db_states)
    qs = _apply_metadata(qs, metadata or {})
    if started_after is not None:
        qs = qs.filter(started_at__gte=started_after)
    if template:
        qs = qs.filter(Q(template_id=template) | Q(template__alias=template))
    if next_token:
        when, last_id = decode_page_token(next_token)
        if order == "asc":
            qs = qs.filter(Q(started_at__gt=when) | Q(started_at=when, id__gt=last_id))
        else:
            qs = qs.filter(Q(started_at__lt=when) | Q(started_at=when, id__lt=last_id))
    qs = qs.order_by(*(["started_at", "id"] if order == "asc" else ["-started_at", "-id"]))
    rows = [s async for s in qs[: limit + 1]]
    more = len(rows) > limit
    rows = rows[:limit]
    return Page(rows, encode_page_token(rows[-1].started_at, rows[-1].id) if more else None)
