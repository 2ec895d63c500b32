"""What the node's OCI images occupy, image by image, when each was last used, and how one
image goes as a whole.

Why here: the files are this package's (layout, disks, guest image dirs) and the
accounting is pure. Deciding *what* goes (the node's limit, what VMs and snapshots still
read) is the node's: ``agent.builder.images``.

An image, by manifest digest, is: its entry in the layout (``vmm.oci.store``), its disks
(``vmm.oci.disks``, every converter key), its guest image dirs (``vmm.oci.guest``:
``<images_dir>/<name>-<recipe>/`` whose image.json names the digest) with the symlinks
pointing at them, and ``<images_dir>/oci/used/sha256-<hex>``, a marker whose mtime is
when a build last used it (touched after the pull, so a disk being built is young too).

Sizes are allocated bytes (``st_blocks * 512``), each inode once: a guest image dir is
hard links of the disk's rootfs.qcow2 and of base's kernel, initrd and tools drive, so it
costs nothing unless a file there has no other link.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from vmm.oci import store
from vmm.oci.disks import disks_dir
from vmm.oci.filelock import locked

USED_DIR = "used"
_DISK_DIR = re.compile(r"^sha256-([0-9a-f]{64})-[0-9a-f]+$")


def _root(images_dir: Path) -> Path:
    return Path(images_dir).resolve()


def used_marker(images_dir: Path, digest: str) -> Path:
    return _root(images_dir) / "oci" / USED_DIR / f"sha256-{digest.partition(':')[2]}"


def mark_used(images_dir: Path, digest: str) -> None:
    """Records that a build uses ``digest`` now (its LRU age)."""
    marker = used_marker(images_dir, digest)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


@dataclass
class OciImage:
    """One image on the node, whatever parts of it are left."""

    digest: str
    in_layout: bool = False
    disks: list[Path] = field(default_factory=list)
    guest_dirs: list[Path] = field(default_factory=list)
    last_used: float = 0.0

    def files(self) -> set[str]:
        """Real paths of every file of its disks and guest image dirs (what a VM, a layer or
        a snapshot would name)."""
        out: set[str] = set()
        for d in (*self.disks, *self.guest_dirs):
            for dirpath, _dirs, names in os.walk(d):
                out.update(os.path.realpath(os.path.join(dirpath, n)) for n in names)
        return out


def inventory(images_dir: Path) -> list[OciImage]:
    """Every image the node holds any part of, oldest use first. An image never marked
    used counts from when its newest part was made (manifest blob, disk, guest dir)."""
    root = _root(images_dir)
    found: dict[str, OciImage] = {}

    def get(digest: str) -> OciImage:
        return found.setdefault(digest, OciImage(digest))

    for digest in store.images(root):
        get(digest).in_layout = True
    ddir = disks_dir(root)
    for d in sorted(ddir.iterdir()) if ddir.is_dir() else []:
        m = _DISK_DIR.match(d.name)
        if m and d.is_dir():
            get(f"sha256:{m.group(1)}").disks.append(d)
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        if d.is_symlink() or not d.is_dir() or d.name.startswith("."):
            continue
        try:
            meta = json.loads((d / "image.json").read_text())
        except (OSError, ValueError):
            continue
        digest = (meta.get("oci") or {}).get("digest") if isinstance(meta, dict) else None
        if isinstance(digest, str) and digest.startswith("sha256:"):
            get(digest).guest_dirs.append(d)
    blobs = store.layout_dir(root) / "blobs" / "sha256"
    for image in found.values():
        made = [_mtime(d / "disk.json") for d in image.disks] + [_mtime(d / "image.json") for d in image.guest_dirs]
        if image.in_layout:  # written by its pull (a pull of blobs already there keeps their age)
            made.append(_mtime(blobs / image.digest.partition(":")[2]))
        image.last_used = _mtime(used_marker(root, image.digest)) or max(made + [0.0])
    return sorted(found.values(), key=lambda i: (i.last_used, i.digest))


class Allocation:
    """Allocated bytes of file trees, each inode counted once across every ``add``."""

    def __init__(self) -> None:
        self.seen: set[tuple[int, int]] = set()
        self.total = 0

    def add(self, path: Path, only_sole_links: bool = False) -> int:
        """Adds the files under ``path`` (or the file itself); ``only_sole_links``: only
        files with no other hard link anywhere (what deleting ``path`` would free of a
        tree of links). Returns the bytes added."""
        added = 0
        for file in _files(Path(path)):
            try:
                st = os.lstat(file)
            except OSError:
                continue
            key = (st.st_dev, st.st_ino)
            if key in self.seen or (only_sole_links and st.st_nlink > 1):
                continue
            self.seen.add(key)
            added += st.st_blocks * 512
        self.total += added
        return added


def _files(path: Path) -> Iterable[str]:
    if path.is_symlink() or path.is_file():
        yield str(path)
        return
    for dirpath, _dirs, names in os.walk(path):
        for n in names:
            yield os.path.join(dirpath, n)


def add_usage(images_dir: Path, alloc: Allocation) -> dict[str, int]:
    """Adds the node's OCI files to ``alloc``: the disks, the layout's blobs and whatever
    the guest image dirs hold alone. Returns the bytes each added."""
    root = _root(images_dir)
    out = {"disks": alloc.add(disks_dir(root)) if disks_dir(root).is_dir() else 0,
           "blobs": 0, "guest": 0}
    blobs = store.layout_dir(root) / "blobs"
    if blobs.is_dir():
        out["blobs"] = alloc.add(blobs)
    for image in inventory(root):
        for d in image.guest_dirs:
            out["guest"] += alloc.add(d, only_sole_links=True)
    return out


class DisksBusy(Exception):
    """A disk is being built right now (its lock is held): removing one has to wait."""


def remove_image(images_dir: Path, image: OciImage) -> None:
    """Deletes the image: its guest image dirs (and the symlinks to them), its disks, its
    layout entry and its used marker; its blobs go with the next ``store.gc()``. The
    caller makes sure nothing uses it. Raises DisksBusy (nothing removed) while any disk is
    being built: the build holds the disk cache's lock for minutes."""
    root = _root(images_dir)
    ddir = disks_dir(root)
    ddir.mkdir(parents=True, exist_ok=True)
    fd = os.open(ddir / ".build.lock", os.O_CREAT | os.O_RDWR, 0o644)  # vmm.oci.disks' lock
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DisksBusy(f"a disk is being built in {ddir}") from None
        with locked(root / "oci" / "guest.lock"):
            names = {d.name for d in image.guest_dirs}
            for link in root.iterdir():
                if link.is_symlink() and os.readlink(link) in names:
                    link.unlink()
            for d in image.guest_dirs:
                shutil.rmtree(d, ignore_errors=True)
        for d in image.disks:
            shutil.rmtree(d, ignore_errors=True)
    finally:
        os.close(fd)
    if image.in_layout:
        store.remove(root, image.digest)
    used_marker(root, image.digest).unlink(missing_ok=True)
