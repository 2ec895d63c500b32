"""Booted templates, for any driver: a guest with envd running (before /init), captured once
per image build, VM shape and driver fingerprint, so creating a sandbox is a restore
(~0.2-0.5 s under TCG) instead of a cold boot (~5-10 s).

Why above the drivers: which snapshot a new sandbox may start from is a cache decision
(image, shape, what the driver can restore), not a hypervisor one. Drivers only boot and
restore; the node operation looks a template up here and then asks the driver to
``restore(manifest, spec, template=True)`` on a hit or to ``boot(spec)`` on a miss.

Why cached by key: a memory snapshot only restores into the identical machine. The key is
the image build (recipe hash), vCPUs, memory, disk size and the driver's ``fingerprint()``
(QEMU: accelerator, QEMU version and the command-line builder's source: a new device or
kernel argument would not match the saved device state). A miss means a cold boot, never a
wrong restore.

Layout: images_dir/snapshots/<image>-<recipe_hash>/c<cpu>-m<mem>-d<disk>-<accel>-<key>/
(a SnapshotManifest dir written by the driver's snapshot(): manifest.json, memory and device
state, disk layers over the image rootfs; plus template.json). manifest.json is written
last, so a dir without it is an interrupted build. Restored sandboxes read these files
(QEMU copies the RAM, reads the layers): the dirs are never deleted while sandboxes may use
them (an image rebuild adds a new dir beside the old one).

    python -m vmm.templates build --image base --cpu 2 --memory 512 [--disk 2048] [--images-dir DIR] [--driver qemu]
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

from envd_client import EnvdClient, EnvdError
from vmm.driver import BootSpec, SnapshotManifest, VMDriver, VMError, get_driver
from vmm.images import DEFAULT_IMAGES_DIR, GuestImage, ImageNotFound, digest, find_image

FORMAT = 3  # bump when what a template snapshot contains changes (3: keyed by the driver fingerprint)
SETTLE_SECONDS = 1.0  # let boot-time work in the guest finish before the capture
# Run once through envd before the capture, as each user, so the shell, its startup files and
# envd's process path are in the guest page cache / warmed up in the snapshot (the first command
# in a fresh sandbox otherwise reads them from the virtual disk under TCG).
WARM_UP_USERS = ("root", "user")


def warm_up(host: str, port: int, timeout: float = 60.0) -> None:
    """Runs `bash -l -c true` as each WARM_UP_USERS user through envd (the first command
    of each user pages in what every later one needs). Raises EnvdError/RuntimeError."""
    with EnvdClient.at(host, port, timeout=timeout, stream_idle_timeout=timeout) as envd:
        for user in WARM_UP_USERS:
            result = envd.run("true", user=user, stdin=None)
            if not result.ok:
                raise RuntimeError(f"warm-up as {user}: exit {result.exit_code}: {result.stderr[-300:]!r}")


def snapshot_dir(images_dir: Path, image: GuestImage, cpu_count: int, memory_mb: int, disk_size_mb: int,
                 fingerprint: dict) -> Path:
    """Where the template of this image build, shape and driver fingerprint lives."""
    key = digest({"format": FORMAT, "image": image.recipe_hash, "cpu": cpu_count, "memory": memory_mb,
                  "disk": disk_size_mb, "fingerprint": fingerprint})
    flavour = fingerprint.get("accel") or fingerprint.get("driver") or "any"
    return (Path(images_dir).absolute() / "snapshots" / f"{image.name}-{image.recipe_hash}"
            / f"c{cpu_count}-m{memory_mb}-d{disk_size_mb}-{flavour}-{key}")


def _own_files_present(manifest: SnapshotManifest) -> bool:
    """Every file of the snapshot itself still exists (a half-deleted build is stale:
    rebuilt by the next build)."""
    required = [*manifest.layers, manifest.memory_file, manifest.device_state_file]
    return all(p and Path(p).exists() for p in required)


class TemplateCache:
    """The booted templates under one images dir (resolved: manifests record absolute
    paths, which must not go through a symlink that may disappear)."""

    def __init__(self, images_dir: Path):
        self.images_dir = Path(images_dir).resolve()

    def dir_for(self, driver: VMDriver, image: GuestImage, cpu_count: int, memory_mb: int,
                disk_size_mb: int) -> Path:
        return snapshot_dir(self.images_dir, image, cpu_count, memory_mb, disk_size_mb, driver.fingerprint())

    def find(self, driver: VMDriver, spec: BootSpec) -> SnapshotManifest | None:
        """The complete template `driver` can restore for `spec` (its image, cpu, memory and
        disk), or None: then the caller cold-boots. A spec with disk `layers` (a
        filesystem-only snapshot) never has one."""
        if spec.layers:
            return None
        try:
            image = find_image(self.images_dir, spec.image)
            d = self.dir_for(driver, image, spec.cpu_count, spec.memory_mb, spec.disk_size_mb)
        except (ImageNotFound, VMError):  # no image (boot reports it) or no fingerprint: no match
            return None
        if not (d / "manifest.json").is_file():
            return None
        try:
            manifest = SnapshotManifest.load(d)
        except (OSError, ValueError, TypeError):
            return None
        if not _own_files_present(manifest):
            return None
        try:
            driver.check_snapshot(manifest)  # e.g. the kernel it was captured with is gone
        except VMError:
            return None
        return manifest

    def build(self, driver: VMDriver, image_name: str = "base", cpu_count: int = 2, memory_mb: int = 512,
              disk_size_mb: int = 2048, progress=print, settle_seconds: float | None = None) -> SnapshotManifest:
        """Boots the image once (cold) with `driver`, waits for envd, captures it and returns
        the manifest. Idempotent: an existing template for the same key is returned as is."""
        image = find_image(self.images_dir, image_name)
        spec = BootSpec("", image=image_name, cpu_count=cpu_count, memory_mb=memory_mb, disk_size_mb=disk_size_mb)
        final = self.dir_for(driver, image, cpu_count, memory_mb, disk_size_mb)
        with _Lock(self.images_dir / "snapshots" / ".build.lock"):
            existing = self.find(driver, spec)
            if existing is not None:
                progress(f"template snapshot up to date: {final}")
                return existing
            shutil.rmtree(final, ignore_errors=True)  # an interrupted build
            t0 = time.monotonic()
            sid = f"template-{uuid.uuid4().hex[:8]}"
            info = driver.boot(BootSpec(sid, image=image_name, cpu_count=cpu_count, memory_mb=memory_mb,
                                        disk_size_mb=disk_size_mb))
            try:
                progress(f"template VM booted in {info.timings.get('total_ms', 0) / 1000:.1f}s; capturing")
                try:
                    warm_up(info.envd_host, info.envd_port)
                except (EnvdError, RuntimeError) as e:  # only a slower first command, never a failed build
                    progress(f"warm-up failed (ignored): {e}")
                time.sleep(SETTLE_SECONDS if settle_seconds is None else settle_seconds)
                final.parent.mkdir(parents=True, exist_ok=True)
                try:
                    manifest = driver.snapshot(sid, final)
                except BaseException:
                    shutil.rmtree(final, ignore_errors=True)
                    raise
            finally:
                driver.kill(sid)
            (final / "template.json").write_text(json.dumps(
                {"image": image.name, "recipe_hash": image.recipe_hash, "cpu_count": cpu_count,
                 "memory_mb": memory_mb, "disk_size_mb": disk_size_mb, "fingerprint": driver.fingerprint(),
                 "built_at": time.time()}, indent=2))
            progress(f"template snapshot built in {time.monotonic() - t0:.1f}s: {final}")
            return manifest


class _Lock:
    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        os.close(self.fd)


def build(images_dir: Path, image_name: str = "base", cpu_count: int = 2, memory_mb: int = 512,
          disk_size_mb: int = 2048, progress=print, boot_timeout: float | None = None,
          driver_name: str = "qemu") -> SnapshotManifest:
    """Builds the template with a throwaway driver of `driver_name` (its own home in a temp
    dir under images_dir, so no node's VMs are touched); see TemplateCache.build."""
    cache = TemplateCache(images_dir)
    work = Path(tempfile.mkdtemp(prefix=".tmp-template-vm-", dir=cache.images_dir))
    try:
        options = {"boot_timeout": boot_timeout} if boot_timeout else {}
        driver = get_driver(driver_name, home=work, images_dir=cache.images_dir, **options)
        return cache.build(driver, image_name, cpu_count, memory_mb, disk_size_mb, progress=progress)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vmm.templates", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build the template snapshot if missing (idempotent)")
    b.add_argument("--image", default="base")
    b.add_argument("--cpu", type=int, default=2)
    b.add_argument("--memory", type=int, default=512, help="MiB")
    b.add_argument("--disk", type=int, default=2048, help="MiB")
    b.add_argument("--images-dir", type=Path, default=Path(os.environ.get("AENV_IMAGES_DIR", DEFAULT_IMAGES_DIR)))
    b.add_argument("--boot-timeout", type=float, default=None)
    b.add_argument("--driver", default=os.environ.get("AENV_DRIVER", "qemu"))
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    manifest = build(args.images_dir, args.image, args.cpu, args.memory, args.disk,
                     progress=lambda m: print(m, flush=True), boot_timeout=args.boot_timeout,
                     driver_name=args.driver)
    print(json.dumps({"dir": str(manifest.dir), "layers": manifest.layers}, indent=2))
    print(f"done in {time.monotonic() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
