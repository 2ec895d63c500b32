"""Volumes and who mounts them. A volume's files live in the volume store
(``volumes.store``); these rows are the control plane's record: its name, its team, the
token of its content API, and the sandboxes and snapshots that mount it (a volume with a
live user cannot be deleted)."""
import secrets
import uuid

from pathlib import Path

from django.conf import settings
from django.db import models
from django.utils import timezone


def new_volume_id() -> str:
    """A UUID, as E2B's volume ids are."""
    return str(uuid.uuid4())


def new_volume_token() -> str:
    return secrets.token_hex(32)


def default_size_mb() -> int:
    """A new volume's limit: ``AENV_VOLUME_MAX_MB`` when it is made (0: unbounded); unset, the
    default limit where this process can make one (volumes.image.can_limit), else none: an
    operator who set a limit gets a clear refusal where it cannot hold, one who did not gets
    volumes as before limits."""
    limit = settings.AENV_VOLUME_MAX_MB
    if limit is None:
        from volumes import image  # noqa: PLC0415 - subprocess helpers, only for the unset case

        return image.DEFAULT_MB if image.can_limit(Path(settings.AENV_VOLUMES_DIR)) else 0
    return limit


class Volume(models.Model):
    id = models.CharField(primary_key=True, max_length=64, default=new_volume_id)
    team = models.ForeignKey("sandboxes.Team", on_delete=models.CASCADE, related_name="volumes")
    name = models.CharField(max_length=128)
    # The bearer token of the volume content API (E2B's VolumeAndToken.token): shown by the
    # API to the team on create and get, like envdAccessToken, so it is kept as is.
    token = models.CharField(max_length=128, default=new_volume_token)
    # The NFS export id of the volume on its guests' servers (vmm.net.volume_server): part of
    # every NFS file handle, so it never changes; unique in the team (one sandbox's volumes).
    export_id = models.PositiveIntegerField(default=0)
    # Its size limit in MiB, fixed when it is made (volumes.image: the size of its filesystem);
    # 0: a plain directory without a limit (volumes made before limits, AENV_VOLUME_MAX_MB=0).
    size_mb = models.PositiveIntegerField(default=default_size_mb)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name", "id"]
        constraints = [models.UniqueConstraint(fields=["team", "name"], name="volume_unique_team_name"),
                       models.UniqueConstraint(fields=["team", "export_id"], name="volume_unique_team_export_id")]

    def __str__(self) -> str:
        return f"{self.name} ({self.id})"


class SandboxVolume(models.Model):
    """A volume mounted by a sandbox at ``path``; fork children get rows of their own."""

    sandbox = models.ForeignKey("sandboxes.Sandbox", on_delete=models.CASCADE, related_name="volume_mounts")
    volume = models.ForeignKey(Volume, on_delete=models.CASCADE, related_name="sandbox_mounts")
    path = models.CharField(max_length=1024)

    class Meta:
        ordering = ["path"]
        constraints = [models.UniqueConstraint(fields=["sandbox", "path"], name="sandbox_volume_unique_path")]


class SnapshotVolume(models.Model):
    """A volume a snapshot's guest had mounted: sandboxes started from the snapshot mount it
    again at the same path (their memory expects it there)."""

    snapshot = models.ForeignKey("snapshots.Snapshot", on_delete=models.CASCADE, related_name="volume_mounts")
    volume = models.ForeignKey(Volume, on_delete=models.CASCADE, related_name="snapshot_mounts")
    path = models.CharField(max_length=1024)

    class Meta:
        ordering = ["path"]
        constraints = [models.UniqueConstraint(fields=["snapshot", "path"], name="snapshot_volume_unique_path")]
