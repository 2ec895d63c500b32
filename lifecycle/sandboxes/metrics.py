"""Reading the sandbox metrics the nodes sample (``agent.metrics``): a sandbox's samples
in a time window, and the newest sample of each of several sandboxes — E2B's
``GET /sandboxes/{id}/metrics`` and ``GET /sandboxes/metrics``. Team-scoped like every
sandbox read: another team's sandbox is not found (or, in a list, left out)."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

from django.db.models import OuterRef, Subquery

from lifecycle.sandboxes import queries
from sandboxes.models import Sandbox, SandboxMetric, Team
from sandboxes.states import LIVE


def _at(unix_s: int) -> datetime:
    return datetime.fromtimestamp(unix_s, tz=timezone.utc)


async def sandbox_metrics(team: Team, sandbox_id: str, start: int | None = None,
                          end: int | None = None) -> list[SandboxMetric]:
    """The sandbox's samples, oldest first, from ``start`` to ``end`` (unix seconds, both
    inclusive to the second; either may be omitted). NotFound for a sandbox the team's
    API does not show."""
    sandbox = await queries.get_sandbox(team, sandbox_id)
    qs = SandboxMetric.objects.filter(sandbox=sandbox)
    if start is not None:
        qs = qs.filter(timestamp__gte=_at(start))
    if end is not None:
        qs = qs.filter(timestamp__lt=_at(end) + timedelta(seconds=1))
    return [m async for m in qs.order_by("timestamp", "id")]


async def latest_metrics(team: Team, sandbox_ids: list[str]) -> dict[str, SandboxMetric]:
    """sandbox id → its newest sample, for those of ``sandbox_ids`` that are the team's
    live sandboxes and have one."""
    newest = SandboxMetric.objects.filter(sandbox=OuterRef("pk")).order_by("-timestamp", "-id").values("pk")[:1]
    picked = Sandbox.objects.filter(pk__in=sandbox_ids, team=team, state__in=LIVE).annotate(
        newest=Subquery(newest)).values_list("newest", flat=True)
    ids = [pk async for pk in picked if pk is not None]
    return {m.sandbox_id: m async for m in SandboxMetric.objects.filter(pk__in=ids)}
