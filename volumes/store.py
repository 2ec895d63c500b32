"""Where volumes' files live: ``AENV_VOLUMES_DIR/<team id>/<volume id>/``.

One directory tree that the API (the content API) and every node (the guests' mounts)
reach at the same path: on one machine ``AENV_HOME/volumes``; in a cluster a shared
filesystem (NFS, CephFS, …) mounted at ``AENV_VOLUMES_DIR`` on the API hosts and on every
node, like a ``posix_fs`` snapshot store."""
from __future__ import annotations

import os
from pathlib import Path

from django.conf import settings

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


def files_of(volume) -> VolumeFiles:
    return VolumeFiles(volume_root(volume.team_id, volume.id), default_owner())


def create_files(volume) -> None:
    make_root(volume_root(volume.team_id, volume.id), default_owner())


def delete_files(root: Path) -> None:
    remove_root(root)
