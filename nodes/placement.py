"""Placement: which node gets a new sandbox.

Room is computed from the database (capacity minus what the node's live sandboxes
reserve), not from the node's heartbeat, so two creates in quick succession see
each other's reservation as soon as the sandbox row exists.
"""
from datetime import timedelta

from django.conf import settings
from django.db.models import Q, Sum
from django.db.models.functions import Coalesce
from django.utils import timezone

from nodes.models import Node
from sandboxes.states import RESERVING



class NoNodeAvailable(Exception):
    """No alive, non-draining node has room for the requested resources."""


def _candidates():
    cutoff = timezone.now() - timedelta(seconds=settings.AENV_NODE_HEARTBEAT_TIMEOUT)
    live = Q(sandboxes__state__in=RESERVING)
    return Node.objects.filter(draining=False, last_heartbeat_at__gte=cutoff).annotate(
        cpu_reserved=Coalesce(Sum("sandboxes__cpu_count", filter=live), 0),
        memory_reserved=Coalesce(Sum("sandboxes__memory_mb", filter=live), 0),
    )


def _load(node: Node) -> float:
    cpu = node.cpu_reserved / node.vcpu_capacity if node.vcpu_capacity else 1.0
    mem = node.memory_reserved / node.memory_mb_capacity if node.memory_mb_capacity else 1.0
    return max(cpu, mem)


async def pick_node(cpu_count: int, memory_mb: int) -> Node:
    """The least loaded alive node that still fits `cpu_count` vCPUs and `memory_mb`."""
    fitting = [
        node
        async for node in _candidates()
        if node.cpu_reserved + cpu_count <= node.vcpu_capacity
        and node.memory_reserved + memory_mb <= node.memory_mb_capacity
    ]
    if not fitting:
        raise NoNodeAvailable(f"no node has room for {cpu_count} vCPU / {memory_mb} MiB")
    return min(fitting, key=lambda n: (_load(n), n.sandboxes_running, n.id))


async def has_room(node_id: str, cpu_count: int, memory_mb: int) -> bool:
    """Whether one given node (a snapshot's, a fork parent's) fits ``cpu_count`` vCPUs and
    ``memory_mb`` more, by the same arithmetic as ``pick_node``."""
    node = await _candidates().filter(pk=node_id).afirst()
    return (node is not None and node.cpu_reserved + cpu_count <= node.vcpu_capacity
            and node.memory_reserved + memory_mb <= node.memory_mb_capacity)
