"""Snapshots: a captured sandbox (disk layers, memory, device state) that new
sandboxes can start from. The files live on the node that took them (see
``agent.stores``); this row is the control plane's record of them."""
import re
import secrets

from django.db import models
from django.utils import timezone

from sandboxes.models import SANDBOX_ID_ALPHABET
from snapshots.states import SnapshotState  # noqa: F401 - the field's choices, re-exported

# Names are one path segment and safe in URLs: letters, digits, "_", "-" and ".".
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def new_snapshot_id() -> str:
    """Like sandbox ids (lowercase, DNS-label safe) but starting with "s", so an id
    alone tells a snapshot from a sandbox in logs and in ``templateID``."""
    return "s" + "".join(secrets.choice(SANDBOX_ID_ALPHABET) for _ in range(19))


class Snapshot(models.Model):
    id = models.CharField(primary_key=True, max_length=64, default=new_snapshot_id)
    team = models.ForeignKey("sandboxes.Team", on_delete=models.CASCADE, related_name="snapshots")
    # One name at most: a newer snapshot given the same name takes it over (like a tag).
    name = models.CharField(max_length=128, blank=True, default="", db_index=True)
    source_sandbox = models.ForeignKey("sandboxes.Sandbox", null=True, blank=True, on_delete=models.SET_NULL,
                                       related_name="snapshots")
    template = models.ForeignKey("sandboxes.Template", on_delete=models.PROTECT, related_name="snapshots",
                                 help_text="the root template the captured disk grew from")
    node = models.ForeignKey("nodes.Node", null=True, blank=True, on_delete=models.SET_NULL,
                             related_name="snapshots", help_text="where the snapshot's files live")
    memory = models.BooleanField(default=True, help_text="memory and processes captured, not only the disk")
    # A template build's result (its template snapshot, the start command running): what
    # creates of that template restore. Not one of the team's snapshots: never listed, never
    # a templateID of its own, deleted with its template.
    build_result = models.BooleanField(default=False, db_index=True)
    # A fork's capture whose children span nodes (lifecycle.snapshots.fork_spread): stored so the
    # other nodes restore its children lazily. Not one of the team's snapshots either: never
    # listed or named, deleted by the sweeper once no live sandbox restored from it is left.
    fork_capture = models.BooleanField(default=False, db_index=True)
    # A fork capture handed to other nodes before its upload ended: until then (or this time,
    # should the API that waits for the upload stop) the sweeper leaves it alone, so no delete
    # races the upload (lifecycle.snapshots.captures).
    uploading_until = models.DateTimeField(null=True, blank=True)
    state = models.CharField(max_length=16, choices=SnapshotState.choices, default=SnapshotState.CREATING,
                             db_index=True)
    error_reason = models.TextField(blank=True, default="")
    size_bytes = models.BigIntegerField(default=0)
    manifest = models.JSONField(default=dict, blank=True)
    cpu_count = models.PositiveIntegerField(default=2)
    memory_mb = models.PositiveIntegerField(default=512)
    disk_size_mb = models.PositiveIntegerField(default=2048)
    envd_version = models.CharField(max_length=32, default="0.6.4")
    # The access token the captured envd still requires: a restore hands it over to the
    # new sandbox's own token through envd /init. Never shown by the API.
    envd_access_token = models.CharField(max_length=128, blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["team", "state", "-created_at"])]

    def __str__(self) -> str:
        return f"{self.id} ({self.name})" if self.name else self.id

    @property
    def names(self) -> list[str]:
        return [self.name] if self.name else []


class SnapshotEvent(models.Model):
    """One change of a snapshot's state, written with it (``snapshots.transitions``) before
    anyone is answered; deleted with the snapshot, like a sandbox's events."""

    snapshot = models.ForeignKey(Snapshot, on_delete=models.CASCADE, related_name="events")
    operation = models.CharField(max_length=32)
    from_state = models.CharField(max_length=16)
    to_state = models.CharField(max_length=16)
    at = models.DateTimeField(default=timezone.now)
    message = models.TextField(blank=True, default="")
    details = models.JSONField(default=dict, blank=True)
    actor = models.CharField(max_length=128, blank=True, default="")

    class Meta:
        ordering = ["-at", "-id"]

    def __str__(self) -> str:
        return f"{self.snapshot_id} {self.operation} {self.from_state} → {self.to_state}"
