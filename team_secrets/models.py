"""A team's secret and its versions. Only ciphertext is stored (``team_secrets.crypto``);
the metadata and the name are the only things read back."""
from __future__ import annotations

import secrets

from django.db import models
from django.utils import timezone

from sandboxes.models import Team

ID_PREFIX = "sec_"  # E2B reserves it for secret ids: a name may not start with it


def new_secret_id() -> str:
    return ID_PREFIX + secrets.token_hex(12)


class Secret(models.Model):
    id = models.CharField(primary_key=True, max_length=40, default=new_secret_id)
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="secrets")
    name = models.CharField(max_length=128)  # lower case (E2B's canonical form)
    metadata = models.JSONField(default=dict, blank=True)
    current_version = models.PositiveIntegerField(default=1)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [models.UniqueConstraint(fields=["team", "name"], name="secret_unique_team_name")]
        indexes = [models.Index(fields=["team", "-created_at", "-id"])]

    def __str__(self) -> str:
        return f"{self.name} ({self.pk})"


class SecretVersion(models.Model):
    """One value of a secret, sealed with AES-256-GCM; ``key_id`` names the key that sealed it
    (a digest, not the key), so a process with another key says so instead of "corrupt"."""

    secret = models.ForeignKey(Secret, on_delete=models.CASCADE, related_name="versions")
    version = models.PositiveIntegerField()
    sealed = models.BinaryField()
    key_id = models.CharField(max_length=16)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-version"]
        constraints = [models.UniqueConstraint(fields=["secret", "version"], name="secret_version_unique")]

    def __str__(self) -> str:
        return f"{self.secret_id} v{self.version}"
