"""Delete a snapshot: ``ready → deleting``, refused while live sandboxes restored from it,
or template builds running on it, still read its files; the files go first (on its node, or
any node with the s3 store), then the row."""
from __future__ import annotations

import asyncio
import logging
import time

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db.models import Q

from lifecycle.sandboxes import core
from nodes.models import Node
from sandboxes.errors import Conflict, NotFound
from sandboxes.models import Sandbox, Team, Template
from sandboxes.states import LIVE

from lifecycle import sources
from lifecycle.sources import normalize_ref
from snapshots.models import Snapshot, SnapshotState as SS
from snapshots.states import KEEP
from snapshots.transitions import transition, transition_sync
from template_builds.models import BuildStatus, TemplateBuild
from lifecycle.snapshots.common import delete_files_quietly, node_error

log = logging.getLogger(__name__)

DELETE_DEADLINE = 60.0


async def delete_snapshot(team: Team, snapshot_id: str, actor: str = "", build_result: bool = False) -> None:
    """Deletes a snapshot (by id or name) with its files. Unknown, another team's or
    already being deleted: NotFound. Still creating, or a live sandbox restored from it
    still reads its layers and memory: Conflict (kill those first). ``build_result``: a
    template build's snapshot (the template's delete)."""
    snapshot = await sources.snapshot_of(team, snapshot_id, build_result=build_result)
    if snapshot is None or snapshot.state == SS.DELETING:
        note = ""
        if await Template.objects.filter(Q(pk=snapshot_id) | Q(alias=snapshot_id)).aexists():
            note = " (it names a template, not a snapshot, and not one of this team's templates)"
        raise NotFound(f'snapshot "{snapshot_id}" not found{note}')
    if snapshot.state == SS.CREATING:
        raise Conflict(f'snapshot "{snapshot.id}" is still being created')
    await delete_with_files(snapshot, actor)


async def delete_with_files(snapshot: Snapshot, actor: str = "") -> None:
    """``→ deleting`` (Conflict while live sandboxes restored from it remain), its files, then
    its row: the delete of a snapshot already looked up (the API's, or a fork capture's release)."""
    # Shielded from the move to "deleting" on: a client that goes away must not leave the
    # snapshot stuck in "deleting".
    await core.shielded(_begin_and_delete(snapshot, actor))


async def _begin_and_delete(snapshot: Snapshot, actor: str) -> None:
    previous = await _begin_delete(snapshot, actor)
    await _delete_on_node(snapshot, previous, actor)


async def _delete_on_node(snapshot: Snapshot, previous: str, actor: str) -> None:
    t0 = time.monotonic()
    if snapshot.node is not None and previous == SS.ERROR:
        await delete_files_quietly(snapshot.node, snapshot.id)  # a failed capture left nothing, normally
    elif snapshot.node is not None:
        client, _ = core.node_api()
        deleter = await _deleting_node(snapshot)
        try:
            result = await asyncio.wait_for(
                client.delete_snapshot_files(deleter, snapshot_id=snapshot.id, deadline=DELETE_DEADLINE),
                timeout=DELETE_DEADLINE + 15)
        except Exception as exc:  # the files are still there: the snapshot stays usable
            error = node_error(client, exc, deleter, "snapshot deletion", DELETE_DEADLINE)
            await transition(snapshot.pk, KEEP[previous], actor=actor, message=f"files not deleted: {error.message}",
                             details={"node": deleter.pk})
            raise error from exc
        log.info("snapshot %s deleted by %s (files: %s, %.0f ms)", snapshot.id, actor, result, core.ms(t0))
    await Snapshot.objects.filter(pk=snapshot.pk).adelete()


async def _deleting_node(snapshot: Snapshot):
    """The node that deletes the files: the snapshot's own — or, with the s3 backend
    (the bucket is the truth, any node can reach it), any alive node when that one is
    gone. Copies cached on other nodes leave by eviction."""
    own = snapshot.node
    if settings.AENV_SNAPSHOT_BACKEND != "s3" or own.is_alive():
        return own
    async for node in Node.objects.filter(draining=False).order_by("id"):
        if node.is_alive():
            return node
    return own  # nobody else either: the node client reports it unavailable


def _builds_on(snapshot: Snapshot) -> list[str]:
    """The team's builds now running on ``snapshot`` (their ``fromTemplate`` names it): the
    build VM reads its disk layers until the build ends. A template built from it earlier
    does not need it (its snapshot holds its own copy of every layer)."""
    team = snapshot.team
    names = {snapshot.id, snapshot.name} - {""}
    running = (TemplateBuild.objects.filter(status=BuildStatus.BUILDING, base_build__isnull=True,
                                            template__team_id=snapshot.team_id)
               .exclude(from_template="").order_by("created_at").values_list("id", "from_template"))
    return [str(bid) for bid, ref in running if normalize_ref(team, ref) in names]


@sync_to_async
def _begin_delete(snapshot: Snapshot, actor: str) -> str:
    """``→ deleting``, then looks for live dependents; with any, back to the previous
    state and 409. Marking first closes the race with a concurrent restore, which
    re-checks the snapshot after inserting its sandbox."""
    if not transition_sync(snapshot.pk, "delete", from_states=[snapshot.state], actor=actor):
        raise NotFound(f'template or snapshot "{snapshot.id}" not found (being deleted)')
    users = list(Sandbox.objects.filter(source_snapshot_id=snapshot.pk, state__in=LIVE)
                 .order_by("created_at").values_list("id", flat=True)[:6])
    builds = _builds_on(snapshot)
    if builds and not users:
        transition_sync(snapshot.pk, KEEP[snapshot.state], actor=actor, message="still used by template builds",
                        details={"builds": builds[:5]})
        raise Conflict(f'snapshot "{snapshot.id}" is the base of running template builds '
                       f"({', '.join(builds[:5])}); wait for them to end before deleting it")
    if users:
        transition_sync(snapshot.pk, KEEP[snapshot.state], actor=actor, message="still used by live sandboxes",
                        details={"sandboxes": users[:5]})
        shown = ", ".join(users[:5]) + (", …" if len(users) > 5 else "")
        raise Conflict(f'snapshot "{snapshot.id}" is still used by live sandboxes restored from it '
                       f"({shown}); kill them before deleting it")
    return snapshot.state
