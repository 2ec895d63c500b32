"""Sandboxes on a node that stopped answering: once a node has sent no heartbeat for
``AENV_NODE_LOST_AFTER`` seconds (longer than a worker restart takes, which reconciles its
own sandboxes), the sweeper declares its running sandboxes — and those on their way to or
from running — lost: ``error`` with the reason and a ``lost`` event each, so clients get a
clear answer instead of a hang. A kill in flight there is recorded done. Paused sandboxes
stay paused: their files are the node's (or the store's), not its processes'.

A node that comes back later finds those rows dead and removes their VMs (agent.reconcile):
lost is final, never resurrected."""
from __future__ import annotations

from datetime import datetime, timedelta

from asgiref.sync import sync_to_async
from django.conf import settings
from django.utils import timezone

from nodes.models import Node

from sandboxes.models import Sandbox, SandboxEvent
from sandboxes.states import LOST
from sandboxes.transitions import transition_sync

ACTOR = "lifecycle"


def dead_nodes(now: datetime) -> list[Node]:
    cutoff = now - timedelta(seconds=settings.AENV_NODE_LOST_AFTER)
    return list(Node.objects.filter(last_heartbeat_at__lt=cutoff))


@sync_to_async
def mark_lost(now: datetime | None = None, limit: int = 500) -> list[tuple[str, str, str]]:
    """Declares the sandboxes of dead nodes lost; returns ``[(sandbox_id, from, to)]``."""
    now = now or timezone.now()
    done = []
    for node in dead_nodes(now):
        silent = int((now - node.last_heartbeat_at).total_seconds())
        reason = f"lost: node {node.pk} stopped answering (no heartbeat for {silent} s)"
        rows = Sandbox.objects.filter(node=node, state__in=list(LOST)).only("id", "state", "updated_at")[:limit]
        for row in rows:
            to_state = next(iter(LOST[row.state]))
            event = SandboxEvent(sandbox_id=row.pk, operation="lost", outcome="ok", from_state=row.state,
                                 started_at=now, message=reason, actor=ACTOR,
                                 details={"node": node.pk, "last_heartbeat_at": node.last_heartbeat_at.isoformat()})
            fields = {"error_reason": reason} if to_state == "error" else {"killed_at": now}
            if transition_sync(row.pk, [row.state], to_state, event, where={"updated_at": row.updated_at},
                               **fields):
                done.append((row.pk, row.state, to_state))
    return done
