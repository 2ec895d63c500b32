"""The guest kernel's NFS client modules, for root disks made from OCI images.

Why: an OCI image boots with aenv's kernel (the ``base`` image's Debian cloud kernel), whose
modules live in the base image's root filesystem, not in the image. A guest mounts its volumes
with that kernel's own NFS client (vmm.net.volume_server), a module loaded with modprobe: with
no modules on its disk, a sandbox asking for ``volumeMounts`` is refused. So a disk gets what
``modprobe nfsv3`` loads, and nothing else: the module and everything the kernel's modules.dep
says it needs (nfs, nfs_acl, lockd, grace, sunrpc, fscache, netfs on Debian's 6.1: 3.4 MiB,
not the ~90 MiB tree).

Where they come from: the base image's rootfs.qcow2, the files the kernel was installed with,
wherever that image was built (here, a seed, another node). It is copied raw once per kernel
and read with debugfs; the result is kept under ``<images_dir>/oci/kmods/<release>-<kernel
sha256, 12 hex>/``::

    modules/<release>/kernel/...          the modules, decompressed (any modprobe loads them)
    modules/<release>/modules.dep         their lines only
    modules/<release>/modules.order       their lines only
    modules/<release>/modules.builtin     the kernel's (what is built in)
    kmods.json                            release, kernel hash, modules, id

The ``id`` (a hash of every file's path and bytes) is part of an OCI disk's key
(vmm.oci.disks), so another kernel gives other disks. There are no ``.bin`` indexes: they are
depmod's (kmod), which a node need not have. busybox's modprobe reads the text files; kmod's
needs the indexes, and the guest's mount falls back to the tools drive's busybox.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import lzma
import os
import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from vmm.oci import tools
from vmm.oci.errors import OciError
from vmm.oci.filelock import built_once

FORMAT = 1
ROOTS = ("nfsv3",)  # what the guest's mount loads (vmm.net.volume_server.mount_script)
_RELEASE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")
_SUFFIXES = {".ko": None, ".ko.xz": lzma.decompress, ".ko.gz": gzip.decompress}


@dataclass(frozen=True)
class KernelModules:
    """A kernel's NFS client modules, ready to copy to ``/lib/modules/<release>/``."""

    release: str
    dir: Path      # holds the files of /lib/modules/<release>/
    id: str        # content hash: part of a disk's key
    modules: tuple[str, ...]

    def files(self) -> list[str]:
        """Paths relative to ``dir`` of every file to copy, sorted."""
        return sorted(str(p.relative_to(self.dir)) for p in self.dir.rglob("*") if p.is_file())

    @classmethod
    def load(cls, path: Path) -> "KernelModules":
        meta = json.loads((path / "kmods.json").read_text())
        return cls(release=meta["release"], dir=path / "modules" / meta["release"], id=meta["id"],
                   modules=tuple(meta["modules"]))


def module_name(path: str) -> str:
    """``kernel/fs/nfs/nfs-acl.ko.xz`` -> ``nfs_acl`` (modprobe's names: ``-`` is ``_``)."""
    base = path.rsplit("/", 1)[-1]
    for suffix in sorted(_SUFFIXES, key=len, reverse=True):
        if base.endswith(suffix):
            base = base[:-len(suffix)]
            break
    return base.replace("-", "_")


def _plain(path: str) -> str:
    """The path a decompressed module is written to."""
    for suffix in (".ko.xz", ".ko.gz"):
        if path.endswith(suffix):
            return path[:-len(suffix)] + ".ko"
    return path


def parse_dep(text: str) -> dict[str, tuple[str, list[str]]]:
    """modules.dep -> {name: (path, [dependency paths])}, in the file's order."""
    out: dict[str, tuple[str, list[str]]] = {}
    for line in text.splitlines():
        path, sep, deps = line.partition(":")
        if sep and path.strip():
            out[module_name(path.strip())] = (path.strip(), deps.split())
    return out


def closure(dep: dict[str, tuple[str, list[str]]], roots=ROOTS) -> list[str]:
    """The names of ``roots`` and every module they need (modules.dep lists the whole chain for
    each module; it is followed anyway), in modules.dep's order."""
    want, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name in want:
            continue
        if name not in dep:
            raise OciError(f"the guest kernel has no module {name} (not in its modules.dep)")
        want.add(name)
        todo.extend(module_name(d) for d in dep[name][1])
    return [name for name in dep if name in want]


