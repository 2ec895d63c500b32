"""Where volumes' files live: ``AENV_VOLUMES_DIR/<team id>/<volume id>/``.

One directory tree that the API (the content API) and every node (the guests' mounts)
reach at the same path: on one machine ``AENV_HOME/volumes``; in a cluster a shared
filesystem (NFS, CephFS, …) mounted at ``AENV_VOLUMES_DIR`` on the API hosts and on every
node, like a ``posix_fs`` snapshot store. A volume with a size limit is a filesystem of its
own mounted at that directory (``volumes.image``), mounted again here whenever it is not."""
from __future__ import annotations

import os
from pathlib import Path

from django.conf import settings

from sandboxes.errors import Unavailable
from volumes import image
from volumes.content import Owner, VolumeFiles, make_root, remove_root


def volume_root(team_id, volume_id: str) -> Path:
    return Path(settings.AENV_VOLUMES_DIR) / str(team_id) / volume_id


def default_owner() -> Owner:
    """New entries belong to the guests' default user (uid/gid ``AENV_VOLUME_UID`` /
    ``AENV_VOLUME_GID``, 1000 as E2B's ``user``) when the server may chown (root);
    otherwise to the server's own user."""
    if os.geteuid() != 0:
        return Owner()
    return Owner(settings.AENV_VOLUME_UID, settings.AENV_VOLUME_GID)


def mounted_root(volume) -> Path:
    """The volume's directory, its filesystem mounted there if it has one of its own."""
    root = volume_root(volume.team_id, volume.id)
    try:
        image.ensure_mounted(root)
    except image.ImageError as exc:
        raise Unavailable(f"volume '{volume.name}' cannot be reached: {exc}") from None
    return root


def files_of(volume) -> VolumeFiles:
    return VolumeFiles(mounted_root(volume), default_owner(), limit_mb=volume.size_mb)


def create_files(volume) -> None:
    root = volume_root(volume.team_id, volume.id)
    if not volume.size_mb:
        make_root(root, default_owner())
        return
    owner = default_owner()
    try:
        image.create(root, volume.size_mb, owner.uid, owner.gid)
    except (image.ImageError, OSError) as exc:
        raise Unavailable(f"the volume's filesystem could not be made: {exc}") from None


def delete_files(root: Path) -> None:
    if image.bounded(root):
        image.remove(root)
    else:
        remove_root(root)
