"""Control-plane truth: teams, API keys, access tokens, templates, sandboxes and their event log."""
import hashlib
import secrets
import string
import uuid

from django.conf import settings
from django.db import models
from django.utils import timezone

from sandboxes.states import E2B_VIEW, SandboxState  # noqa: F401 - SandboxState: the field's choices, re-exported

SANDBOX_ID_ALPHABET = string.ascii_lowercase + string.digits


def new_sandbox_id() -> str:
    """E2B-style id: lowercase and DNS-label safe, so it also works in `{port}-{id}.{domain}` hosts."""
    return "i" + "".join(secrets.choice(SANDBOX_ID_ALPHABET) for _ in range(19))


def new_envd_access_token() -> str:
    return secrets.token_hex(24)


class Team(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=128)
    slug = models.SlugField(max_length=64, unique=True)
    members = models.ManyToManyField(settings.AUTH_USER_MODEL, related_name="teams", blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


def hash_api_key(raw_key: str) -> str:
    return hashlib.sha256(raw_key.encode()).hexdigest()


def new_secret(prefix: str) -> str:
    """A key or token as E2B spells them: its kind's prefix, then 40 hex digits."""
    return prefix + secrets.token_hex(20)


class ApiKey(models.Model):
    """Only the SHA-256 of a key is stored; the key itself is shown once on creation.

    Keys look like ``e2b_`` + 40 hex digits so SDK versions with the client-side
    format check (~2.25–2.4x) accept them. ``uid`` is the key's id in E2B's ``/api-keys``
    API (a UUID there); ``suffix`` its last 4 digits, for E2B's mask (empty for keys made
    before the mask existed)."""

    PREFIX = "e2b_"
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="api_keys")
    uid = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    name = models.CharField(max_length=128, default="default")
    prefix = models.CharField(max_length=16, db_index=True, help_text="first characters, to recognise a key")
    suffix = models.CharField(max_length=4, blank=True, default="", help_text="last characters, for the mask")
    key_hash = models.CharField(max_length=64, unique=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(default=timezone.now)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.team})"

    @classmethod
    def generate(cls, team: Team, name: str = "default", created_by=None) -> tuple["ApiKey", str]:
        raw = new_secret(cls.PREFIX)
        key = cls.objects.create(
            team=team, name=name, prefix=raw[:12], suffix=raw[-4:], key_hash=hash_api_key(raw), created_by=created_by
        )
        return key, raw

    @property
    def is_active(self) -> bool:
        return self.revoked_at is None


class AccessToken(models.Model):
    """E2B's access token (``Authorization: Bearer sk_e2b_…``): a person's credential, not a
    team's. It acts for its user in every team the user is a member of (``Team.members``),
    on the routes E2B gives to access tokens (``/teams``, ``/access-tokens``, and the user's
    side of ``/api-keys`` and team metrics). Stored like API keys: the SHA-256 only, the
    token shown once."""

    PREFIX = "sk_e2b_"
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="access_tokens")
    name = models.CharField(max_length=128)
    prefix = models.CharField(max_length=16, help_text="first characters, to recognise a token")
    suffix = models.CharField(max_length=4, help_text="last characters, for the mask")
    token_hash = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(default=timezone.now)
    last_used_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.user})"

    @classmethod
    def generate(cls, user, name: str) -> tuple["AccessToken", str]:
        raw = new_secret(cls.PREFIX)
        token = cls.objects.create(user=user, name=name, prefix=raw[:15], suffix=raw[-4:],
                                   token_hash=hash_api_key(raw))
        return token, raw


class Template(models.Model):
    """A template, E2B's unit of "what a sandbox starts from".

    Two kinds share this row: a *global* template (no team, e.g. ``base`` made by
    ``manage.py bootstrap``) whose ``image`` names the vmm image the node boots, and a
    *team* template registered through the template build API (``template_builds``),
    whose sandboxes start from the result of one of its ready builds. Names are
    ``<team slug>/<alias>`` (team) or ``<alias>`` (global)."""

    id = models.CharField(primary_key=True, max_length=128)
    team = models.ForeignKey(Team, null=True, blank=True, on_delete=models.CASCADE, related_name="templates")
    alias = models.CharField(max_length=128, blank=True, default="", db_index=True)
    public = models.BooleanField(default=True)
    image = models.CharField(max_length=128, default="base")
    cpu_count = models.PositiveIntegerField(default=2)
    memory_mb = models.PositiveIntegerField(default=512)
    disk_size_mb = models.PositiveIntegerField(default=2048)
    envd_version = models.CharField(max_length=32, default="0.6.4")
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(auto_now=True)
    # E2B deletes templates softly: the row stays for the sandboxes and snapshots that name
    # it, its alias is free again, and nothing resolves it any more.
    deleted_at = models.DateTimeField(null=True, blank=True, db_index=True)

    class Meta:
        ordering = ["id"]
        constraints = [
            # One live template per alias in a team's namespace (global aliases: checked by code).
            models.UniqueConstraint(
                fields=["team", "alias"],
                condition=models.Q(deleted_at__isnull=True) & ~models.Q(alias=""),
                name="template_unique_team_alias",
            )
        ]

    def __str__(self) -> str:
        return self.id

    @property
    def names(self) -> list[str]:
        """E2B's ``names``: ``<team slug>/<alias>`` for a team's template, ``<alias>`` for a global one."""
        if not self.alias:
            return []
        return [f"{self.team.slug}/{self.alias}"] if self.team_id else [self.alias]