def select(read: Callable[[str], bytes | None], roots=ROOTS) -> dict[str, bytes]:
    """The files of ``/lib/modules/<release>/`` to ship, ``{relative path: bytes}``;
    ``read(relative path)`` gives a file of the kernel's module directory (None: missing)."""
    text = read("modules.dep")
    if text is None:
        raise OciError("the guest kernel's module directory has no modules.dep")
    dep = parse_dep(text.decode())
    names = closure(dep, roots)
    files: dict[str, bytes] = {}
    lines = []
    for name in names:
        path, deps = dep[name]
        if path.startswith("/") or ".." in path.split("/"):
            raise OciError(f"module path {path!r} in modules.dep is not inside the module directory")
        data = read(path)
        if data is None:
            raise OciError(f"module {path} is listed in modules.dep but missing")
        suffix = next((s for s in sorted(_SUFFIXES, key=len, reverse=True) if path.endswith(s)), None)
        if suffix is None:
            raise OciError(f"module {path}: unsupported compression")
        files[_plain(path)] = _SUFFIXES[suffix](data) if _SUFFIXES[suffix] else data
        lines.append(f"{_plain(path)}:" + "".join(f" {_plain(d)}" for d in deps) + "\n")
    files["modules.dep"] = "".join(lines).encode()
    order = read("modules.order")
    if order is not None:
        kept = [line for line in order.decode().splitlines() if module_name(line.strip()) in names]
        files["modules.order"] = "".join(f"{_plain(line)}\n" for line in kept).encode()
    builtin = read("modules.builtin")
    if builtin is not None:
        files["modules.builtin"] = builtin
    return files


def content_id(release: str, files: dict[str, bytes]) -> str:
    h = hashlib.sha256(f"format={FORMAT}\nrelease={release}\n".encode())
    for path in sorted(files):
        h.update(path.encode() + b"\0" + hashlib.sha256(files[path]).digest())
    return h.hexdigest()[:12]


class _Ext4Reader:
    """Files of a raw ext4 image, read with debugfs (no mount, no root needed)."""

    def __init__(self, raw: Path, moddir: str, work: Path):
        self.raw, self.moddir, self.work = raw, moddir, work
        self.n = 0

    def __call__(self, rel: str) -> bytes | None:
        self.n += 1
        out = self.work / f"file-{self.n}"
        src = f"{self.moddir}/{rel}"
        if '"' in src or "\n" in src:
            raise OciError(f"unexpected module path {rel!r}")
        proc = subprocess.run([tools.which("debugfs"), "-R", f'dump "{src}" "{out}"', str(self.raw)],
                              capture_output=True, text=True, timeout=300, env={**os.environ, "LC_ALL": "C"})
        if not out.exists():
            if "not found" in proc.stderr:
                return None
            raise OciError(f"debugfs could not read {src}: {proc.stderr.strip()[-500:]}")
        data = out.read_bytes()
        out.unlink()
        return data


def extract(rootfs_qcow2: Path, release: str, out: Path, work: Path, roots=ROOTS) -> dict:
    """Writes ``out/modules/<release>/`` and ``out/kmods.json`` from the kernel's module
    directory in ``rootfs_qcow2``; returns kmods.json's content."""
    if not _RELEASE.match(release or ""):
        raise OciError(f"invalid kernel release {release!r}")
    raw = work / "rootfs.raw"
    tools.run(["qemu-img", "convert", "-O", "raw", str(rootfs_qcow2), str(raw)])
    try:
        files = select(_Ext4Reader(raw, f"/lib/modules/{release}", work), roots)
    finally:
        raw.unlink(missing_ok=True)
    target = out / "modules" / release
    for rel, data in files.items():
        path = target / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    meta = {"format": FORMAT, "release": release, "id": content_id(release, files),
            "modules": [module_name(p) for p in files if p.endswith(".ko")],
            "bytes": sum(len(d) for d in files.values())}
    (out / "kmods.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
    return meta


@functools.lru_cache(maxsize=16)
def _file_sha256(path: str, _ino: int, _size: int, _mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def kernel_sha256(kernel: Path) -> str:
    """The kernel file's hash (cached while the file stays the same inode, size and mtime)."""
    st = os.stat(kernel)
    return _file_sha256(str(kernel), st.st_ino, st.st_size, st.st_mtime_ns)


def for_image(images_dir: Path, image, progress=lambda m: None) -> KernelModules:
    """The NFS client modules of ``image``'s kernel (a vmm.images.GuestImage: its vmlinuz,
    kernel_release and rootfs.qcow2), extracted on first use (idempotent, safe across
    processes)."""
    release = image.kernel_release
    if not _RELEASE.match(release or ""):
        raise OciError(f"image {image.name} names no kernel release (image.json kernel_release)")
    final = Path(images_dir).resolve() / "oci" / "kmods" / f"{release}-{kernel_sha256(image.kernel)[:12]}"

    def build(tmp: Path, work: Path) -> None:
        progress(f"extracting the NFS client modules of kernel {release} from image {image.name}")
        extract(image.rootfs, release, tmp, work)

    return built_once(final, "kmods.json", build, lambda built: KernelModules.load(final))
