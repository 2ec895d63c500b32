"""What aenv adds to an unpacked OCI image before it becomes a guest root disk.

Why anything at all: a container image is made to run under a container runtime, which
provides /dev, /proc, /sys, /etc/hosts, /etc/hostname and the user; an aenv guest boots a
kernel on the image's files, with aenv's initramfs and init (vmm/guest) and envd from the
read-only tools drive. What they need from the root filesystem, and nothing more, is added
here, on the host, deterministically (same input tree and epoch -> same bytes):

* **Mount points**: /dev, /proc, /sys (the initramfs moves its mounts there), /run, /tmp
  (1777), /opt/aenv (the tools drive), /etc, /home, /root. Existing ones are left as they are.
* **/etc/hostname** ("aenv") if missing or empty, **/etc/hosts** (localhost, the hostname) if
  missing or without localhost: Docker writes both at run time, so images rarely carry them.
  /etc/resolv.conf is the guest init's (it writes the nameserver of the VM's network).
* **root** in /etc/passwd and /etc/group if missing (envd looks users up with getpwnam).
* **The `user` account, with passwordless sudo.** Decision: E2B runs every template build's
  steps, and its sandboxes' commands, as `user` by default: its builder's "default user" phase
  creates `user` with passwordless sudo if the image lacks it, and finalize makes sure again
  (spec e2b-templates.md §4.1-§4.3). aenv does the same here rather than in a VM step, because
  it then needs no `useradd` in the image (busybox and distroless images have none), it is
  deterministic (a VM step would stamp the current time into /etc/shadow and the inodes), and a
  plain pulled image already boots with the user envd and the template warm-up expect. An
  image that has a `user` keeps it (its uid and home untouched). A new one gets the first id
  from 1000 free as both uid and gid, /home/user (0755) filled from /etc/skel like
  ``useradd -m``, shell /bin/bash (else /bin/sh), an empty password in /etc/shadow when the
  image has one (as aenv's base image: ``passwd -d``), and /etc/sudoers.d/aenv-user
  (``NOPASSWD: ALL``, 0440). Installing sudo itself, like E2B's provisioning of missing
  packages (sudo, curl, ...), needs the network and the distro's package manager: that is the
  template builder's job, in a VM.
* **The guest kernel's NFS client modules** (vmm.oci.kmods, when the caller gives them) in
  /lib/modules/<release>/: aenv's kernel boots the image, and a sandbox mounts its volumes with
  that kernel's NFS client. Only those modules and their modules.dep, never the whole tree. An
  image that has a /lib/modules/<release> of its own (made from aenv's base image) keeps it
  untouched; a tree where they cannot go (a /lib that is a file) gets none, and its sandboxes'
  volume mounts are refused, as before.
* Nothing else: the image's Env, WorkingDir, User, Cmd and Entrypoint are recorded (vmm.oci.store)
  for the template builder, not applied here; E2B starts builds as root with the image's Env
  and runs no image command.

The tree is hostile input: an image may hold ``/etc -> /etc`` (absolute symlinks point into the
host while the tree is unpacked on the host). Every path written here is resolved inside the
root as if it were ``/`` (resolve()): absolute links restart at the root, ``..`` stops there,
and final components are opened with O_NOFOLLOW.

Every file and directory written, and the directories they were added to, get mtime = atime =
the build epoch (the image's own timestamps elsewhere are kept: Python checks .pyc files
against them).
"""

from __future__ import annotations

import os
import shutil
import stat
from collections import deque
from pathlib import Path, PurePosixPath

from vmm.oci.errors import OciError

USER = "user"
HOSTNAME = "aenv"
HOSTS = f"127.0.0.1 localhost\n127.0.1.1 {HOSTNAME}\n::1 localhost ip6-localhost ip6-loopback\n"
SUDOERS = f"{USER} ALL=(ALL:ALL) NOPASSWD: ALL\n"
FIRST_ID = 1000
# path -> mode, created when missing (in this order)
MOUNT_POINTS = {"dev": 0o755, "proc": 0o555, "sys": 0o555, "run": 0o755, "tmp": 0o1777, "etc": 0o755,
                "opt": 0o755, "opt/aenv": 0o755, "home": 0o755, "root": 0o700}
MAX_LINKS = 40


