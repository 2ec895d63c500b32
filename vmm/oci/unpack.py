"""Unpacks a pulled image's layers into a directory tree whose metadata depends only on the image.

Why umoci: applying layers correctly (OCI whiteouts and opaque directories, hard links across
entries, xattrs, device nodes, owners, and never writing outside the tree whatever the
layer's paths and links say) is what it is built and fuzzed for. As root it keeps the layers'
owners (``umoci raw unpack`` without ``--rootless``).

Why a pass after it: the guest disk is built from this tree and must be the same bytes on every
node (vmm.oci.ext4), so nothing of the unpacking moment may remain in it. umoci restores every
entry's mtime from the layer, but a directory a layer does not list (``a/b/f`` without ``a/``)
is created at the time of unpacking. So a directory with an mtime at or after the unpack
started gets the build epoch (edge: a layer that dates a directory in the future of the node's
clock is normalised on one node and not on another). ctime cannot be set from user space and
atime moves whenever the tree is read: the ext4 step rewrites both in the filesystem it builds.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from vmm.oci import tools
from vmm.oci.errors import OciError
from vmm.oci.store import PulledImage


def unpack(image: PulledImage, dest: Path, epoch: int, timeout: float = 3600) -> None:
    """Unpacks `image` into `dest` (must not exist) and normalises its timestamps."""
    if os.geteuid() != 0:
        raise OciError("unpacking an image for a guest disk needs root (file owners, device nodes)")
    dest = Path(dest)
    if dest.exists():
        raise OciError(f"{dest} already exists")
    started_ns = time.time_ns()
    tools.run(["umoci", "raw", "unpack", "--image", f"{image.layout}:{image.layout_ref}", str(dest)],
              timeout=timeout)
    normalise_times(dest, started_ns, epoch)


def normalise_times(root: Path, since_ns: int, epoch: int) -> int:
    """Directories with mtime >= since_ns (made by the unpack, not by a layer) get mtime =
    epoch. Returns how many were re-dated."""
    redated = 0
    for dirpath, _dirnames, _filenames in os.walk(root):
        if os.lstat(dirpath).st_mtime_ns >= since_ns:
            os.utime(dirpath, (epoch, epoch), follow_symlinks=False)
            redated += 1
    return redated
