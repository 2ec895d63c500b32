"""Reading lifecycle events and webhook deliveries, team by team, the way E2B pages them:
events by ``offset`` / ``limit`` (newest first unless ``orderAsc``), deliveries by an
opaque ``cursor``."""
from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from datetime import timedelta

from events import catalog, ingest
from events.models import DeliveryStatus, LifecycleEvent, Webhook, WebhookAttempt, WebhookDelivery
from sandboxes.errors import Invalid, NotFound
from sandboxes.models import Sandbox, Team


def events(team: Team, *, sandbox_id: str | None = None, offset: int = 0, limit: int = 10,
           order_asc: bool = False, types: list[str] | None = None) -> list[dict]:
    """A page of the team's lifecycle events (of one sandbox when ``sandbox_id``). The
    events recorded since the sweeper's last pass are made first, so a caller sees its own
    operations. A sandbox the team never had is NotFound (another team's too)."""
    ingest.catch_up()
    rows = LifecycleEvent.objects.filter(team=team)
    if sandbox_id is not None:
        rows = rows.filter(sandbox_id=sandbox_id)
        if not rows.exists() and not Sandbox.objects.filter(pk=sandbox_id, team=team).exists():
            raise NotFound("Sandbox events not found")
    cutoff = ingest.retention_cutoff()
    if cutoff is not None:  # the sweeper deletes them; until it has, they are not served
        rows = rows.filter(timestamp__gte=cutoff)
    if types:
        rows = rows.filter(type__in=types)
    rows = rows.order_by("seq" if order_asc else "-seq")
    return [row.payload for row in rows[offset:offset + limit]]


@dataclass
class DeliveryPage:
    data: list[dict]
    next_cursor: str | None


def _cursor(value: int) -> str:
    return base64.urlsafe_b64encode(f"seq:{value}".encode()).decode().rstrip("=")


def _position(cursor: str) -> int:
    try:
        text = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        kind, _, value = text.partition(":")
        if kind != "seq":
            raise ValueError(kind)
        return int(value)
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise Invalid("cursor: not a cursor this API gave") from None


def attempt_view(attempt, delivery: WebhookDelivery) -> dict:
    """E2B's ``WebhookDelivery``: one attempt."""
    return {"id": str(attempt.id), "teamId": str(delivery.webhook.team_id), "webhookId": str(delivery.webhook_id),
            "eventId": str(delivery.event_id), "sandboxId": delivery.event.sandbox_id,
            "eventType": delivery.event.type, "status": "success" if attempt.ok else "failed",
            "durationMs": int(round(attempt.duration_ms)), "requestUrl": attempt.request_url,
            "responseBody": attempt.response_body or None, "responseHttpStatusCode": attempt.status_code,
            "errorClass": attempt.error_class or None, "errorMessage": attempt.error_message or None,
            "timestamp": catalog.iso(attempt.started_at), "attemptNumber": attempt.number}


def deliveries(hook: Webhook, *, limit: int = 25, cursor: str | None = None, order_asc: bool = False,
               start=None, end=None, statuses: list[str] | None = None,
               event_types: list[str] | None = None) -> DeliveryPage:
    """E2B's ``WebhookDeliveriesListPayload``: the webhook's deliveries, one group per event
    with its attempts, newest event first unless ``order_asc``; ``status`` is aenv's state
    of the whole delivery (pending, success, failed)."""
    rows = WebhookDelivery.objects.filter(webhook=hook).select_related("event", "webhook")
    if statuses:
        rows = rows.filter(status__in=statuses)
    if event_types:
        rows = rows.filter(event__type__in=event_types)
    if start is not None:
        rows = rows.filter(event__timestamp__gte=start)
    if end is not None:
        rows = rows.filter(event__timestamp__lt=end)
    if cursor:
        at = _position(cursor)
        rows = rows.filter(event__seq__gt=at) if order_asc else rows.filter(event__seq__lt=at)
    rows = list(rows.order_by("event__seq" if order_asc else "-event__seq").prefetch_related("attempt_log")
                [:limit + 1])
    more = len(rows) > limit
    rows = rows[:limit]
    data = [{"eventId": str(d.event_id), "eventType": d.event.type, "sandboxId": d.event.sandbox_id,
             "status": d.status, "attemptCount": d.attempts,
             "nextAttemptAt": catalog.iso(d.next_attempt_at) if d.status == DeliveryStatus.PENDING else None,
             "attempts": [attempt_view(a, d) for a in d.attempt_log.all()]} for d in rows]
    return DeliveryPage(data, _cursor(rows[-1].event.seq) if more and rows else None)


def _durations(values: list[float]) -> dict:
    if not values:
        return {"minimum": 0.0, "average": 0.0, "maximum": 0.0}
    return {"minimum": round(min(values), 1), "average": round(sum(values) / len(values), 1),
            "maximum": round(max(values), 1)}


MAX_STATS_RANGE = timedelta(days=31)


def stats(hook: Webhook, start, end) -> dict:
    """E2B's ``WebhookDeliveryStats``: the webhook's attempts in [start, end) — how many, how
    many failed, their durations — in buckets of an hour (a day when the range is longer than
    two days); a range of at most 31 days."""
    if start >= end or end - start > MAX_STATS_RANGE:
        raise Invalid("start must be before end, at most 31 days before it")
    step = timedelta(hours=1) if end - start <= timedelta(days=2) else timedelta(days=1)
    rows = list(WebhookAttempt.objects.filter(delivery__webhook=hook, started_at__gte=start, started_at__lt=end)
                .values_list("started_at", "ok", "duration_ms"))
    count = -(-(end - start) // step)
    grouped: list[list] = [[] for _ in range(count)]
    for row in rows:
        grouped[(row[0] - start) // step].append(row)
    buckets = [{"timestamp": catalog.iso(start + i * step), "total": len(inside),
                "failed": sum(1 for r in inside if not r[1]), "durationMs": _durations([r[2] for r in inside])}
               for i, inside in enumerate(grouped)]
    return {"buckets": buckets, "total": len(rows), "failed": sum(1 for r in rows if not r[1]),
            "durationMs": _durations([r[2] for r in rows])}
