"""Starts a long-lived helper (the node's dnsmasq) in a mount namespace that holds only the
mounts it needs.

Why: a new mount namespace starts as a copy of the node's whole mount table, and on a host
whose root mount is private (containers: nothing propagates) every mount in the copy lives
as long as the process does. A volume's image unmounted and deleted by the node would keep
its loop device, its filesystem and its disk space for the life of the node's resolver. So
the child, once inside its namespace (``unshare --mount --propagation private``), detaches
every mount that holds none of the paths it names (the kernel's ``/proc``, ``/sys`` and
``/dev`` stay), binds what it was asked to bind, and executes the helper.

Run as a script (no imports from aenv: it runs before the helper, under ``python3 -I``)::

    unshare --mount --propagation private -- python3 -I mount_scope.py \\
        --bind SRC DST --need PATH ... -- COMMAND ARGS...
"""
from __future__ import annotations

import ctypes
import errno
import os
import re
import sys

KERNEL = ("/proc", "/sys", "/dev")
MS_BIND, MNT_DETACH = 4096, 2


def _under(path: str, top: str) -> bool:
    return top == "/" or path == top or path.startswith(top.rstrip("/") + "/")


def mount_points(mountinfo: str) -> list[str]:
    """The mount points of a ``/proc/<pid>/mountinfo`` text (field 5, octal escapes undone)."""
    return [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4])
            for line in mountinfo.splitlines() if line.strip()]


def detachable(points: list[str], needed: list[str]) -> list[str]:
    """The topmost mount points holding none of ``needed`` (nor the kernel's filesystems):
    detaching one detaches everything under it, so no deeper one is listed."""
    chosen: list[str] = []
    for point in sorted(set(points), key=lambda p: (p.count("/"), p)):
        if point == "/" or any(_under(point, k) for k in KERNEL):
            continue
        if any(_under(p, point) for p in needed) or any(_under(point, c) for c in chosen):
            continue
        chosen.append(point)
    return chosen


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_void_p]
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    return libc


def detach(point: str, libc) -> None:
    """Detaches every mount stacked at ``point`` (lazily: what still has files open there
    keeps its own reference, in this namespace only)."""
    while libc.umount2(point.encode(), MNT_DETACH) == 0:
        pass
    err = ctypes.get_errno()
    if err not in (errno.EINVAL, errno.ENOENT):  # no longer a mount point; gone with its parent
        raise OSError(err, f"umount {point}: {os.strerror(err)}")


def main(args: list[str]) -> None:
    binds, needed = [], []
    while args and args[0] != "--":
        if args[0] == "--bind" and len(args) >= 3:
            binds.append((args[1], args[2]))
            args = args[3:]
        elif args[0] == "--need" and len(args) >= 2:
            needed.append(os.path.abspath(args[1]))
            args = args[2:]
        else:
            raise SystemExit(f"mount_scope: unexpected {args[0]!r}")
    command = args[1:]
    if not command:
        raise SystemExit("mount_scope: no command after --")
    libc = _libc()
    needed += [os.path.abspath(src) for src, _ in binds] + [os.path.abspath(dst) for _, dst in binds]
    with open("/proc/self/mountinfo") as f:
        points = mount_points(f.read())
    for point in detachable(points, needed):
        detach(point, libc)
    for src, dst in binds:
        if libc.mount(src.encode(), dst.encode(), None, MS_BIND, None) != 0:
            err = ctypes.get_errno()
            raise SystemExit(f"mount_scope: bind {src} at {dst}: {os.strerror(err)}")
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
