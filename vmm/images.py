"""Guest image cache: builds (or finds) a template's kernel, initrd, rootfs base and tools drive.

Why: booting needs immutable, content-addressed artifacts. Each stage is cached under a hash of
its inputs, built in a temp dir and renamed into place, so a killed build never looks finished
and a change to envd only rebuilds the (fast) tools drive.

Layout of images_dir:
  stages/debootstrap-<h>/rootfs/          debootstrap result (slow, network)
  stages/system-<h>/{vmlinuz,initrd.cpio,rootfs.qcow2}
  stages/tools-<h>/tools.img
  <name>-<recipe_hash>/                    hard links to the above + image.json
  <name> -> <name>-<recipe_hash>           symlink to the newest complete build (what drivers boot)
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from vmm import rootfs as rootfs_stage
from vmm import toolsdrive

DEFAULT_IMAGES_DIR = Path(__file__).resolve().parents[1] / "var" / "images"
TEMPLATES = {"base"}


class ImageNotFound(Exception):
    """The named image has not been built in images_dir."""


@dataclass(frozen=True)
class GuestImage:
    name: str
    kernel: Path
    initrd: Path
    rootfs: Path
    tools: Path
    recipe_hash: str
    kernel_release: str = ""

    def to_json(self) -> dict:
        return {k: str(v) for k, v in asdict(self).items()}

    @classmethod
    def from_dir(cls, path: Path) -> "GuestImage":
        meta = json.loads((path / "image.json").read_text())
        return cls(name=meta["name"], kernel=path / "vmlinuz", initrd=path / "initrd.cpio",
                   rootfs=path / "rootfs.qcow2", tools=path / "tools.img",
                   recipe_hash=meta["recipe_hash"], kernel_release=meta.get("kernel_release", ""))


def digest(obj) -> str:
    """Stable short hash of a JSON-able value."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def stage_hashes(name: str = "base") -> dict[str, str]:
    """The hash of every stage and of the whole recipe; cheap (reads small files only)."""
    deb = digest(rootfs_stage.recipe_inputs())
    system = digest([deb, rootfs_stage.system_inputs()])
    tools = digest(toolsdrive.recipe_inputs())
    return {"debootstrap": deb, "system": system, "tools": tools, "recipe": digest([name, system, tools])}


def find_image(images_dir: Path, name: str = "base") -> GuestImage:
    """The newest complete build of `name` (what drivers boot); never builds."""
    link = Path(images_dir) / name
    if not (link / "image.json").exists():
        raise ImageNotFound(f"image {name!r} not built in {images_dir}; run: python -m vmm.images build --name {name}")
    return GuestImage.from_dir(link.resolve())


class _BuildLock:
    """Serializes builds across processes sharing images_dir."""

    def __init__(self, images_dir: Path):
        self.path = images_dir / ".build.lock"

    def __enter__(self):
        self.fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _stage(images_dir: Path, kind: str, h: str, build, progress) -> Path:
    """Returns the finished stage dir, building it in a temp dir + rename when missing."""
    final = images_dir / "stages" / f"{kind}-{h}"
    if final.exists():
        progress(f"[{kind}] cached {final.name}")
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{kind}-", dir=final.parent))
    work = Path(tempfile.mkdtemp(prefix=f".work-{kind}-", dir=final.parent))
    t0 = time.monotonic()
    try:
        build(tmp, work)
        tmp.chmod(0o755)
        os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    progress(f"[{kind}] built {final.name} in {time.monotonic() - t0:.1f}s")
    return final


def _clean_stale(images_dir: Path) -> None:
    """Removes temp dirs left by killed builds (we hold the build lock, so none is live)."""
    for parent in (images_dir, images_dir / "stages"):
        if parent.exists():
            for p in parent.glob(".tmp-*"):
                shutil.rmtree(p, ignore_errors=True)
            for p in parent.glob(".work-*"):
                shutil.rmtree(p, ignore_errors=True)


def ensure_image(images_dir: Path, name: str = "base", progress=print) -> GuestImage:
    """Builds what is missing for template `name` and returns its artifacts (idempotent)."""
    if name not in TEMPLATES:
        raise ImageNotFound(f"unknown template {name!r}; known: {sorted(TEMPLATES)}")
    images_dir = Path(images_dir).resolve()
    images_dir.mkdir(parents=True, exist_ok=True)
    hashes = stage_hashes(name)
    final = images_dir / f"{name}-{hashes['recipe']}"
    with _BuildLock(images_dir):
        if (final / "image.json").exists():
            _point(images_dir, name, final)
            progress(f"image {name} up to date: {final}")
            return GuestImage.from_dir(final)
        _clean_stale(images_dir)
        t0 = time.monotonic()
        deb = _stage(images_dir, "debootstrap", hashes["debootstrap"],
                     lambda out, work: rootfs_stage.debootstrap(out, progress), progress)
        system = _stage(images_dir, "system", hashes["system"],
                        lambda out, work: _build_system(deb / "rootfs", out, work, progress), progress)
        tools = _stage(images_dir, "tools", hashes["tools"],
                       lambda out, work: toolsdrive.build(out / "tools.img", work, progress), progress)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=images_dir))
        try:
            for src in (system / "vmlinuz", system / "initrd.cpio", system / "rootfs.qcow2", tools / "tools.img"):
                os.link(src, tmp / src.name)
            for f in ("rootfs.qcow2", "tools.img"):
                (tmp / f).chmod(0o444)
            release = (system / "kernel_release").read_text().strip()
            meta = {"name": name, "recipe_hash": hashes["recipe"], "stages": hashes, "kernel_release": release,
                    "built_at": time.time()}
            (tmp / "image.json").write_text(json.dumps(meta, indent=2))
            tmp.chmod(0o755)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        _point(images_dir, name, final)
        progress(f"image {name} ready in {time.monotonic() - t0:.1f}s: {final}")
        return GuestImage.from_dir(final)


def _build_system(rootfs: Path, out: Path, work: Path, progress) -> None:
    release = rootfs_stage.build_system(rootfs, out, work, progress)
    (out / "kernel_release").write_text(release + "\n")


def _point(images_dir: Path, name: str, final: Path) -> None:
    """Atomically repoints images_dir/<name> at a complete build."""
    link = images_dir / name
    if link.is_symlink() and os.readlink(link) == final.name:
        return
    tmp = images_dir / f".tmp-link-{name}-{os.getpid()}"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(final.name, tmp)
    os.replace(tmp, link)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vmm.images", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build the image if its recipe changed (idempotent)")
    b.add_argument("--name", default="base")
    b.add_argument("--images-dir", type=Path, default=Path(os.environ.get("AENV_IMAGES_DIR", DEFAULT_IMAGES_DIR)))
    h = sub.add_parser("hash", help="print the recipe hashes")
    h.add_argument("--name", default="base")
    args = parser.parse_args(argv)
    if args.cmd == "hash":
        print(json.dumps(stage_hashes(args.name), indent=2))
        return 0
    t0 = time.monotonic()
    image = ensure_image(args.images_dir, args.name, progress=lambda m: print(m, flush=True))
    print(json.dumps(image.to_json(), indent=2))
    print(f"done in {time.monotonic() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