def resolve(root: Path, path: str) -> Path:
    """`path` inside `root`, with symlinks resolved as if `root` were ``/``. The result has
    no symlink in it (its last component may not exist). Raises OciError on a link loop."""
    root = Path(root)
    pending = deque(p for p in PurePosixPath("/" + path.lstrip("/")).parts[1:])
    current: list[str] = []
    links = 0
    while pending:
        part = pending.popleft()
        if part in ("", "."):
            continue
        if part == "..":
            if current:
                current.pop()
            continue
        candidate = root.joinpath(*current, part)
        if candidate.is_symlink():
            links += 1
            if links > MAX_LINKS:
                raise OciError(f"too many levels of symbolic links resolving {path} in the image")
            target = PurePosixPath(os.readlink(candidate))
            if target.is_absolute():
                current = []
                parts = target.parts[1:]
            else:
                parts = target.parts
            pending.extendleft(reversed(parts))
            continue
        current.append(part)
    return root.joinpath(*current)


class _Tree:
    """Writes into an image tree (resolve()d, no-follow) and remembers what it touched."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.touched: set[Path] = set()

    def path(self, path: str) -> Path:
        return resolve(self.root, path)

    def mkdir(self, path: str, mode: int = 0o755, uid: int = 0, gid: int = 0) -> Path:
        """Creates `path` and missing parents (root-owned 0755 parents); existing dirs are kept."""
        target = self.path(path)
        if target.is_dir():
            return target
        rel = target.relative_to(self.root).parts
        for i in range(1, len(rel) + 1):
            p = self.root.joinpath(*rel[:i])
            if p.is_dir():
                continue
            if p.exists() or p.is_symlink():
                raise OciError(f"cannot create /{'/'.join(rel[:i])} in the image: a file is in the way")
            last = i == len(rel)
            os.mkdir(p)
            os.chown(p, uid if last else 0, gid if last else 0, follow_symlinks=False)
            os.chmod(p, mode if last else 0o755)
            self.touched.add(p)
        return target

    def read(self, path: str) -> str | None:
        target = self.path(path)
        if not target.is_file():
            return None
        return target.read_bytes().decode("utf-8", errors="surrogateescape")

    def write(self, path: str, text: str, mode: int = 0o644, uid: int = 0, gid: int = 0) -> Path:
        """Writes a regular file (replacing one; keeping the mode, owner of an existing file)."""
        return self.write_bytes(path, text.encode("utf-8", errors="surrogateescape"), mode, uid, gid)

    def write_bytes(self, path: str, data: bytes, mode: int = 0o644, uid: int = 0, gid: int = 0) -> Path:
        target = self.path(path)
        self.mkdir(str(PurePosixPath("/" + str(target.relative_to(self.root))).parent))
        existing = None
        try:
            existing = os.lstat(target)
        except FileNotFoundError:
            pass
        if existing is not None and not stat.S_ISREG(existing.st_mode):
            raise OciError(f"cannot write /{target.relative_to(self.root)} in the image: not a regular file")
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        if existing is None:
            os.chown(target, uid, gid, follow_symlinks=False)
            os.chmod(target, mode)
        self.touched.add(target)
        return target

    def stamp(self, epoch: int) -> None:
        """mtime = atime = epoch for everything touched and the directories it is in."""
        paths = set()
        for p in self.touched:
            paths.add(p)
            for parent in p.parents:
                if parent == self.root or self.root in parent.parents:
                    paths.add(parent)
        paths.add(self.root)
        for p in sorted(paths):
            os.utime(p, (epoch, epoch), follow_symlinks=False)


def _entries(text: str | None) -> list[list[str]]:
    return [line.split(":") for line in (text or "").splitlines() if line and not line.startswith("#")]


def _append(text: str | None, line: str) -> str:
    text = text or ""
    if text and not text.endswith("\n"):
        text += "\n"
    return text + line + "\n"


def _ensure_user(tree: _Tree, epoch: int) -> dict:
    passwd, group = tree.read("/etc/passwd"), tree.read("/etc/group")
    shell = "/bin/bash" if tree.path("/bin/bash").exists() else "/bin/sh"
    if not any(e[0] == "root" for e in _entries(passwd)):
        passwd = _append(passwd, f"root:x:0:0:root:/root:{shell}")
        tree.write("/etc/passwd", passwd)
    if not any(e[0] == "root" for e in _entries(group)):
        group = _append(group, "root:x:0:")
        tree.write("/etc/group", group)
    for e in _entries(passwd):
        if e[0] == USER and len(e) >= 7:
            return {"name": USER, "uid": int(e[2]), "gid": int(e[3]), "home": e[5], "shell": e[6], "created": False}
    uids = {int(e[2]) for e in _entries(passwd) if len(e) > 2 and e[2].isdigit()}
    gids = {int(e[2]) for e in _entries(group) if len(e) > 2 and e[2].isdigit()}
    uid = FIRST_ID
    while uid in uids or uid in gids:
        uid += 1
    home = f"/home/{USER}"
    tree.write("/etc/passwd", _append(passwd, f"{USER}:x:{uid}:{uid}::{home}:{shell}"))
    if not any(e[0] == USER for e in _entries(group)):
        tree.write("/etc/group", _append(group, f"{USER}:x:{uid}:"))
    shadow = tree.read("/etc/shadow")
    if shadow is not None and not any(e[0] == USER for e in _entries(shadow)):
        tree.write("/etc/shadow", _append(shadow, f"{USER}::{epoch // 86400}:0:99999:7:::"))
    gshadow = tree.read("/etc/gshadow")
    if gshadow is not None and not any(e[0] == USER for e in _entries(gshadow)):
        tree.write("/etc/gshadow", _append(gshadow, f"{USER}:!::"))
    home_dir = tree.mkdir(home, 0o755, uid, uid)
    _copy_skel(tree, home_dir, uid)
    return {"name": USER, "uid": uid, "gid": uid, "home": home, "shell": shell, "created": True}


def _copy_skel(tree: _Tree, home_dir: Path, uid: int) -> None:
    """/etc/skel's files into the new home, owned by the user (``useradd -m``)."""
    skel = tree.path("/etc/skel")
    if not skel.is_dir():
        return
    for dirpath, dirnames, filenames in os.walk(skel):
        dirnames.sort()
        rel = Path(dirpath).relative_to(skel)
        for name in sorted(dirnames):
            dst = home_dir / rel / name
            if not dst.exists() and not (Path(dirpath) / name).is_symlink():
                os.mkdir(dst)
                shutil.copystat(Path(dirpath) / name, dst)
                os.chown(dst, uid, uid)
                tree.touched.add(dst)
        for name in sorted(filenames + [d for d in dirnames if (Path(dirpath) / d).is_symlink()]):
            src, dst = Path(dirpath) / name, home_dir / rel / name
            if dst.exists() or dst.is_symlink():
                continue
            st = os.lstat(src)
            if stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(src), dst)
            elif stat.S_ISREG(st.st_mode):
                shutil.copyfile(src, dst, follow_symlinks=False)
                os.chmod(dst, stat.S_IMODE(st.st_mode))
            else:
                continue
            os.chown(dst, uid, uid, follow_symlinks=False)
            tree.touched.add(dst)


