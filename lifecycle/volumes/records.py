"""A team's volumes: create (row + empty directory), list, get, delete (refused while a
live sandbox or a snapshot mounts it: E2B SDK users get a 409, never a volume pulled out
from under a running guest)."""
from __future__ import annotations

import logging

from asgiref.sync import sync_to_async
from django.db import IntegrityError, transaction
from django.db.models import Max

from sandboxes.errors import Conflict, Invalid, NotFound
from sandboxes.models import Team
from sandboxes.states import LIVE
from snapshots.states import LIVE as SNAPSHOT_LIVE
from volumes import rules, store
from volumes.models import SandboxVolume, SnapshotVolume, Volume

log = logging.getLogger(__name__)
# NFS export ids are 16 bits in nfs-ganesha; 0 is its pseudo root.
MAX_EXPORT_ID = 65535


@sync_to_async
def create_volume(team: Team, name: object) -> Volume:
    problem = rules.name_problem(name)
    if problem:
        raise Invalid(problem)
    for _ in range(5):
        try:
            with transaction.atomic():
                if Volume.objects.filter(team=team, name=name).exists():
                    raise Invalid(f"Volume with name '{name}' already exists")
                last = Volume.objects.filter(team=team).aggregate(m=Max("export_id"))["m"] or 0
                if last >= MAX_EXPORT_ID:
                    raise Invalid(f"a team has at most {MAX_EXPORT_ID} volumes over its lifetime")
                volume = Volume.objects.create(team=team, name=name, export_id=last + 1)
                store.create_files(volume)  # inside the transaction: no row without its directory
            return volume
        except IntegrityError:
            continue  # a concurrent create took the name or the export id: look again
    raise Invalid(f"Volume with name '{name}' already exists")


async def list_volumes(team: Team) -> list[Volume]:
    return [v async for v in Volume.objects.filter(team=team).order_by("name", "id")]


async def get_volume(team: Team, volume_id: str) -> Volume:
    volume = await Volume.objects.filter(team=team, pk=volume_id).afirst()
    if volume is None:
        raise NotFound(f"volume '{volume_id}' not found")
    return volume


def users_of(volume: Volume) -> tuple[list[str], list[str]]:
    """(live sandboxes, snapshots) that mount ``volume``."""
    # ordered by the id alone: the models' default ordering (path) would make DISTINCT keep
    # one row per path, naming a sandbox that mounts the volume twice twice
    sandboxes = list(SandboxVolume.objects.filter(volume=volume, sandbox__state__in=LIVE)
                     .order_by("sandbox_id").values_list("sandbox_id", flat=True).distinct())
    snapshots = list(SnapshotVolume.objects.filter(volume=volume, snapshot__state__in=SNAPSHOT_LIVE)
                     .order_by("snapshot_id").values_list("snapshot_id", flat=True).distinct())
    return sandboxes, snapshots


@sync_to_async
def delete_volume(team: Team, volume_id: str) -> None:
    with transaction.atomic():
        # Locked so a create that mounts it waits (PostgreSQL; SQLite serializes writers).
        volume = Volume.objects.select_for_update().filter(team=team, pk=volume_id).first()
        if volume is None:
            raise NotFound(f"volume '{volume_id}' not found")
        sandboxes, snapshots = users_of(volume)
        if sandboxes:
            raise Conflict(f"volume '{volume.name}' is mounted by sandbox(es) {', '.join(sorted(sandboxes)[:10])}; "
                           "kill them first", retry=False)
        if snapshots:
            raise Conflict(f"volume '{volume.name}' is mounted in snapshot(s) {', '.join(sorted(snapshots)[:10])}; "
                           "delete them first", retry=False)
        root = store.volume_root(volume.team_id, volume.id)
        volume.delete()
    store.delete_files(root)  # after the commit: a refused or failed delete keeps every file
