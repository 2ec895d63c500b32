"""Turns newly recorded ``SandboxEvent`` rows into lifecycle events and queues their
webhook deliveries.

Why a cursor with a look-back: PostgreSQL hands out ids when a row is inserted, not when
it commits, so an event may become visible after one with a higher id was read. Each pass
reads again the ``LOOKBACK`` ids below the cursor and skips events already made (the
one-to-one ``source``); making an event twice is impossible (the unique ``source``), so
several passes (the sweeper, an API request) may run at once."""
from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from events import catalog
from events.models import IngestCursor, LifecycleEvent, Webhook, WebhookDelivery
from sandboxes.models import SandboxEvent

LOOKBACK = 1000
BATCH = 2000


def retention_cutoff(now=None):
    """Events before this are not served (and are deleted by ``events.retention``); None: kept forever."""
    days = settings.AENV_EVENT_RETENTION_DAYS
    return None if days <= 0 else (now or timezone.now()) - timedelta(days=days)


def catch_up(now=None, batch: int = BATCH) -> int:
    """One pass: makes the lifecycle events of up to ``batch`` new recorded events (and
    their deliveries to the webhooks that want them); returns how many were made."""
    cursor = IngestCursor.objects.filter(pk=1).first() or _cursor()
    top = SandboxEvent.objects.order_by("-id").values_list("id", flat=True).first() or 0
    rows = (SandboxEvent.objects.filter(catalog.public_q(), id__gt=max(0, cursor.last_id - LOOKBACK),
                                        id__lte=top, lifecycle__isnull=True)
            .select_related("sandbox").order_by("id"))
    cutoff = retention_cutoff(now)
    if cutoff is not None:
        rows = rows.filter(started_at__gte=cutoff - timedelta(days=1))  # when() is a little later
    rows = list(rows[:batch])
    made = [made for made in (_make(row, cutoff) for row in rows) if made is not None]
    last = rows[-1].id if len(rows) == batch else top
    if last > cursor.last_id:
        IngestCursor.objects.filter(pk=1, last_id=cursor.last_id).update(last_id=last)
    if made:
        _queue_deliveries(made)
    return len(made)


def _cursor() -> IngestCursor:
    try:
        with transaction.atomic():
            return IngestCursor.objects.create(pk=1)
    except IntegrityError:  # another pass made it first
        return IngestCursor.objects.get(pk=1)


def _make(row: SandboxEvent, cutoff) -> LifecycleEvent | None:
    type_ = catalog.type_of(row)
    if type_ is None or (cutoff is not None and catalog.when(row) < cutoff):
        return None
    event = LifecycleEvent(team_id=row.sandbox.team_id, sandbox_id=row.sandbox_id, type=type_,
                           timestamp=catalog.when(row), seq=row.id, source=row)
    event.payload = catalog.payload(row, row.sandbox, type_, event.id)
    try:
        with transaction.atomic():
            event.save(force_insert=True)
    except IntegrityError:  # another pass made this one
        return None
    return event


def _queue_deliveries(made: list[LifecycleEvent]) -> None:
    """A pending delivery of each new event to each enabled webhook of its team that wants
    its type and existed when it happened."""
    teams = {event.team_id for event in made}
    hooks: dict = {}
    for hook in Webhook.objects.filter(team_id__in=teams, enabled=True):
        hooks.setdefault(hook.team_id, []).append(hook)
    now = timezone.now()  # due at once (an event's own time may lie a few ms ahead of the clock)
    deliveries = [WebhookDelivery(webhook=hook, event=event, next_attempt_at=now)
                  for event in made for hook in hooks.get(event.team_id, ())
                  if event.type in hook.events and hook.created_at <= event.timestamp]
    WebhookDelivery.objects.bulk_create(deliveries, ignore_conflicts=True)
