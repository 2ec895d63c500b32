"""The team's snapshots: one by id or name, and the list, keyset-paginated like the
sandbox list."""
from __future__ import annotations

from django.db.models import Q

from lifecycle.sandboxes.queries import Page, decode_page_token, encode_page_token
from sandboxes.errors import NotFound
from sandboxes.models import Team

from snapshots.models import Snapshot, SnapshotState as SS
from lifecycle.sources import normalize_ref, snapshot_of


async def get_snapshot(team: Team, ref: str) -> Snapshot:
    """The team's ready snapshot ``ref`` (an id, a name — its newest —, ``team/name`` or
    ``name:tag``), as listed by ``GET /snapshots``; anything else is NotFound."""
    found = await snapshot_of(team, ref, states=[SS.READY])
    if found is None:
        raise NotFound(f"snapshot '{ref}' not found")
    return found


async def list_snapshots(team: Team, *, sandbox_id: str | None = None, name: str | None = None,
                         limit: int = 100, next_token: str | None = None) -> Page:
    """The team's ready snapshots, newest first, keyset-paginated on (created_at, id)
    so pages never repeat or skip one while others are taken or deleted."""
    qs = Snapshot.objects.filter(team=team, state=SS.READY, build_result=False, fork_capture=False)
    if sandbox_id:
        qs = qs.filter(source_sandbox_id=sandbox_id)
    if name:
        ref = normalize_ref(team, name)
        qs = qs.filter(Q(pk=ref) | Q(name=ref))
    if next_token:
        when, last_id = decode_page_token(next_token)
        qs = qs.filter(Q(created_at__lt=when) | Q(created_at=when, id__lt=last_id))
    rows = [s async for s in qs.order_by("-created_at", "-id")[: limit + 1]]
    more = len(rows) > limit
    rows = rows[:limit]
    return Page(rows, encode_page_token(rows[-1].created_at, rows[-1].id) if more else None)
