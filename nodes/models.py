"""A Node is one machine running a node worker (Celery queue ``node.<id>``)."""
from datetime import timedelta

from django.conf import settings
from django.db import models

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

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        return self.id

    @property
    def queue(self) -> str:
        return protocol.queue_of(self.pk)

    def is_alive(self, now=None) -> bool:
        if self.last_heartbeat_at is None:
            return False
        now = now or timezone.now()
        return now - self.last_heartbeat_at <= timedelta(seconds=settings.AENV_NODE_HEARTBEAT_TIMEOUT)
