"""A node's side of volume mounts: the sandbox's NFS server in its slot
(``vmm.net.volume_server``), started whenever the VM gets a slot (boot, restore, resume, each
fork child) and stopped when it loses it (pause to disk, kill), and the guest's mounts, made
through envd as root when a guest has not mounted them yet (a boot, or volumes a create adds
to a snapshot's).

A task's ``volumes`` argument: ``[{"dir": "<team>/<volume>", "export_id": n, "path": "/mnt/x",
"mount": bool}]`` (``lifecycle.volumes.mounts``); files under ``AENV_VOLUMES_DIR``."""
from __future__ import annotations

import logging
import os
import secrets
import shlex
import shutil
from pathlib import Path

from django.conf import settings

from envd_client import EnvdClient
from volumes import image

log = logging.getLogger(__name__)

MOUNT_DEADLINE = 120.0  # the first mount loads the nfs modules: seconds under TCG
HANDLE_SECRET = ".nfs-handle-secret"  # in AENV_VOLUMES_DIR: shared by every node, like the volumes


class VolumesUnavailable(Exception):
    """This node cannot give a guest its volumes (no NFS server installed, no network slot)."""


class MountFailed(Exception):
    """The guest could not mount its volumes."""


def run_dir(sandbox_id: str) -> Path:
    return Path(settings.AENV_HOME) / "volume-servers" / sandbox_id


def handle_secret() -> bytes:
    """The secret the volumes' NFS handle keys derive from (``nfs_guard.volume_key``). It
    lives in the volume store, so every node that sees the volumes derives the same keys and a
    guest's handles stay good after a resume or a fork on another node; made once, 0600."""
    path = Path(settings.AENV_VOLUMES_DIR) / HANDLE_SECRET
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:  # another node made it first
            data = path.read_bytes()
        else:
            data = secrets.token_bytes(32)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
    if len(data) < 32:
        raise VolumesUnavailable(f"{path} holds no usable secret ({len(data)} bytes)")
    return data


def _exports(volumes: list[dict]):
    from vmm.net.nfs_guard import volume_key
    from vmm.net.volume_server import Export

    store = Path(settings.AENV_VOLUMES_DIR).resolve()
    secret = handle_secret()
    seen: dict[int, Export] = {}
    for v in volumes:
        root = (store / v["dir"]).resolve()
        if store not in root.parents:
            raise VolumesUnavailable(f"volume directory {v['dir']!r} is outside AENV_VOLUMES_DIR")
        if not root.is_dir():
            raise VolumesUnavailable(f"volume directory {root} does not exist on this node (AENV_VOLUMES_DIR must be "
                                     "the shared volume store)")
        try:  # a volume with a limit is a filesystem of its own: exported mounted, never its empty directory
            image.ensure_mounted(root)
        except image.ImageError as exc:
            raise VolumesUnavailable(str(exc)) from None
        export_id = int(v["export_id"])
        key = volume_key(secret, str(root.relative_to(store)))
        seen[export_id] = Export(export_id, str(root), f"/{export_id}", key)
    return list(seen.values())


def serve(driver, sandbox_id: str, volumes: list[dict] | None) -> None:
    """Starts (or restarts) the sandbox's server in the slot its VM has now."""
    if not volumes:
        return
    from vmm.net import volume_server

    why = volume_server.available()
    if why:
        raise VolumesUnavailable(why)
    slot_of = getattr(driver, "slot_of", None)
    slot = slot_of(sandbox_id) if slot_of is not None else None
    if slot is None:
        raise VolumesUnavailable(f"sandbox {sandbox_id} has no network slot: volumes need the netns network backend")
    volume_server.start(slot, _exports(volumes), run_dir(sandbox_id), uid=settings.AENV_VOLUME_UID,
                        gid=settings.AENV_VOLUME_GID)
    volume_server.open_ports(slot)


def stop(sandbox_id: str) -> None:
    from vmm.net import volume_server

    try:
        volume_server.stop(run_dir(sandbox_id))
    except OSError:
        log.warning("could not stop the volume server of %s", sandbox_id, exc_info=True)


def stop_orphans(driver) -> list[str]:
    """Stops the servers of sandboxes whose VM no longer runs here (killed, lost, saved to
    disk by a reconcile, or gone while the worker was away): a server outlives its worker, never
    its VM. Returns their sandbox ids."""
    from vmm.driver import VMStatus

    root = Path(settings.AENV_HOME) / "volume-servers"
    stopped = []
    for d in sorted(root.iterdir()) if root.is_dir() else ():
        if driver.inspect(d.name).status in (VMStatus.RUNNING, VMStatus.PAUSED):
            continue
        stop(d.name)
        try:
            shutil.rmtree(d)
        except OSError:
            log.warning("could not remove %s", d, exc_info=True)
        stopped.append(d.name)
    return stopped


def mount(info, access_token: str | None, volumes: list[dict] | None, *, everything: bool = False) -> None:
    """Mounts in the guest the volumes it has not mounted yet (``mount``; all of them after a
    cold boot: ``everything``)."""
    from vmm.net.volume_server import NO_NFS_EXIT, mount_script

    todo = [(f"/{int(v['export_id'])}", v["path"]) for v in volumes or () if everything or v.get("mount")]
    if not todo:
        return
    script = mount_script(todo)
    with EnvdClient.at(info.envd_host, info.envd_port, access_token) as envd:
        result = envd.run_argv("/bin/sh", ["-c", script], user="root", deadline=MOUNT_DEADLINE)
    if result.exit_code == NO_NFS_EXIT:
        raise VolumesUnavailable("this template's guest has no NFS client (the template's root file system has no "
                                 "kernel modules for it, e.g. a template built from an OCI image before aenv added "
                                 "them: rebuild it)")
    if result.exit_code != 0:
        raise MountFailed(f"mounting {', '.join(shlex.quote(p) for _, p in todo)} failed ({result.exit_code}): "
                          f"{(result.stderr or result.stdout).decode(errors='replace')[-500:]}")
