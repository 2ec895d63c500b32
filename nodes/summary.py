"""Each node as the control plane sees it: status, what placement reserves there, its
sandboxes by kind, how its creates went and its host's figures from the last heartbeat.

Why one module: ``GET /nodes``, the dashboard's nodes page and the API's Prometheus
gauges show the same figures, so they come from this one function; reservations are
placement's own query (``nodes.placement.with_reservations``), never a second count.
Those figures are the operators'; ``for_team`` is the little a tenant is shown.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from django.db.models import Count, Q, Sum
from django.utils import timezone

from sandboxes.models import Sandbox, SandboxEvent
from sandboxes.states import E2B_PAUSED, E2B_RUNNING, LIVE, SandboxState
from template_builds.models import BuildStatus, TemplateBuild

from nodes.models import Node
from nodes.placement import with_reservations

READY, DRAINING, DEAD = "ready", "draining", "dead"
STATUSES = (READY, DRAINING, DEAD)
MIB = 1024 * 1024
# Sandboxes that hold a started VM (E2B shows them running) vs. those still being created.
RUNNING_STATES = E2B_RUNNING - {SandboxState.CREATING}


@dataclass
class NodeSummary:
    """One node's figures; memory in MiB like the rows (the API turns it into bytes)."""

    node: Node
    status: str
    cpu_reserved: int = 0
    memory_reserved_mb: int = 0
    paused_cpu: int = 0
    paused_memory_mb: int = 0
    running: int = 0
    starting: int = 0
    paused: int = 0
    create_successes: int = 0
    create_failures: int = 0
    heartbeat_age: float | None = None
    host: dict = field(default_factory=dict)
    cached_builds: list[str] = field(default_factory=list)  # filled for one team (GET /nodes/{id})

    @property
    def alive(self) -> bool:
        return self.status != DEAD


def status_of(node: Node, now=None) -> str:
    """``dead`` once its heartbeat is older than AENV_NODE_HEARTBEAT_TIMEOUT or its worker
    stopped (whatever else), ``draining`` when the operator drains it, else ``ready``."""
    if not node.is_alive(now):
        return DEAD
    return DRAINING if node.draining else READY


def _sandbox_counts(node_ids: list[str], team=None) -> dict[str, dict]:
    live = Sandbox.objects.filter(node_id__in=node_ids, state__in=LIVE)
    if team is not None:
        live = live.filter(team=team)
    return {
        row["node_id"]: row
        for row in live.order_by().values("node_id").annotate(
            running=Count("id", filter=Q(state__in=RUNNING_STATES)),
            starting=Count("id", filter=Q(state=SandboxState.CREATING)),
            paused=Count("id", filter=Q(state__in=E2B_PAUSED)),
            paused_cpu=Sum("cpu_count", filter=Q(state=SandboxState.PAUSED)),
            paused_memory=Sum("memory_mb", filter=Q(state=SandboxState.PAUSED)),
        )
    }


def create_outcomes(node_ids: list[str] | None = None) -> dict[str, dict[str, int]]:
    """node id → {"ok": n, "error": n}: the creates (restores and fork children too) that
    ended on each node, counted from their events (``details.node`` names the node; a
    create no node was found for counts nowhere). Since the events began: they are the
    durable record, so a worker restart does not reset the counts."""
    rows = (SandboxEvent.objects.filter(operation="create", outcome__in=("ok", "error"))
            .order_by().values("details__node", "outcome").annotate(n=Count("id")))
    out: dict[str, dict[str, int]] = {}
    for row in rows:
        node_id = row["details__node"]
        if not node_id or (node_ids is not None and node_id not in node_ids):
            continue
        out.setdefault(str(node_id), {})[row["outcome"]] = row["n"]
    return out


def summarize(nodes=None, now=None) -> list[NodeSummary]:
    """The summaries of ``nodes`` (a Node queryset; default: every node), in its order."""
    now = now or timezone.now()
    rows = list(with_reservations(nodes if nodes is not None else Node.objects.all()))
    ids = [n.pk for n in rows]
    counts = _sandbox_counts(ids)
    creates = create_outcomes(ids)
    out = []
    for node in rows:
        c = counts.get(node.pk, {})
        made = creates.get(node.pk, {})
        out.append(NodeSummary(
            node=node, status=status_of(node, now), cpu_reserved=node.cpu_reserved,
            memory_reserved_mb=node.memory_reserved, paused_cpu=c.get("paused_cpu") or 0,
            paused_memory_mb=c.get("paused_memory") or 0, running=c.get("running") or 0,
            starting=c.get("starting") or 0, paused=c.get("paused") or 0,
            create_successes=made.get("ok", 0), create_failures=made.get("error", 0),
            heartbeat_age=(now - node.last_heartbeat_at).total_seconds() if node.last_heartbeat_at else None,
            host=node.host if isinstance(node.host, dict) else {},
        ))
    return out


def for_team(team, nodes=None, now=None) -> list[NodeSummary]:
    """What a tenant is shown of each node (``GET /nodes`` with a team's key, the dashboard
    for a user who is not staff): its status and the team's own sandboxes there. Nothing
    else is filled in: other teams' load, reservations, create outcomes and the host's
    figures (address, metrics port, machine) are the operators'."""
    now = now or timezone.now()
    rows = list(nodes if nodes is not None else Node.objects.order_by("id"))
    counts = _sandbox_counts([n.pk for n in rows], team)
    return [NodeSummary(node=node, status=status_of(node, now), running=counts.get(node.pk, {}).get("running") or 0,
                        starting=counts.get(node.pk, {}).get("starting") or 0,
                        paused=counts.get(node.pk, {}).get("paused") or 0) for node in rows]


def summary_of(node_id: str, now=None) -> NodeSummary | None:
    found = summarize(Node.objects.filter(pk=node_id), now)
    return found[0] if found else None


def cached_builds(node_id: str, team) -> list[str]:
    """AgentENV's ``cachedBuilds``: the ready template builds of ``team`` made on this node
    (their snapshot and layers are in its cache). Other teams' builds are never named;
    ``team`` None (an operator): every team's."""
    builds = TemplateBuild.objects.filter(node_id=node_id, status=BuildStatus.READY, template__deleted_at__isnull=True)
    if team is not None:
        builds = builds.filter(template__team=team)
    return [str(pk) for pk in builds.order_by("created_at").values_list("pk", flat=True)]
