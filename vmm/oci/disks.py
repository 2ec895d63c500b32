"""Guest root disks made from pulled OCI images, cached by image digest and converter key.

Why a cache keyed by content: building a disk (unpack, mke2fs, qcow2) takes seconds to minutes
and its result is a pure function of the image digest and the converter (this package's code
that shapes the bytes and the versions of the tools it runs), so every node computes the same
key and builds, or already has, the same bytes. VMs and template snapshots use the qcow2 as
their read-only base: a finished disk is never rewritten (a new converter writes a new dir).

Layout, under ``<images_dir>/oci/``::

    layout/                        pulled images (vmm.oci.store)
    disks/sha256-<hex>-<key>/      rootfs.qcow2 (0444) + disk.json (digest, key, sha256 of the
                                   qcow2, size, the image config, what prepare() added)
    kmods/<release>-<hash>/        the guest kernel's NFS client modules (vmm.oci.kmods)

A disk made with the guest kernel's NFS modules (``modules``: what template builds ask for) has
a key of its own, the converter key and the modules' content id hashed together: another
kernel gives another disk, and a disk made without them (``modules=None``) keeps the converter
key alone.

A disk is built in ``disks/.tmp-*`` and renamed into place, so a killed build never looks
finished; builds are serialised by ``disks/.build.lock`` (which also makes removing the leftovers
of killed builds safe).

The epoch (SOURCE_DATE_EPOCH of everything aenv writes, and every inode's ctime) is the image's
``created`` time when it has one, else 0: meaningful and the same on every node.

    python -m vmm.oci disk <ref> [--insecure] [--username U --password-stdin]
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from vmm.oci import ext4, prepare, tools, unpack
from vmm.oci.filelock import built_once, locked
from vmm.oci.store import PulledImage

FORMAT = 1  # bump when what a disk contains changes in a way the sources below do not show
_SOURCES = ("prepare.py", "unpack.py", "ext4.py", "disks.py", "kmods.py")


def converter_key() -> str:
    """What shapes a disk's bytes besides the image: this package's converter sources and the
    versions of mke2fs/debugfs (e2fsprogs), umoci and qemu-img. 12 hex digits."""
    here = Path(__file__).parent
    h = hashlib.sha256(f"format={FORMAT}\n".encode())
    for name in _SOURCES:
        h.update(name.encode() + b"\0" + (here / name).read_bytes() + b"\0")
    for tool in ("mke2fs", "umoci", "qemu-img"):
        h.update(f"{tool}={tools.version(tool)}\n".encode())
    return h.hexdigest()[:12]


@dataclass(frozen=True)
class OciDisk:
    """A built guest root disk for one image digest."""

    dir: Path
    digest: str          # the image's manifest digest
    key: str             # converter_key() it was built with
    sha256: str          # of rootfs.qcow2
    size_mb: int         # virtual size of the disk (the ext4 filesystem)
    config: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)  # the whole disk.json
    reused: bool = False  # True: found in the cache, not built by this call

    @property
    def rootfs(self) -> Path:
        return self.dir / "rootfs.qcow2"

    @property
    def id(self) -> str:
        """The disk's content identity: image digest + converter key (the dir name)."""
        return self.dir.name

    @classmethod
    def from_dir(cls, path: Path, reused: bool = True) -> "OciDisk":
        meta = json.loads((path / "disk.json").read_text())
        return cls(dir=path, digest=meta["digest"], key=meta["key"], sha256=meta["sha256"], size_mb=meta["size_mb"],
                   config=meta.get("config") or {}, meta=meta, reused=reused)


def disks_dir(images_dir: Path) -> Path:
    return Path(images_dir).resolve() / "oci" / "disks"


def disk_key(modules=None) -> str:
    """The key of a disk made now: converter_key(), with ``modules`` (vmm.oci.kmods.
    KernelModules) the two hashed together. 12 hex digits."""
    key = converter_key()
    if modules is None:
        return key
    return hashlib.sha256(f"{key}+kmods={modules.id}".encode()).hexdigest()[:12]


def disk_dir(images_dir: Path, digest: str, key: str | None = None) -> Path:
    return disks_dir(images_dir) / f"sha256-{digest.partition(':')[2]}-{key or converter_key()}"