class Sandbox(models.Model):
    id = models.CharField(primary_key=True, max_length=64, default=new_sandbox_id)
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="sandboxes")
    template = models.ForeignKey(Template, on_delete=models.PROTECT, related_name="sandboxes")
    node = models.ForeignKey("nodes.Node", null=True, blank=True, on_delete=models.SET_NULL, related_name="sandboxes")
    state = models.CharField(max_length=16, choices=SandboxState.choices, default=SandboxState.CREATING, db_index=True)
    error_reason = models.TextField(blank=True, default="")
    alias = models.CharField(max_length=128, blank=True, default="")
    client_id = models.CharField(max_length=64, default="aenv")
    envd_version = models.CharField(max_length=32, default="0.6.4")
    envd_host = models.CharField(max_length=255, blank=True, default="")
    envd_port = models.PositiveIntegerField(null=True, blank=True)
    # Where every guest TCP port is reachable from the node (the netns backend: the slot
    # address); empty when only envd's port is forwarded (the restricted slirp fallback).
    guest_host = models.CharField(max_length=255, blank=True, default="")
    # Bumped whenever the VM process behind the sandbox (and so its envd route) changes:
    # the data plane never reuses a route or a pooled connection of an older generation.
    vm_generation = models.PositiveIntegerField(default=0)
    # When its latest pause was exported to the shared snapshot store (agent.moves): while it
    # is paused, another node can resume it from there if its own is gone. None: it cannot.
    pause_image_at = models.DateTimeField(null=True, blank=True)
    # E2B's envdUnresponsiveAtPause: its (latest) pause kept its memory although its guest
    # agent did not answer; a resume with that memory is refused (409), a reboot is not.
    envd_unresponsive_at_pause = models.BooleanField(default=False)
    # A resume failed after its guest had run on the only copy of its memory (vmm MemoryLost):
    # the memory is gone, its disk kept. A plain resume is refused (409), a reboot is not.
    memory_lost = models.BooleanField(default=False)
    secure = models.BooleanField(default=False)
    envd_access_token = models.CharField(max_length=128, blank=True, default="")
    # E2B's trafficAccessToken: set only when network.allowPublicTraffic is false; the data
    # plane then requires it (header e2b-traffic-access-token) on every port but envd's.
    traffic_access_token = models.CharField(max_length=128, blank=True, default="")
    metadata = models.JSONField(default=dict, blank=True)
    env_vars = models.JSONField(default=dict, blank=True)
    cpu_count = models.PositiveIntegerField(default=2)
    memory_mb = models.PositiveIntegerField(default=512)
    disk_size_mb = models.PositiveIntegerField(default=2048)
    # What placement reserves for it on its node when that is less than its shape (None: its
    # shape): a fork child's charge while it shares its parent's memory (nodes.placement).
    reserved_vcpus = models.PositiveIntegerField(null=True, blank=True)
    reserved_memory_mb = models.PositiveIntegerField(null=True, blank=True)
    auto_pause = models.BooleanField(default=False)
    # With auto_pause: False pauses on expiry filesystem-only (E2B's autoPauseMemory).
    auto_pause_memory = models.BooleanField(default=True)
    auto_resume = models.BooleanField(default=False)
    allow_internet_access = models.BooleanField(null=True, blank=True)
    network = models.JSONField(null=True, blank=True)
    # Idempotency-Key of the create request: a retried create with the same key
    # (same team, within the window) returns this sandbox instead of booting another.
    idempotency_key = models.CharField(max_length=255, blank=True, default="")
    # Lineage (template → snapshot → sandboxes / forks): the snapshot this sandbox was
    # restored from (its files must outlive it) and the sandbox it was forked from.
    source_snapshot = models.ForeignKey("snapshots.Snapshot", null=True, blank=True, on_delete=models.SET_NULL,
                                        related_name="sandboxes")
    forked_from = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL, related_name="forks")
    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    started_at = models.DateTimeField(default=timezone.now, db_index=True)
    end_at = models.DateTimeField(db_index=True)
    killed_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-started_at", "-id"]
        indexes = [models.Index(fields=["team", "state", "-started_at"])]
        constraints = [
            models.UniqueConstraint(
                fields=["team", "idempotency_key"],
                condition=~models.Q(idempotency_key=""),
                name="sandbox_unique_idempotency_key",
            )
        ]

    def __str__(self) -> str:
        return self.id

    @property
    def e2b_state(self) -> str | None:
        return E2B_VIEW.get(self.state)

    @property
    def envd_base_url(self) -> str:
        return f"http://{self.envd_host}:{self.envd_port}"


