"""A bootable GuestImage for an OCI-derived root disk: aenv's kernel, initrd and tools drive + that disk.

Why a regular image dir: drivers, the template cache and snapshot checks all resolve a
``BootSpec.image`` name with ``vmm.images.find_image`` (``<images_dir>/<name>`` -> a dir with
vmlinuz, initrd.cpio, rootfs.qcow2, tools.img and image.json). An OCI image becomes such a dir
of hard links: the kernel, initrd and tools drive of a built aenv image (``base`` by default:
OCI images carry no kernel, and envd and the guest init come from the tools drive whatever the
image contains) next to the OCI disk's rootfs.qcow2. Nothing in the drivers changes, and the
``base`` image is untouched.

Its ``recipe_hash`` covers the disk's identity (image digest + converter key) and the base
image's recipe (kernel, initrd, tools), so template snapshots, which are keyed by
``image.name`` and ``recipe_hash`` (vmm.templates.snapshot_dir), never mix up two root disks,
and a new tools drive or kernel gives a new image (and a cold-boot miss, never a wrong restore).
Like ``base``, ``<images_dir>/<name>`` is a symlink to ``<name>-<recipe_hash>``, repointed
atomically; older builds stay for the sandboxes and snapshots that use them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from vmm.images import GuestImage, digest, find_image
from vmm.oci.disks import OciDisk
from vmm.oci.errors import OciError
from vmm.oci.filelock import locked

FORMAT = 1
_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
_RESERVED = {"base", "oci", "stages", "snapshots"}


def default_name(disk: OciDisk) -> str:
    """``oci-<first 12 hex digits of the image digest>``."""
    return f"oci-{disk.digest.partition(':')[2][:12]}"


def guest_image(images_dir: Path, disk: OciDisk, name: str | None = None, base: str = "base") -> GuestImage:
    """The GuestImage `name` (default default_name()) that boots `disk` with the kernel, initrd
    and tools drive of the built image `base`; made if missing (idempotent). Boot it with
    ``driver.boot(BootSpec(sandbox_id, image=image.name))``."""
    images_dir = Path(images_dir).resolve()
    name = name or default_name(disk)
    if not _NAME.match(name) or name in _RESERVED:
        raise OciError(f"invalid image name {name!r} (lowercase letters, digits, . _ -; not {sorted(_RESERVED)})")
    parent = find_image(images_dir, base)
    recipe = digest({"format": FORMAT, "name": name, "rootfs": disk.id, "rootfs_sha256": disk.sha256,
                     "base": parent.recipe_hash})
    final = images_dir / f"{name}-{recipe}"
    with locked(images_dir / "oci" / "guest.lock"):
        if not (final / "image.json").is_file():
            for stale in images_dir.glob(f".oci-tmp-{name}-*"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".oci-tmp-{name}-", dir=images_dir))
            try:
                for src, dst in ((parent.kernel, "vmlinuz"), (parent.initrd, "initrd.cpio"),
                                 (parent.tools, "tools.img"), (disk.rootfs, "rootfs.qcow2")):
                    os.link(src, tmp / dst)
                meta = {"name": name, "recipe_hash": recipe, "kernel_release": parent.kernel_release,
                        "base": {"name": parent.name, "recipe_hash": parent.recipe_hash},
                        "oci": {"digest": disk.digest, "disk": disk.id, "rootfs_sha256": disk.sha256,
                                "ref": disk.meta.get("ref", ""), "config": disk.config},
                        "built_at": time.time()}
                (tmp / "image.json").write_text(json.dumps(meta, indent=2))
                tmp.chmod(0o755)
                os.rename(tmp, final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        _point(images_dir, name, final)
    return GuestImage.from_dir(final)


def _point(images_dir: Path, name: str, final: Path) -> None:
    """Atomically (re)points ``images_dir/name`` at `final`."""
    link = images_dir / name
    if link.is_symlink() and os.readlink(link) == final.name:
        return
    if link.exists() and not link.is_symlink():
        raise OciError(f"{link} exists and is not an image symlink")
    tmp = images_dir / f".oci-tmp-link-{name}-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    os.symlink(final.name, tmp)
    os.replace(tmp, link)


def remove_guest_image(images_dir: Path, name: str) -> int:
    """Removes the image `name` (its symlink and every ``<name>-<recipe>`` build of an OCI
    image); the caller makes sure no VM or template uses them. Returns how many builds."""
    images_dir = Path(images_dir).resolve()
    n = 0
    with locked(images_dir / "oci" / "guest.lock"):
        link = images_dir / name
        if link.is_symlink():
            link.unlink()
        for d in images_dir.glob(f"{name}-*"):
            try:
                meta = json.loads((d / "image.json").read_text())
            except (OSError, ValueError):
                continue
            if meta.get("name") == name and "oci" in meta:
                shutil.rmtree(d)
                n += 1
    return n
