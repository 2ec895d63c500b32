"""Template builds, their logs, tags and uploaded COPY archives.

The template a build belongs to is ``sandboxes.models.Template`` (its E2B identity: id,
team, alias, public, names). A build goes ``waiting`` (registered by ``POST
/v3/templates``) → ``building`` (started, handed to a node) → ``ready`` or ``error``;
only ``template_builds.transitions`` changes it."""
import uuid

from django.db import models
from django.utils import timezone


class BuildStatus(models.TextChoices):
    WAITING = "waiting"
    BUILDING = "building"
    READY = "ready"
    ERROR = "error"


class LogLevel(models.TextChoices):
    DEBUG = "debug"
    INFO = "info"
    WARN = "warn"
    ERROR = "error"


# Least to most severe: a ``level`` filter keeps that level and the ones after it.
LEVEL_ORDER = [LogLevel.DEBUG, LogLevel.INFO, LogLevel.WARN, LogLevel.ERROR]


def levels_from(level: str | None) -> list[str] | None:
    """The levels a minimum-level filter keeps (None: no filter)."""
    if not level:
        return None
    return [str(lv) for lv in LEVEL_ORDER[LEVEL_ORDER.index(level):]]


class TemplateBuild(models.Model):
    """One build of a template: what was asked (the start body, the shape), where and how
    it runs (node, status, reason, timestamps) and what it produced (the result a create
    starts from, filled by the builder through ``template_builds.progress.finish``)."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    template = models.ForeignKey("sandboxes.Template", on_delete=models.CASCADE, related_name="builds")
    status = models.CharField(max_length=16, choices=BuildStatus.choices, default=BuildStatus.WAITING,
                              db_index=True)
    # E2B's BuildStatusReason: why an ``error`` build failed, and where ("base", "1".."N"
    # = the 1-based step, "finalize").
    reason_message = models.TextField(blank=True, default="")
    reason_step = models.CharField(max_length=32, blank=True, default="")

    # The start body (POST /v2/templates/{id}/builds/{buildID}), normalised. Registry
    # credentials are never stored: only their ``type`` (they go to the node with the task).
    from_image = models.CharField(max_length=512, blank=True, default="")
    from_template = models.CharField(max_length=255, blank=True, default="")
    from_image_registry_type = models.CharField(max_length=16, blank=True, default="")
    base_build = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL, related_name="+",
                                   help_text="the ready build fromTemplate resolved to")
    steps = models.JSONField(default=list, blank=True)
    start_cmd = models.TextField(blank=True, default="")
    ready_cmd = models.TextField(blank=True, default="")
    force = models.BooleanField(default=False)

    # The shape: what the build VM and the template's sandboxes get.
    cpu_count = models.PositiveIntegerField(default=2)
    memory_mb = models.PositiveIntegerField(default=1024)
    disk_size_mb = models.PositiveIntegerField(default=2048)
    min_free_disk_mb = models.PositiveIntegerField(null=True, blank=True)
    envd_version = models.CharField(max_length=32, default="0.6.4")

    node = models.ForeignKey("nodes.Node", null=True, blank=True, on_delete=models.SET_NULL,
                             related_name="template_builds", help_text="the node that builds it")
    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    started_at = models.DateTimeField(null=True, blank=True, help_text="handed to the node")
    accepted_at = models.DateTimeField(null=True, blank=True, help_text="the node's builder picked it up")
    finished_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)
    # How many log entries the build has (the next entry's index); bumped with each append.
    log_count = models.PositiveIntegerField(default=0)

    # The result, filled by the builder when the build becomes ready: a template snapshot
    # (memory + disk, start command running: a create restores it) and/or a vmm image
    # (a create boots it), plus whatever the builder wants to keep (layer digests, the
    # envd user and workdir, the manifest).
    snapshot = models.ForeignKey("snapshots.Snapshot", null=True, blank=True, on_delete=models.SET_NULL,
                                 related_name="template_builds")
    image = models.CharField(max_length=255, blank=True, default="")
    result = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["template", "status", "-created_at"])]

    def __str__(self) -> str:
        return f"{self.template_id}/{self.id} ({self.status})"


class BuildLogEntry(models.Model):
    """One line of a build's log. ``index`` is its 0-based position in the build's log
    (the SDK's ``logsOffset`` counts these)."""

    build = models.ForeignKey(TemplateBuild, on_delete=models.CASCADE, related_name="log_entries")
    index = models.PositiveIntegerField()
    timestamp = models.DateTimeField(default=timezone.now)
    level = models.CharField(max_length=8, choices=LogLevel.choices, default=LogLevel.INFO)
    message = models.TextField()
    step = models.CharField(max_length=32, blank=True, default="")

    class Meta:
        ordering = ["build", "index"]
        constraints = [models.UniqueConstraint(fields=["build", "index"], name="build_log_unique_index")]

    def __str__(self) -> str:
        return f"{self.build_id}#{self.index} {self.level}: {self.message[:60]}"


class TemplateTag(models.Model):
    """A tag given to a build (E2B keeps the history: a tag resolves to its newest
    assignment whose build is ready)."""

    template = models.ForeignKey("sandboxes.Template", on_delete=models.CASCADE, related_name="tag_assignments")
    build = models.ForeignKey(TemplateBuild, on_delete=models.CASCADE, related_name="tag_assignments")
    tag = models.CharField(max_length=128)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["template", "tag", "-created_at"])]

    def __str__(self) -> str:
        return f"{self.template_id}:{self.tag} → {self.build_id}"


class TemplateFile(models.Model):
    """An uploaded COPY archive (a tar, usually gzipped), kept per (team, hash) and
    reusable by every template of the team. The bytes live in the file store
    (``template_builds.files``); this row is written once they are complete there."""

    team = models.ForeignKey("sandboxes.Team", on_delete=models.CASCADE, related_name="template_files")
    hash = models.CharField(max_length=64, help_text="the SDK's files hash (SHA-256 hex), an opaque cache key")
    size_bytes = models.BigIntegerField(default=0)
    gzip = models.BooleanField(default=True, help_text="gzip-compressed (sniffed), else a plain tar")
    template = models.ForeignKey("sandboxes.Template", null=True, blank=True, on_delete=models.SET_NULL,
                                 related_name="+", help_text="the template it was first uploaded for")
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [models.UniqueConstraint(fields=["team", "hash"], name="template_file_unique_team_hash")]

    def __str__(self) -> str:
        return f"{self.team_id}/{self.hash}"