class SandboxEvent(models.Model):
    """One operation on a sandbox, written before the operation is acknowledged."""

    sandbox = models.ForeignKey(Sandbox, on_delete=models.CASCADE, related_name="events")
    operation = models.CharField(max_length=32)
    outcome = models.CharField(max_length=16, default="ok")
    from_state = models.CharField(max_length=16, blank=True, default="")
    to_state = models.CharField(max_length=16, blank=True, default="")
    started_at = models.DateTimeField(default=timezone.now)
    duration_ms = models.FloatField(null=True, blank=True)
    message = models.TextField(blank=True, default="")
    details = models.JSONField(default=dict, blank=True)
    actor = models.CharField(max_length=128, blank=True, default="")

    class Meta:
        ordering = ["-started_at", "-id"]

    def __str__(self) -> str:
        return f"{self.sandbox_id} {self.operation} {self.outcome}"


class SandboxMetric(models.Model):
    """One sample of a running sandbox's guest usage (envd ``/metrics``, taken by its node's
    sampler, ``agent.metrics``), as E2B's ``GET /sandboxes/{id}/metrics`` returns them.
    Kept ``AENV_SANDBOX_METRICS_RETENTION`` seconds."""

    sandbox = models.ForeignKey(Sandbox, on_delete=models.CASCADE, related_name="metrics")
    timestamp = models.DateTimeField(db_index=True, help_text="when the node took the sample (host clock)")
    cpu_count = models.PositiveIntegerField()
    cpu_used_pct = models.FloatField()
    mem_used = models.BigIntegerField()
    mem_total = models.BigIntegerField()
    mem_cache = models.BigIntegerField(default=0)
    disk_used = models.BigIntegerField()
    disk_total = models.BigIntegerField()

    class Meta:
        ordering = ["timestamp", "id"]
        indexes = [models.Index(fields=["sandbox", "timestamp"])]

    def __str__(self) -> str:
        return f"{self.sandbox_id} @ {self.timestamp:%Y-%m-%dT%H:%M:%S}"


class SandboxLog(models.Model):
    """One line of a sandbox's guest console — the kernel, aenv's guest init and envd's own
    log lines — collected by its node (``agent.console_logs``), as E2B's
    ``GET /sandboxes/{id}/logs`` and ``/v2/sandboxes/{id}/logs`` return them.

    ``timestamp`` is the node's clock when it read the line, made strictly increasing per
    sandbox (1 ms apart at least), so a reader paginating by timestamp (E2B's ``start`` /
    ``cursor``) never skips or repeats a line. (``vm_generation``, ``offset``): where the
    line ended in that VM process's console file — what a node resumes reading from, and
    unique, so a line is never stored twice."""

    sandbox = models.ForeignKey(Sandbox, on_delete=models.CASCADE, related_name="logs")
    timestamp = models.DateTimeField()
    level = models.CharField(max_length=8, default="info")
    message = models.TextField()
    line = models.TextField(help_text="the console line as the guest wrote it")
    source = models.CharField(max_length=16, default="console", help_text="console | envd")
    logger = models.CharField(max_length=64, blank=True, default="")
    vm_generation = models.PositiveIntegerField(default=0)
    offset = models.BigIntegerField()

    class Meta:
        ordering = ["timestamp", "id"]
        indexes = [models.Index(fields=["sandbox", "timestamp", "id"])]
        constraints = [models.UniqueConstraint(fields=["sandbox", "vm_generation", "offset"],
                                               name="sandbox_log_once")]

    def __str__(self) -> str:
        return f"{self.sandbox_id} @ {self.timestamp:%Y-%m-%dT%H:%M:%S.%f}: {self.message[:60]}"
