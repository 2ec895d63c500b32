"""Template snapshots: a booted guest with envd running (before /init), saved once per image
build and VM shape, so creating a sandbox is a restore (~0.2-0.5 s under TCG) instead of a
cold boot (~5-10 s).

Why cached by key: a memory snapshot only restores into the identical machine. The key covers
the image build (recipe hash), vCPUs, memory, disk size, accelerator, QEMU version and the
command-line builder's source (a new device or kernel argument would not match the saved
device state). A lookup miss means a cold boot, never a wrong restore.

Layout: images_dir/snapshots/<image>-<recipe_hash>/c<cpu>-m<mem>-d<disk>-<accel>-<key>/
(a SnapshotManifest dir: manifest.json, memory.ram, device.state, layer-0.qcow2 over the image
rootfs). manifest.json is written last, so a dir without it is an interrupted build.
Restored sandboxes map memory.ram copy-on-write and read layer-0: these dirs are never deleted
while sandboxes may use them (an image rebuild adds a new dir beside the old one).

    python -m vmm.template_snapshots build --image base --cpu 2 --memory 512 [--disk 2048] [--images-dir DIR]
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from functools import lru_cache
from pathlib import Path

from vmm import qemu_cmdline
from vmm.driver import BootSpec, SnapshotManifest
from vmm.images import DEFAULT_IMAGES_DIR, GuestImage, digest, find_image

FORMAT = 2  # bump when what a template snapshot contains changes
SETTLE_SECONDS = 1.0  # let boot-time work in the guest finish before the capture
# Run once through envd before the capture, as each user, so the shell, its startup files and
# envd's process path are in the guest page cache / warmed up in the snapshot (the first command
# in a fresh sandbox otherwise reads them from the virtual disk under TCG).
WARM_UP_USERS = ("root", "user")


def warm_up(host: str, port: int, timeout: float = 60.0) -> None:
    """Runs `bash -l -c true` as each WARM_UP_USERS user through envd's Connect RPC
    (process.Process/Start, JSON codec, server stream). Raises OSError/RuntimeError on failure."""
    import base64  # noqa: PLC0415
    import http.client  # noqa: PLC0415
    import struct  # noqa: PLC0415

    for user in WARM_UP_USERS:
        msg = json.dumps({"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "true"], "envs": {}}}).encode()
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
        try:
            conn.request("POST", "/process.Process/Start", body=struct.pack(">BI", 0, len(msg)) + msg, headers={
                "Content-Type": "application/connect+json", "Connect-Protocol-Version": "1",
                "Authorization": "Basic " + base64.b64encode(f"{user}:".encode()).decode()})
            resp = conn.getresponse()
            body = resp.read()
        finally:
            conn.close()
        if resp.status != 200 or b'"exitCode"' in body and b'"exitCode":0' not in body.replace(b" ", b""):
            raise RuntimeError(f"warm-up as {user}: HTTP {resp.status} {body[-300:]!r}")


@lru_cache(maxsize=8)
def qemu_version(qemu: str = qemu_cmdline.QEMU) -> str:
    out = subprocess.run([qemu, "--version"], capture_output=True, text=True, check=True).stdout
    return out.splitlines()[0].strip()


def _cmdline_digest() -> str:
    return hashlib.sha256(Path(qemu_cmdline.__file__).read_bytes()).hexdigest()[:16]


def snapshot_dir(images_dir: Path, image: GuestImage, cpu_count: int, memory_mb: int, disk_size_mb: int,
                 accel: str, qemu: str = qemu_cmdline.QEMU) -> Path:
    key = digest({"format": FORMAT, "image": image.recipe_hash, "cpu": cpu_count, "memory": memory_mb,
                  "disk": disk_size_mb, "accel": accel, "qemu": qemu_version(qemu), "cmdline": _cmdline_digest()})
    return (Path(images_dir).absolute() / "snapshots" / f"{image.name}-{image.recipe_hash}"
            / f"c{cpu_count}-m{memory_mb}-d{disk_size_mb}-{accel}-{key}")


def find(images_dir: Path, image: GuestImage, cpu_count: int, memory_mb: int, disk_size_mb: int,
         accel: str, qemu: str = qemu_cmdline.QEMU) -> SnapshotManifest | None:
    """The matching complete template snapshot, or None (then the caller cold-boots)."""
    try:
        d = snapshot_dir(images_dir, image, cpu_count, memory_mb, disk_size_mb, accel, qemu)
    except (OSError, subprocess.SubprocessError):  # QEMU's version unknown: no snapshot can match
        return None
    if not (d / "manifest.json").is_file():
        return None
    try:
        manifest = SnapshotManifest.load(d)
    except (OSError, ValueError, TypeError):
        return None
    return manifest if _files_present(manifest) else None


def _files_present(manifest: SnapshotManifest) -> bool:
    """Every file the manifest names still exists (an images dir reached through a path
    that is gone, or a half-deleted build, makes it stale: rebuilt by the next build)."""
    required = [*manifest.layers, manifest.memory_file, manifest.device_state_file]
    recorded = [(manifest.machine or {}).get(k) for k in ("kernel", "initrd", "tools")]
    return all(p and Path(p).exists() for p in required) and all(Path(p).exists() for p in recorded if p)


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
          disk_size_mb: int = 2048, progress=print, boot_timeout: float | None = None) -> SnapshotManifest:
    """Boots the image once (cold), waits for envd, captures it and returns the manifest.
    Idempotent: an existing snapshot for the same key is returned as is."""
    from vmm.qemu import DEFAULT_BOOT_TIMEOUT, QemuDriver  # noqa: PLC0415 - qemu imports this module

    # Resolved: the manifest records absolute paths, which must not go through a symlink
    # (e.g. a checkout's var/images pointing at a shared cache) that may disappear.
    images_dir = Path(images_dir).resolve()
    image = find_image(images_dir, image_name)
    work = Path(tempfile.mkdtemp(prefix=".tmp-template-vm-", dir=images_dir))
    try:
        driver = QemuDriver(home=work, images_dir=images_dir, boot_timeout=boot_timeout or DEFAULT_BOOT_TIMEOUT,
                            template_snapshots=False)
        final = snapshot_dir(images_dir, image, cpu_count, memory_mb, disk_size_mb, driver.accel, driver.qemu)
        with _Lock(images_dir / "snapshots" / ".build.lock"):
            existing = find(images_dir, image, cpu_count, memory_mb, disk_size_mb, driver.accel, driver.qemu)
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
                except (OSError, RuntimeError) as e:  # only a slower first command, never a failed build
                    progress(f"warm-up failed (ignored): {e}")
                time.sleep(SETTLE_SECONDS)
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
                 "memory_mb": memory_mb, "disk_size_mb": disk_size_mb, "accel": driver.accel,
                 "qemu": qemu_version(driver.qemu), "built_at": time.time()}, indent=2))
            progress(f"template snapshot built in {time.monotonic() - t0:.1f}s: {final}")
            return manifest
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vmm.template_snapshots", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build the template snapshot if missing (idempotent)")
    b.add_argument("--image", default="base")
    b.add_argument("--cpu", type=int, default=2)
    b.add_argument("--memory", type=int, default=512, help="MiB")
    b.add_argument("--disk", type=int, default=2048, help="MiB")
    b.add_argument("--images-dir", type=Path, default=Path(os.environ.get("AENV_IMAGES_DIR", DEFAULT_IMAGES_DIR)))
    b.add_argument("--boot-timeout", type=float, default=None)
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    manifest = build(args.images_dir, args.image, args.cpu, args.memory, args.disk,
                     progress=lambda m: print(m, flush=True), boot_timeout=args.boot_timeout)
    print(json.dumps({"dir": str(manifest.dir), "layers": manifest.layers}, indent=2))
    print(f"done in {time.monotonic() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
