"""Images from OCI registries as aenv guest root disks (issue 11, item 2).

Why: users bring their environments as container images. aenv boots every sandbox as a VM
with its own kernel, so an image becomes a root disk: pulled into a node-local,
content-addressed store, unpacked, given what an aenv guest needs, and written as a
deterministic ext4 + qcow2 base identified by the image digest, then booted with aenv's own
kernel, initrd and tools drive (envd, the guest init) like the ``base`` image.

| module | job |
|---|---|
| ``reference`` | parse and normalise image references (Docker's grammar) |
| ``store`` | ``pull()`` with skopeo into one shared OCI layout (blobs de-duplicated by digest), ``PulledImage`` (digest, config, layers), ``load``, ``remove``, ``gc`` |
| ``unpack`` | ``umoci raw unpack`` + timestamps that depend on the image only |
| ``prepare`` | what aenv adds to the tree (mount points, hosts, hostname, the `user` account with sudo: the E2B decision is written there) |
| ``kmods`` | the guest kernel's NFS client modules (``modprobe nfsv3``'s), from the base image: volume mounts |
| ``ext4`` | the tree as a byte-for-byte reproducible ext4 and qcow2 |
| ``disks`` | the disk cache ``<images_dir>/oci/disks/sha256-<hex>-<converter key>/`` and ``ensure_disk()`` |
| ``guest`` | ``guest_image()``: a ``GuestImage`` (kernel, initrd, tools of ``base`` + the disk) drivers boot by name |
| ``tools``, ``filelock``, ``errors`` | running the host tools, locks, the errors callers map to statuses |

    from vmm.oci import image_from_registry
    image = image_from_registry(images_dir, "127.0.0.1:5000/team/app:v1", insecure=True)
    driver.boot(BootSpec("sbx-1", image=image.name))

CLI: ``python -m vmm.oci pull|disk|image <ref> [--insecure] [--username U --password-stdin]``.
Needs root (file owners, device nodes) and skopeo, umoci, e2fsprogs, qemu-utils.
"""

from __future__ import annotations

from pathlib import Path

from vmm.images import GuestImage
from vmm.oci.disks import OciDisk, ensure_disk, find_disk
from vmm.oci.errors import ImagePullError, OciError, ToolMissing
from vmm.oci.guest import guest_image
from vmm.oci.store import PulledImage, pull

__all__ = ["ImagePullError", "OciDisk", "OciError", "PulledImage", "ToolMissing", "ensure_disk", "find_disk",
           "guest_image", "image_from_registry", "pull"]


def image_from_registry(images_dir: Path, image_ref: str, credentials: tuple[str, str] | None = None,
                        insecure: bool = False, name: str | None = None, base: str = "base",
                        progress=lambda m: None) -> GuestImage:
    """Pull + disk (with ``base``'s NFS client modules) + GuestImage in one call (each step
    cached): what a template's ``fromImage`` / ``fromImageRegistry`` base phase starts from."""
    from vmm.images import find_image
    from vmm.oci import kmods

    pulled = pull(image_ref, images_dir, credentials=credentials, insecure=insecure, progress=progress)
    modules = kmods.for_image(images_dir, find_image(images_dir, base), progress=progress)
    disk = ensure_disk(images_dir, pulled, progress=progress, modules=modules)
    return guest_image(images_dir, disk, name=name, base=base)
