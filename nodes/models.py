"""A Node is one machine running a node worker (Celery queue ``node.<id>``)."""
from datetime import timedelta

from django.conf import settings
from django.db import models
from django.db.models import Q

from nodes import protocol
from django.utils import timezone


class Node(models.Model):
    id = models.CharField(primary_key=True, max_length=64)
    address = models.CharField(max_length=255, help_text="host where this node's sandbox endpoints listen")
    driver = models.CharField(max_length=32, default="qemu")
    accel = models.CharField(max_length=16, default="tcg", help_text="kvm or tcg, detected once at start")
    vcpu_capacity = models.PositiveIntegerField(default=0)
    memory_mb_capacity = models.PositiveIntegerField(default=0)
    sandboxes_running = models.PositiveIntegerField(default=0)
    version = models.CharField(max_length=32, blank=True, default="")
    started_at = models.DateTimeField(default=timezone.now)
    last_heartbeat_at = models.DateTimeField(null=True, blank=True, db_index=True)
    draining = models.BooleanField(default=False)
    # Every placement on the node bumps this first: the row's write lock is what serializes
    # placements racing for its last room (nodes.placement), and the count says how many there were.
    placements = models.PositiveBigIntegerField(default=0)
    # What the node reports of its host at each heartbeat (agent.host_usage): CPU %, cores,
    # memory, the disks it uses, machine info; and the recent (time, CPU %, memory used)
    # samples the dashboard charts, newest last, at most AENV_NODE_HOST_HISTORY of them.
    host = models.JSONField(default=dict, blank=True)
    host_history = models.JSONField(default=list, blank=True)
    # The snapshots (template snapshots included) whose files the node had at its last
    # heartbeat, own or cached (agent.stores ``local_ids``): placement prefers these nodes
    # for a restore, which then needs no download.
    snapshots_here = models.JSONField(default=list, blank=True)
    # Joining (nodes.join): the token the node joined with, the SHA-256 of the long-lived
    # credential it was given then (empty: it never joined), and when an operator revoked it
    # (placement and nodes.client then leave it alone; its own heartbeats do not revive it).
    joined_via = models.ForeignKey("NodeJoinToken", null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="nodes")
    credential_hash = models.CharField(max_length=64, blank=True, default="", db_index=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    # Set by a node worker that stopped cleanly (agent.worker), cleared when it registers again:
    # placement and nodes.client leave a stopped node at once instead of choosing it until its
    # last heartbeat ages out. The heartbeat is kept, so a node that never comes back still has
    # what it left running declared lost after AENV_NODE_LOST_AFTER (lifecycle.lost).
    stopped_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        return self.id

    @property
    def queue(self) -> str:
        return protocol.queue_of(self.pk)

    def is_alive(self, now=None) -> bool:
        """``alive_q`` for one row already read."""
        if self.last_heartbeat_at is None or self.stopped_at is not None:
            return False
        return self.last_heartbeat_at >= heartbeat_cutoff(now)


def heartbeat_cutoff(now=None):
    """The oldest heartbeat of a node still counted alive."""
    return (now or timezone.now()) - timedelta(seconds=settings.AENV_NODE_HEARTBEAT_TIMEOUT)


def alive_q(now=None, *, cutoff=None) -> Q:
    """Which nodes are alive, as a query (``Node.is_alive`` row by row): a recent heartbeat and
    a worker that did not stop. ``cutoff``: the oldest heartbeat counted (``heartbeat_cutoff``)
    given instead of ``now``."""
    return Q(stopped_at__isnull=True, last_heartbeat_at__gte=heartbeat_cutoff(now) if cutoff is None else cutoff)


JOIN_TOKEN_STATES = ("active", "used", "expired", "revoked")


class NodeJoinToken(models.Model):
    """A one-time secret a new node presents to ``POST /nodes/join`` (nodes.join). Only its
    SHA-256 is stored; ``prefix`` (the first characters) names it in lists and revocations.
    Single use: the token travels through install commands, shell history and cloud-init,
    so once a node has joined with it, it is worth nothing to whoever finds it."""

    prefix = models.CharField(max_length=32, unique=True)
    token_hash = models.CharField(max_length=64, unique=True)
    node_id = models.CharField(max_length=64, blank=True, default="",
                               help_text="the only node id that may join with it; empty: any new node id")
    created_by = models.CharField(max_length=150, blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField()
    used_at = models.DateTimeField(null=True, blank=True)
    used_by = models.CharField(max_length=64, blank=True, default="", help_text="the node id that joined with it")
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.prefix}…"

    def state(self, now=None) -> str:
        """``revoked``, ``used``, ``expired`` or ``active``, in that order of precedence."""
        if self.revoked_at is not None:
            return "revoked"
        if self.used_at is not None:
            return "used"
        if (now or timezone.now()) >= self.expires_at:
            return "expired"
        return "active"
