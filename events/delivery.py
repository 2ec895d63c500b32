"""One delivery attempt, as the control plane's events worker runs it (``events.tasks``).

Why the attempt number travels with the task: a task delivered twice (a broker redelivery,
a lease that ran out while the first run was still going) must not POST twice; only the
run that moves ``attempts`` from n-1 to n goes ahead. The backoff is written to the
delivery (``next_attempt_at``) and the sweeper hands the retry out when it is due."""
from __future__ import annotations

import json
from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from events import outbound, sealing, signing
from events.models import DeliveryStatus, WebhookAttempt, WebhookDelivery

STORED_BODY = 2048  # characters of the receiver's answer kept for the dashboard


def backoff(failed_attempts: int) -> float:
    """Seconds to wait after the n-th failed attempt: AENV_WEBHOOK_BACKOFF * 2^(n-1), capped."""
    return min(settings.AENV_WEBHOOK_BACKOFF * 2 ** max(failed_attempts - 1, 0), settings.AENV_WEBHOOK_BACKOFF_MAX)


def lease_seconds() -> float:
    """How long a handed-out attempt is not handed out again: its whole deadline and a margin."""
    return settings.AENV_WEBHOOK_TIMEOUT * 2 + 30


def body_of(delivery: WebhookDelivery) -> bytes:
    """The exact bytes POSTed (and signed): the event's E2B body as compact JSON."""
    return json.dumps(delivery.event.payload, separators=(",", ":"), sort_keys=True).encode()


def attempt(delivery_id, number: int, post=outbound.post) -> WebhookAttempt | None:
    """Makes attempt ``number`` of a pending delivery and records it; None when that attempt
    is not this call's to make (made already, or the delivery is finished)."""
    now = timezone.now()
    claimed = WebhookDelivery.objects.filter(pk=delivery_id, status=DeliveryStatus.PENDING,
                                             attempts=number - 1).update(
        attempts=number, lease_until=now + timedelta(seconds=lease_seconds()))
    if not claimed:
        return None
    delivery = WebhookDelivery.objects.select_related("webhook", "event").get(pk=delivery_id)
    hook = delivery.webhook
    record = WebhookAttempt(delivery=delivery, number=number, started_at=now, request_url=hook.url)
    if not hook.enabled:
        record.error_class, record.error_message = "canceled", "the webhook was disabled"
        return _finish(delivery, record, final=True)
    try:
        secret = sealing.unseal(hook.secret_sealed)
    except sealing.Unreadable as exc:
        record.error_class, record.error_message = "signature_error", str(exc)
        return _finish(delivery, record, final=number >= settings.AENV_WEBHOOK_MAX_ATTEMPTS)
    body = body_of(delivery)
    result = post(hook.url, body, signing.headers(secret, body, hook.id, record.id),
                  timeout=settings.AENV_WEBHOOK_TIMEOUT, max_bytes=settings.AENV_WEBHOOK_MAX_RESPONSE_BYTES,
                  allow_private=settings.AENV_WEBHOOK_ALLOW_PRIVATE)
    record.ok, record.status_code, record.duration_ms = result.ok, result.status, result.duration_ms
    record.error_class, record.error_message = result.error_class, result.error
    record.response_body = result.body.decode("utf-8", "replace")[:STORED_BODY]
    return _finish(delivery, record, final=result.ok or number >= settings.AENV_WEBHOOK_MAX_ATTEMPTS)


def _finish(delivery: WebhookDelivery, record: WebhookAttempt, *, final: bool) -> WebhookAttempt:
    record.save(force_insert=True)
    now = timezone.now()
    if record.ok:
        fields = {"status": DeliveryStatus.SUCCESS, "finished_at": now}
    elif final:
        fields = {"status": DeliveryStatus.FAILED, "finished_at": now}
    else:
        fields = {"next_attempt_at": now + timedelta(seconds=backoff(record.number))}
    WebhookDelivery.objects.filter(pk=delivery.pk, attempts=record.number).update(lease_until=None, **fields)
    return record