def find_disk(images_dir: Path, digest: str, modules=None) -> OciDisk | None:
    """The finished disk of `digest` for this converter (and ``modules``), or None (never builds)."""
    d = disk_dir(images_dir, digest, disk_key(modules))
    return OciDisk.from_dir(d) if (d / "disk.json").is_file() else None


def epoch_of(image: PulledImage) -> int:
    """The image's creation time in whole seconds (0 without a parsable one)."""
    text = (image.created or "").strip()
    if not text:
        return 0
    if text.endswith("Z"):
        text = text[:-1] + "+00:00"
    date, sep, rest = text.partition(".")
    if sep:  # RFC 3339 allows nanoseconds; fromisoformat does not: drop the fraction
        tz = next((i for i, c in enumerate(rest) if c in "+-"), len(rest))
        text = date + rest[tz:]
    try:
        return max(0, int(datetime.fromisoformat(text).timestamp()))
    except ValueError:
        return 0


def build(image: PulledImage, out: Path, work: Path, progress=lambda m: None, key: str | None = None,
          modules=None) -> dict:
    """Builds `image`'s disk into `out` (rootfs.qcow2 + disk.json) using `work` for the tree
    and the raw image, with the kernel ``modules`` when given; returns the disk.json content.
    The same image, converter and modules give the same rootfs.qcow2 bytes wherever and
    whenever this runs."""
    key = key or disk_key(modules)
    epoch = epoch_of(image)
    t0 = time.monotonic()
    tree = work / "rootfs"
    progress(f"unpacking {image.digest} ({len(image.layers)} layers)")
    unpack.unpack(image, tree, epoch)
    added = prepare.prepare(tree, epoch, modules)
    t_unpack = time.monotonic()
    progress("building ext4")
    raw = work / "rootfs.ext4"
    facts = ext4.make_ext4(tree, raw, seed=f"{image.digest}/{key}", epoch=epoch, work=work)
    shutil.rmtree(tree)
    t_ext4 = time.monotonic()
    ext4.to_qcow2(raw, out / "rootfs.qcow2")
    raw.unlink()
    digest = ext4.sha256(out / "rootfs.qcow2")
    meta = {"digest": image.digest, "key": key, "sha256": digest, "size_mb": facts["size_mb"],
            "used_bytes": facts["used_bytes"], "inodes": facts["inodes"], "fs_uuid": facts["uuid"],
            "epoch": epoch, "ref": image.ref, "config": image.config, "created": image.created,
            "layers": [x.digest for x in image.layers], "prepared": added,
            "tools": {t: tools.version(t) for t in ("mke2fs", "umoci", "qemu-img", "skopeo")},
            "timings_s": {"unpack": round(t_unpack - t0, 2), "ext4": round(t_ext4 - t_unpack, 2),
                          "qcow2": round(time.monotonic() - t_ext4, 2)}}
    (out / "disk.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
    return meta


def ensure_disk(images_dir: Path, image: PulledImage, progress=lambda m: None, modules=None) -> OciDisk:
    """The cached disk of `image` (with the kernel ``modules``, a vmm.oci.kmods.KernelModules,
    when given), built first if missing (idempotent, safe across processes)."""
    key = disk_key(modules)
    final = disk_dir(images_dir, image.digest, key)

    def make(tmp: Path, work: Path) -> None:
        t0 = time.monotonic()
        build(image, tmp, work, progress, key, modules)
        (tmp / "rootfs.qcow2").chmod(0o444)
        progress(f"disk {final.name} built in {time.monotonic() - t0:.1f}s")

    return built_once(final, "disk.json", make, lambda built: OciDisk.from_dir(final, reused=not built))


def remove_disk(images_dir: Path, digest: str) -> int:
    """Deletes every disk of `digest` (all converter keys); the caller makes sure no VM or
    template uses them. Returns how many."""
    parent = disks_dir(images_dir)
    n = 0
    with locked(parent / ".build.lock"):
        for d in parent.glob(f"sha256-{digest.partition(':')[2]}-*"):
            shutil.rmtree(d)
            n += 1
    return n
