"""Placement: which node gets a new sandbox (created, restored or forked) or a template
build.

Room is computed from the database (capacity minus what the node's live sandboxes and
running template builds reserve), not from the node's heartbeat, so two creates in quick
succession see each other's reservation as soon as the sandbox row exists.
"""
from datetime import timedelta

from django.conf import settings
from django.db.models import IntegerField, OuterRef, Q, Subquery, Sum
from django.db.models.functions import Coalesce
from django.utils import timezone

from nodes.models import Node
from sandboxes.states import RESERVING
from template_builds.models import BuildStatus, TemplateBuild


class NoNodeAvailable(Exception):
    """No alive, non-draining node has room for the requested resources."""


def _building(field: str) -> Subquery:
    """What the template builds running on the outer node reserve (their build VMs)."""
    builds = (TemplateBuild.objects.filter(node=OuterRef("pk"), status=BuildStatus.BUILDING)
              .order_by().values("node").annotate(total=Sum(field)).values("total"))
    return Coalesce(Subquery(builds, output_field=IntegerField()), 0)


def _candidates():
    cutoff = timezone.now() - timedelta(seconds=settings.AENV_NODE_HEARTBEAT_TIMEOUT)
    live = Q(sandboxes__state__in=RESERVING)
    return Node.objects.filter(draining=False, last_heartbeat_at__gte=cutoff).annotate(
        cpu_reserved=Coalesce(Sum("sandboxes__cpu_count", filter=live), 0) + _building("cpu_count"),
        memory_reserved=Coalesce(Sum("sandboxes__memory_mb", filter=live), 0) + _building("memory_mb"),
    )


def _load(node: Node) -> float:
    cpu = node.cpu_reserved / node.vcpu_capacity if node.vcpu_capacity else 1.0
    mem = node.memory_reserved / node.memory_mb_capacity if node.memory_mb_capacity else 1.0
    return max(cpu, mem)


def _fits(node: Node, cpu_count: int, memory_mb: int) -> bool:
    return (node.cpu_reserved + cpu_count <= node.vcpu_capacity
            and node.memory_reserved + memory_mb <= node.memory_mb_capacity)


async def place(cpu_count: int, memory_mb: int, *, on: Node | None = None, prefer: Node | None = None) -> Node:
    """The one placement decision, for anything that needs room on a node: a create or a
    template build (the least loaded alive node that fits), a fork (``on`` its parent's node: that node or
    nothing), a restore (``on`` the snapshot's node when only it has the files; ``prefer``
    it when any node can fetch them). Raises NoNodeAvailable saying why."""
    wanted = on or prefer
    if wanted is not None:
        node = await _candidates().filter(pk=wanted.pk).afirst()
        if node is not None and _fits(node, cpu_count, memory_mb):
            return node
        if on is not None:
            if node is None:
                raise NoNodeAvailable(f"node {on.pk} is not available (not alive, or draining)")
            raise NoNodeAvailable(f"node {on.pk} has no room for {cpu_count} vCPU / {memory_mb} MiB")
    fitting = [node async for node in _candidates() if _fits(node, cpu_count, memory_mb)]
    if not fitting:
        raise NoNodeAvailable(f"no node has room for {cpu_count} vCPU / {memory_mb} MiB")
    return min(fitting, key=lambda n: (_load(n), n.sandboxes_running, n.id))
