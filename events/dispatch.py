"""Hands due delivery attempts to the control plane's events worker.

Why the sweeper hands them out (and not the request that caused the event): events are
recorded by many processes, nodes included, and a node must never send the control plane's
tasks; the lifecycle sweeper runs on the control plane, and each pass reads the database, so
an attempt whose task was lost (broker down, worker killed) is handed out again once its
lease runs out."""
from __future__ import annotations

import logging
from datetime import timedelta

from django.conf import settings
from django.db.models import Q
from django.utils import timezone

from events import delivery, ingest, retention
from events.models import DeliveryStatus, WebhookDelivery
from nodes.celery_app import app as celery_app

log = logging.getLogger(__name__)

DELIVER_WEBHOOK = "events.deliver_webhook"


def send_to_worker(delivery_id: str, number: int) -> None:
    celery_app.send_task(DELIVER_WEBHOOK, args=[delivery_id, number], queue=settings.AENV_WEBHOOK_QUEUE)


def enqueue_due(now=None, send=send_to_worker, limit: int = 200) -> int:
    """Leases each due attempt and sends its task; returns how many were sent."""
    now = now or timezone.now()
    due = (WebhookDelivery.objects.filter(status=DeliveryStatus.PENDING, next_attempt_at__lte=now)
           .filter(Q(lease_until__isnull=True) | Q(lease_until__lt=now)).order_by("next_attempt_at")
           .values_list("pk", "attempts", "lease_until")[:limit])
    sent = 0
    for pk, attempts, lease in due:
        leased = WebhookDelivery.objects.filter(pk=pk, status=DeliveryStatus.PENDING, attempts=attempts,
                                                lease_until=lease).update(
            lease_until=now + timedelta(seconds=delivery.lease_seconds()))
        if not leased:
            continue  # another sweeper took it
        try:
            send(str(pk), attempts + 1)
        except Exception:  # noqa: BLE001 - broker down: the lease runs out and it is sent again
            log.warning("events: could not queue webhook delivery %s", pk, exc_info=True)
            continue
        sent += 1
    return sent


def run(now=None, *, purge: bool = False, send=send_to_worker) -> dict:
    """One pass of the sweeper's events work: new lifecycle events, due attempts, and (when
    ``purge``) the retention purge."""
    made = ingest.catch_up(now)
    sent = enqueue_due(now, send)
    purged = retention.purge(now) if purge else 0
    return {"events": made, "sent": sent, "purged": purged}