def add_kernel_modules(tree: _Tree, modules) -> dict:
    """Copies ``modules`` (a vmm.oci.kmods.KernelModules) to /lib/modules/<release>/ unless
    the image has that directory; returns what happened (never raises for the tree's shape:
    a disk without them only cannot mount volumes)."""
    target = f"/lib/modules/{modules.release}"
    done = {"release": modules.release, "id": modules.id, "modules": list(modules.modules)}
    if tree.path(target).exists():
        return {**done, "added": False, "why": "the image has its own"}
    try:
        for rel in modules.files():
            tree.write_bytes(f"{target}/{rel}", (modules.dir / rel).read_bytes())
    except OciError as exc:
        return {**done, "added": False, "why": str(exc)}
    return {**done, "added": True}


def prepare(root: Path, epoch: int, modules=None) -> dict:
    """Adds what an aenv guest needs to the image tree at `root` (see the module docstring),
    with ``modules`` (vmm.oci.kmods.KernelModules) when given; returns what it did (recorded
    in the disk's JSON). Runs as root (file owners)."""
    if os.geteuid() != 0:
        raise OciError("preparing a guest root filesystem needs root (file owners)")
    tree = _Tree(root)
    os.chmod(root, 0o755)
    os.chown(root, 0, 0)
    created = []
    for path, mode in MOUNT_POINTS.items():
        if not tree.path(path).exists():
            tree.mkdir(path, mode)
            created.append(f"/{path}")
    hostname = tree.read("/etc/hostname")
    if not (hostname or "").strip():
        tree.write("/etc/hostname", HOSTNAME + "\n")
        created.append("/etc/hostname")
    hosts = tree.read("/etc/hosts")
    if hosts is None or "localhost" not in hosts:
        tree.write("/etc/hosts", HOSTS if hosts is None else _append(hosts, HOSTS.rstrip("\n")))
        created.append("/etc/hosts")
    user = _ensure_user(tree, epoch)
    if not tree.path("/etc/sudoers.d").exists():
        tree.mkdir("/etc/sudoers.d", 0o755)
    tree.write("/etc/sudoers.d/aenv-user", SUDOERS, mode=0o440)
    os.chmod(tree.path("/etc/sudoers.d/aenv-user"), 0o440)
    done = {"user": user, "created": created}
    if modules is not None:
        done["kernel_modules"] = add_kernel_modules(tree, modules)
    tree.stamp(epoch)
    return done
