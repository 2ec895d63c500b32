"""A volume's size limit: its files live on an ext4 filesystem of their own, in a sparse image
file of the limit's size next to the volume's directory (``<team>/<volume>.img``), loop-mounted
at that directory (``nosuid,nodev,noexec,discard``) on every machine that serves it.

Why an image (docs/volumes.md#size-limits has the comparison): the limit must hold outside the
guest, for every writer at once (several sandboxes through their NFS servers, the content
API), and come back as ENOSPC rather than a hang. Project quotas would do it on the shared
directory, but the kernels aenv runs on (the CI host's included) are built without quota
support (``CONFIG_QFMT_V2`` off, no XFS quota); ganesha has no per-export limit. A filesystem
of the volume's own is a hard bound the kernel enforces on every path, it frees the node's
disk when files are deleted (``discard`` punches holes in the image), and it confines
ganesha's ``open_by_handle_at`` to that volume: a handle can reach no other filesystem.

No Django: the API and the node (``agent.volumes``) both call :func:`ensure_mounted` before
they touch a volume's directory; a flock on the image keeps two processes from mounting it
twice. A volume without an image (made before limits, or with ``AENV_VOLUME_MAX_MB=0``) is a
plain directory and unbounded."""
from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path

SUFFIX = ".img"
MOUNT_OPTIONS = "loop,nosuid,nodev,noexec,discard"
DEFAULT_MB = 10240  # AENV_VOLUME_MAX_MB unset, where a limit can hold (can_limit)
MIN_MB = 4  # ext4's own metadata needs about 1 MiB; below this a volume would hold next to nothing
# Filesystems another machine may mount too (``stat -f`` names): an image on one of them must
# never be loop-mounted, two machines' ext4 drivers writing one image would wreck it.
SHARED_FILESYSTEMS = frozenset({"nfs", "nfs4", "ceph", "cifs", "smb2", "smb", "fuse", "fuseblk", "9p", "glusterfs",
                                "lustre", "gpfs", "afs", "ocfs2", "gfs2", "v9fs"})


class ImageError(Exception):
    """A volume's filesystem could not be made or mounted."""


def image_of(root: Path) -> Path:
    return Path(root).with_name(Path(root).name + SUFFIX)


def bounded(root: Path) -> bool:
    return image_of(root).is_file()


def _run(argv: list[str], what: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise ImageError(f"{what} failed ({done.returncode}): {(done.stderr or done.stdout).strip()[-300:]}")


@contextmanager
def _locked(image: Path):
    fd = os.open(image, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def filesystem_type(path: Path) -> str:
    done = subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True, timeout=30)
    return done.stdout.strip()


def _local(where: Path) -> None:
    kind = filesystem_type(where)
    if kind in SHARED_FILESYSTEMS or kind.startswith("fuse"):
        raise ImageError(f"{where} is on a shared filesystem ({kind}): a volume image there could be mounted by two "
                         "machines at once; set AENV_VOLUME_MAX_MB=0 and bound volumes with the store's own quotas")


def can_limit(where: Path) -> bool:
    """Whether this process can make limited volumes under ``where``: root (loop mounts) on a
    filesystem of this machine's own (the nearest existing folder is asked)."""
    if os.geteuid() != 0:
        return False
    where = Path(where)
    while not where.exists() and where != where.parent:
        where = where.parent
    kind = filesystem_type(where)
    return not (kind in SHARED_FILESYSTEMS or kind.startswith("fuse"))


def _mount(image: Path, root: Path) -> None:
    if os.path.ismount(root):
        return
    _local(image.parent)
    if os.geteuid() != 0:
        raise ImageError(f"{root} is not mounted and only root can mount it (its limit lives in {image.name})")
    _run(["mount", "-t", "ext4", "-o", MOUNT_OPTIONS, str(image), str(root)], f"mounting {image}")


def create(root: Path, size_mb: int, uid: int | None, gid: int | None) -> None:
    """Makes the volume's directory, its image of ``size_mb`` MiB (sparse: the node's disk is
    used as files are written) with an empty ext4 whose root belongs to ``uid:gid``, and mounts
    it there."""
    if size_mb < MIN_MB:
        raise ImageError(f"a volume limit below {MIN_MB} MiB cannot hold a filesystem")
    if os.geteuid() != 0:
        raise ImageError("volume size limits need root (loop mounts): run as root or set AENV_VOLUME_MAX_MB=0")
    root = Path(root)
    image = image_of(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    _local(root.parent)
    root.mkdir(exist_ok=False, mode=0o755)
    try:
        with open(image, "xb") as f:
            f.truncate(size_mb << 20)
        owner = f"{uid if uid is not None else 0}:{gid if gid is not None else 0}"
        # lazy init and no discard: seconds saved, and nothing of the sparse file written
        _run(["mkfs.ext4", "-q", "-F", "-m", "0", "-L", "aenv-volume",
              "-E", f"root_owner={owner},lazy_itable_init=1,lazy_journal_init=1,nodiscard", str(image)],
             f"making the filesystem of {root.name}")
        with _locked(image):
            _mount(image, root)
        (root / "lost+found").rmdir()  # not a file of the volume's
    except BaseException:
        remove(root)
        raise


def ensure_mounted(root: Path) -> bool:
    """Mounts the volume's image at its directory unless it is there already (after a reboot,
    or on another node of the same machine). False for a volume without an image."""
    image = image_of(root)
    if not image.is_file():
        return False
    if os.path.ismount(root):
        return True
    with _locked(image):
        _mount(image, Path(root))
    return True


def usage(root: Path) -> tuple[int, int]:
    """(bytes used, bytes the filesystem can hold) of a mounted volume."""
    st = os.statvfs(root)
    total = st.f_blocks * st.f_frsize
    return total - st.f_bfree * st.f_frsize, total


def free_bytes(root: Path) -> int:
    st = os.statvfs(root)
    return st.f_bavail * st.f_frsize


def remove(root: Path) -> None:
    """Unmounts the volume (lazily if a leftover server still holds it: the filesystem goes
    with its last user) and deletes its image and directory. Nothing is read from it."""
    root, image = Path(root), image_of(root)
    if os.path.ismount(root):
        done = subprocess.run(["umount", str(root)], capture_output=True, timeout=60)
        if done.returncode != 0:
            _run(["umount", "-l", str(root)], f"unmounting {root}")
    image.unlink(missing_ok=True)
    try:
        root.rmdir()
    except FileNotFoundError:
        pass
    except OSError:  # written to while unmounted: the directory's own leftovers
        shutil.rmtree(root, ignore_errors=True)


def mounts_under(path: Path) -> list[str]:
    """Mount points at or under ``path`` (deepest first), from this process's mount table."""
    base = os.path.realpath(path).rstrip("/") + "/"
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].encode().decode("unicode_escape")  # \040 for a space, ...
            if (point + "/").startswith(base):
                found.append(point)
    return sorted(set(found), key=len, reverse=True)


def unmount_under(path: Path) -> list[str]:
    """Unmounts (lazily) every volume filesystem under ``path``: a test stack's or a removed
    store's. Returns the mount points."""
    points = mounts_under(path)
    for point in points:
        subprocess.run(["umount", "-l", point], capture_output=True, timeout=60)
    return points
