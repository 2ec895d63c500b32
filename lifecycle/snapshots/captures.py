"""Releasing fork captures (``Snapshot.fork_capture``: a fork's capture stored so that its
children on other nodes restore it lazily). Every child restored from one names it as its
source and reads its files copy-on-write (memory and disk layers; on other nodes through a
lazy mount of its chunks), so it stays while any such sandbox is live — paused ones too — and
goes right after: at the end of a fork whose children all failed, else at the sweeper's next
look after the last child is gone (``release_unused``).

A release drops the copies other nodes hold (their lazy mounts or cached downloads, which no
VM reads any more) and then deletes it as any snapshot: its node's files, the bucket's
objects, the row."""
from __future__ import annotations

import logging

from django.utils import timezone

from nodes.models import Node
from sandboxes.errors import LifecycleError
from sandboxes.models import Sandbox
from sandboxes.states import LIVE
from snapshots.models import Snapshot
from snapshots.states import DELETABLE

from lifecycle import sources
from lifecycle.snapshots.common import delete_files_quietly
from lifecycle.snapshots.delete import delete_with_files

log = logging.getLogger(__name__)

ACTOR = "lifecycle"


def _unused():
    """Fork captures that may be deleted, that no live sandbox restored from and whose upload
    is not running (``lease_upload``)."""
    used = Sandbox.objects.filter(state__in=LIVE, source_snapshot__isnull=False).values("source_snapshot_id")
    return (Snapshot.objects.filter(fork_capture=True, state__in=list(DELETABLE)).exclude(pk__in=used)
            .exclude(uploading_until__gt=timezone.now()))


async def lease_upload(snapshot_id: str, until) -> None:
    """The capture's upload runs until ``until`` at the latest (None: it ended): no release
    meanwhile, so a delete never races it (its children may all be gone before it ends: a
    handed-over capture's fork answers before its upload does)."""
    await Snapshot.objects.filter(pk=snapshot_id).aupdate(uploading_until=until)


async def release_if_unused(snapshot_id: str, actor: str = ACTOR) -> bool:
    """Deletes the fork capture ``snapshot_id`` if nothing live uses it; True if it went.
    A failure (its node unreachable) is logged and leaves it for the next sweep."""
    snapshot = await _unused().select_related("node").filter(pk=snapshot_id).afirst()
    if snapshot is None:
        return False
    elsewhere = await sources.holders(snapshot)
    async for node_id in Sandbox.objects.filter(source_snapshot_id=snapshot_id).values_list("node_id", flat=True):
        elsewhere.add(node_id)
    elsewhere.discard(snapshot.node_id)
    async for node in Node.objects.filter(pk__in=[n for n in elsewhere if n]).order_by("pk"):
        if node.is_alive():
            dropped = await delete_files_quietly(node, snapshot_id)
            if not dropped.get("ok"):
                log.warning("fork capture %s: node %s kept its copy: %s", snapshot_id, node.pk, dropped.get("error"))
    try:
        await delete_with_files(snapshot, actor)
    except LifecycleError as exc:  # a child appeared (none can), or the files stayed: next sweep
        log.warning("fork capture %s not released: %s", snapshot_id, exc.message)
        return False
    log.info("fork capture %s released (no live sandbox restored from it)", snapshot_id)
    return True


async def release_unused(limit: int = 20, actor: str = ACTOR) -> list[str]:
    """The sweeper's part: releases up to ``limit`` fork captures nothing live uses any more."""
    ids = [pk async for pk in _unused().order_by("created_at").values_list("pk", flat=True)[:limit]]
    return [pk for pk in ids if await release_if_unused(pk, actor)]
