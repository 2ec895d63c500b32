"""Lifecycle events as served, team webhooks, and each webhook's deliveries and attempts."""
import uuid

from django.db import models
from django.utils import timezone

from sandboxes.models import SandboxEvent, Team


class LifecycleEvent(models.Model):
    """One public lifecycle event (E2B's ``SandboxEvent``), made from a ``SandboxEvent`` by
    ``events.ingest``. ``payload`` is the body served and POSTed, frozen when it was made
    (the sandbox's metadata then); ``seq`` is the source event's id, the order events are
    served in. Kept AENV_EVENT_RETENTION_DAYS (``events.retention``)."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="lifecycle_events")
    sandbox_id = models.CharField(max_length=64)
    type = models.CharField(max_length=64)
    timestamp = models.DateTimeField(db_index=True)
    seq = models.BigIntegerField()
    source = models.OneToOneField(SandboxEvent, null=True, blank=True, on_delete=models.SET_NULL,
                                  related_name="lifecycle")
    payload = models.JSONField()

    class Meta:
        ordering = ["seq"]
        indexes = [models.Index(fields=["team", "seq"]), models.Index(fields=["team", "sandbox_id", "seq"])]

    def __str__(self) -> str:
        return f"{self.sandbox_id} {self.type}"


class IngestCursor(models.Model):
    """How far ``events.ingest`` has read the SandboxEvent table (one row)."""

    last_id = models.BigIntegerField(default=0)


class Webhook(models.Model):
    """A team's webhook: the events of ``events`` are POSTed to ``url`` while ``enabled``.
    ``secret_sealed`` is the signature secret encrypted with a key outside the database
    (``events.sealing``); it is never shown after creation."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="webhooks")
    name = models.CharField(max_length=128)
    url = models.CharField(max_length=2048)
    events = models.JSONField(default=list)
    enabled = models.BooleanField(default=True)
    secret_sealed = models.TextField()
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["created_at", "id"]

    def __str__(self) -> str:
        return f"{self.name} → {self.url}"


class DeliveryStatus(models.TextChoices):
    PENDING = "pending"
    SUCCESS = "success"
    FAILED = "failed"


class WebhookDelivery(models.Model):
    """One event on its way to one webhook: attempted until one attempt succeeds or
    AENV_WEBHOOK_MAX_ATTEMPTS have failed. ``next_attempt_at`` is when the next attempt is
    due (the backoff lives in the database, so a worker restart loses nothing);
    ``lease_until``: an attempt was handed to a worker and is not handed out again before."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    webhook = models.ForeignKey(Webhook, on_delete=models.CASCADE, related_name="deliveries")
    event = models.ForeignKey(LifecycleEvent, on_delete=models.CASCADE, related_name="deliveries")
    status = models.CharField(max_length=16, choices=DeliveryStatus.choices, default=DeliveryStatus.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    next_attempt_at = models.DateTimeField(default=timezone.now)
    lease_until = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["created_at", "id"]
        indexes = [models.Index(fields=["status", "next_attempt_at"])]
        constraints = [models.UniqueConstraint(fields=["webhook", "event"], name="webhook_delivery_once")]

    def __str__(self) -> str:
        return f"{self.event_id} → {self.webhook_id}: {self.status}"


class WebhookAttempt(models.Model):
    """One POST of a delivery (its id is the ``e2b-delivery-id`` header): what came back,
    or why nothing did, and how long it took."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    delivery = models.ForeignKey(WebhookDelivery, on_delete=models.CASCADE, related_name="attempt_log")
    number = models.PositiveIntegerField()
    started_at = models.DateTimeField(default=timezone.now)
    duration_ms = models.FloatField(default=0)
    ok = models.BooleanField(default=False)
    status_code = models.PositiveIntegerField(null=True, blank=True)
    error_class = models.CharField(max_length=32, blank=True, default="")
    error_message = models.TextField(blank=True, default="")
    response_body = models.TextField(blank=True, default="")
    request_url = models.CharField(max_length=2048, default="")

    class Meta:
        ordering = ["started_at", "number"]

    def __str__(self) -> str:
        return f"{self.delivery_id} #{self.number}: {self.status_code or self.error_class}"
