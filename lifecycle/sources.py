"""What a create's ``templateID`` may name besides a template: a snapshot of the team
(by id, name, ``team/name`` or ``name:tag``), and the node a restore from it runs on.

Why its own module: ``lifecycle.sandboxes.create`` needs this, and the rest of the
snapshot lifecycle builds on the sandbox lifecycle; here neither imports the other."""
from __future__ import annotations

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db.models import Q

from nodes import placement
from nodes.models import Node
from sandboxes.errors import Conflict
from sandboxes.models import Team
from sandboxes.prepared import PreparedQuery

from snapshots.models import Snapshot, SnapshotState as SS


def normalize_ref(team: Team, ref: str) -> str:
    """A snapshot reference as the SDK may spell it: ``id``, ``name``, ``<team>/name`` or
    ``name:tag`` (tags are not versioned here: the name's newest snapshot answers)."""
    ref = (ref or "").strip()
    prefix = f"{team.slug}/"
    if ref.startswith(prefix):
        ref = ref[len(prefix):]
    if ":" in ref:
        ref = ref.split(":", 1)[0]
    return ref


def snapshot_of_sync(team: Team, ref: str, states=None, build_result: bool = False) -> Snapshot | None:
    """The team's snapshot by id, else the newest by that name (optionally in ``states``).
    ``build_result``: a template build's snapshot instead (only its template's delete
    touches those)."""
    ref = normalize_ref(team, ref)
    if not ref:
        return None
    qs = Snapshot.objects.select_related("template", "node").filter(team=team, build_result=build_result,
                                                                       fork_capture=False)
    if states is not None:
        qs = qs.filter(state__in=list(states))
    found = qs.filter(pk=ref).first()
    if found is None:
        found = qs.filter(name=ref).order_by("-created_at", "-id").first()
    return found


snapshot_of = sync_to_async(snapshot_of_sync)


# How many candidate rows ``resolve_snapshot`` reads in its one narrow query before it falls
# back to the exact lookups (many snapshots of one name).
CANDIDATES = 20


def resolve_snapshot_sync(team: Team, ref: str) -> Snapshot | None:
    """The team's snapshot a create's ``templateID`` names, or None if it names none
    (then it is a template). One that exists but is not ready yet is a Conflict.

    The same answer as ``snapshot_of`` ready, then ``snapshot_of`` being created, but a create
    from a template (the common case: no snapshot has that id or name) costs one narrow query
    instead of four full ones (issue 26). Sync (``resolve_snapshot`` is the async one): a
    create resolves its ``templateID`` in one thread hop (``lifecycle.resolve``)."""
    name = normalize_ref(team, ref)
    if not name:
        return None
    rows = _CANDIDATE_ROWS.rows(team=team.pk, name=name)
    if len(rows) == CANDIDATES:  # more than it read: the exact lookups decide
        return _resolve_exactly_sync(team, ref)
    ready = ([pk for pk, _, state in rows if pk == name and state == SS.READY]
             or [pk for pk, row_name, state in rows if row_name == name and state == SS.READY])
    if ready:  # by id first, else the newest of that name
        snapshot = _READY.first(pk=ready[0])
        return snapshot if snapshot is not None else _resolve_exactly_sync(team, ref)  # (changed meanwhile)
    if rows:
        raise Conflict(f'snapshot "{name}" is still being created')
    return None


# resolve_snapshot's reads with their SQL compiled once (sandboxes.prepared; issue 26: compiling
# them cost more than running them, on every create).
_CANDIDATE_ROWS = PreparedQuery(
    lambda team, name: Snapshot.objects.filter(
        Q(pk=name) | Q(name=name), team=team, build_result=False, fork_capture=False,
        state__in=[SS.READY, SS.CREATING]).order_by("-created_at", "-id").values_list("pk", "name", "state")
    [:CANDIDATES],
    team=Team._meta.pk, name=Snapshot._meta.get_field("name"))
_READY = PreparedQuery(
    lambda pk: Snapshot.objects.select_related("template", "node").filter(pk=pk, state=SS.READY).order_by("pk")[:1],
    pk=Snapshot._meta.pk)


def _resolve_exactly_sync(team: Team, ref: str) -> Snapshot | None:
    snapshot = snapshot_of_sync(team, ref, states=[SS.READY])
    if snapshot is None and snapshot_of_sync(team, ref, states=[SS.CREATING]) is not None:
        raise Conflict(f'snapshot "{normalize_ref(team, ref)}" is still being created')
    return snapshot


resolve_snapshot = sync_to_async(resolve_snapshot_sync)
_resolve_exactly = sync_to_async(_resolve_exactly_sync)


async def snapshot_still_ready(snapshot_id: str) -> bool:
    return await Snapshot.objects.filter(pk=snapshot_id, state=SS.READY).aexists()


async def holders(snapshot: Snapshot) -> set[str]:
    """The nodes that have ``snapshot``'s files without a download: the one that took it
    and those whose last heartbeat listed it (``Node.snapshots_here``: their cache)."""
    found = {snapshot.node_id} if snapshot.node_id else set()
    async for node_id, here in Node.objects.values_list("pk", "snapshots_here"):
        if isinstance(here, list) and snapshot.id in here:
            found.add(node_id)
    return found


async def restore_node(snapshot: Snapshot, claim=None):
    """The node a sandbox restored from ``snapshot`` runs on.

    posix_fs: the snapshot's own node (only it has the files). s3: a node that has the
    files (its own, or one that cached them: ``holders``) when one is alive with room (no
    download), else any alive node with room (placement's choice), which fetches them
    from the bucket.

    Called after the sandbox row (with ``source_snapshot``) exists: a snapshot that went
    ``deleting`` meanwhile is a Conflict, so a delete and a restore never both succeed.
    No node for it: ``placement.NoNodeAvailable``. ``claim``: the placement's (see
    ``nodes.placement.place``)."""
    if not await snapshot_still_ready(snapshot.id):
        raise Conflict(f'snapshot "{snapshot.id}" is being deleted', retry=False)
    own = await Node.objects.filter(pk=snapshot.node_id).afirst() if snapshot.node_id else None
    need = (snapshot.cpu_count, snapshot.memory_mb)
    if settings.AENV_SNAPSHOT_BACKEND == "s3":  # the bucket has the files: any node can fetch them
        try:
            return await placement.place(*need, prefer=await holders(snapshot), claim=claim)
        except placement.NoNodeAvailable as exc:
            raise placement.NoNodeAvailable(f"no node can restore snapshot {snapshot.id}: {exc}") from exc
    if own is None:
        raise placement.NoNodeAvailable(f"node {snapshot.node_id} holding snapshot {snapshot.id} is not available")
    try:
        return await placement.place(*need, on=own, claim=claim)
    except placement.NoNodeAvailable as exc:
        holding = f"node {own.pk} holding snapshot {snapshot.id}"
        raise placement.NoNodeAvailable(str(exc).replace(f"node {own.pk}", holding, 1)) from exc
