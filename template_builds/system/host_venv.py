"""A Python venv for a guest, built on the host: inside the guest's own root filesystem
(the base image's debootstrap stage, ``vmm.images``), at the absolute path it will have in
the guest and with the guest's ``python3``, so its shebangs, ``pyvenv.cfg`` and compiled
files are the guest's. Why: under TCG a ``pip install`` of numpy/pandas/matplotlib and
their byte-compilation take minutes in a build VM and seconds here; the build then only
COPYs the finished tree in.

The stage is never changed: the build runs in private mount, PID and network namespaces
(``unshare``) whose root is the stage bind-mounted read-only, with a tmpfs over ``/opt``
holding the writable output directory, a tmpfs ``/tmp`` holding the wheels (read-only), a
minimal ``/dev`` and a ``/proc``; nothing is reachable on the network (``--no-index``
anyway). Only root can set that up: ``unavailable`` says why a host cannot, and the caller
then installs in the guest as before."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

# The mount namespace's setup, then the command as the guest's root in the chroot. Every
# path comes from the environment, never from the script text.
SCRIPT = r'''
set -eu
mount --bind "$ROOTFS" "$NEWROOT"
mount -o remount,bind,ro "$NEWROOT"
mount -t tmpfs -o mode=755 opt "$NEWROOT/opt"
mkdir -p "$NEWROOT$GUEST_DIR"
mount --bind "$OUT" "$NEWROOT$GUEST_DIR"
mount -t tmpfs -o mode=1777 tmp "$NEWROOT/tmp"
mkdir "$NEWROOT/tmp/wheels"
mount --bind "$WHEELS" "$NEWROOT/tmp/wheels"
mount -o remount,bind,ro "$NEWROOT/tmp/wheels"
mount -t tmpfs -o mode=755 dev "$NEWROOT/dev"
for d in null zero random urandom; do touch "$NEWROOT/dev/$d"; mount --bind "/dev/$d" "$NEWROOT/dev/$d"; done
mkdir "$NEWROOT/dev/shm"
mount -t tmpfs -o mode=1777 shm "$NEWROOT/dev/shm"
mount -t proc proc "$NEWROOT/proc"
exec chroot "$NEWROOT" /usr/bin/env -i PATH=/usr/bin:/bin HOME=/tmp LANG=C.UTF-8 /bin/sh -c "$COMMAND"
'''
TOOLS = ("unshare", "mount", "chroot")
WHEELS_IN_ROOT = "/tmp/wheels"  # where the command finds the wheels


class BuildFailed(Exception):
    pass


def guest_rootfs(images_dir: Path, image: str = "base") -> tuple[str, Path]:
    """The debootstrap stage the image ``image`` was built from: (stage id, its rootfs).
    Raises LookupError saying what is missing."""
    meta_file = Path(images_dir) / image / "image.json"
    try:
        stage = json.loads(meta_file.read_text())["stages"]["debootstrap"]
    except (OSError, ValueError, KeyError, TypeError):
        raise LookupError(f"no built image '{image}' under {images_dir}") from None
    rootfs = Path(images_dir) / "stages" / f"debootstrap-{stage}" / "rootfs"
    if not (rootfs / "usr" / "bin" / "python3").exists():
        raise LookupError(f"the image's root file system stage is not on this host ({rootfs})")
    return stage, rootfs


def unavailable() -> str:
    """Why this process cannot build in a guest root file system ('' when it can)."""
    if os.geteuid() != 0:
        return "not running as root (the build needs its own mount namespace)"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"{', '.join(missing)} not found"
    return ""


def run(rootfs: Path, out: Path, guest_dir: str, wheels: Path, command: str, timeout: float = 1800) -> str:
    """``command`` (``/bin/sh -c``) as root in ``rootfs``, with ``out`` writable at
    ``guest_dir`` and ``wheels`` read-only at ``WHEELS_IN_ROOT``; its output, or BuildFailed."""
    newroot = out.parent / f".root-{out.name}"
    newroot.mkdir()
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "ROOTFS": str(rootfs), "NEWROOT": str(newroot),
           "OUT": str(out), "GUEST_DIR": guest_dir, "WHEELS": str(wheels), "COMMAND": command}
    try:
        # --kill-child: a timeout's kill ends every process of the namespace with it
        proc = subprocess.run(["unshare", "--mount", "--pid", "--net", "--fork", "--kill-child", "--propagation",
                               "private", "/bin/sh", "-c", SCRIPT],
                              env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise BuildFailed(f"the host build took more than {timeout:.0f}s") from None
    finally:
        try:
            newroot.rmdir()  # empty here: the mounts were only ever in the namespace
        except OSError:
            pass
    if proc.returncode != 0:
        raise BuildFailed(f"exit status {proc.returncode}: {(proc.stderr or proc.stdout)[-2000:]}")
    return proc.stdout
