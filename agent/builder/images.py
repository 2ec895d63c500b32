"""The node's image cache, bounded by ``AENV_IMAGE_CACHE_MB``: the template builder's layer
cache (``agent.builder.layers``), the pulled images' root disks and the OCI layout's blobs
(``vmm.oci``) together, and the one place that decides what goes when they outgrow it.

Why one place: layers stack on image disks, and VMs and template snapshots stack on
both; evicting each cache on its own would break one for the other.

When over the limit (checked after every build and at node start): least recently used
layer cache entries go first (``LayerCache.evict``: an entry with everything stacked on it,
never one pinned by a running build or read by a VM), then whole images, oldest use
first (``vmm.oci.usage``: layout entry, disks, guest image dirs; their blobs then go with
``store.gc()`` unless another image shares them). An image stays, whatever the limit, while:

- a file of its disk or guest image dirs is in use (a VM's chain, kernel, initrd, tools),
  or named by a snapshot on this node (``referenced_paths``: the snapshot store's local
  copies and downloads, and the booted-template snapshots), since a template snapshot is
  self-contained except for that base layer and boot files;
- a layer cache entry that is left stacks on it;
- it is in ``keep_digests``, or a build used it within ``recent_s`` (a build between its
  pull and its VM's boot reads it without a VM yet: ``touch`` marks it).
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from vmm.oci import store as oci_store
from vmm.oci import usage

from agent.builder.layers import LayerCache

log = logging.getLogger(__name__)

_enforcing = threading.Lock()  # concurrent builds end at once: one eviction pass at a time


def touch(images_dir: Path, digest: str) -> None:
    """A build uses the image ``digest`` now: it becomes the most recently used."""
    try:
        usage.mark_used(images_dir, digest)
    except OSError as exc:
        log.warning("image cache: cannot mark %s as used: %s", digest, exc)


def last_used(images_dir: Path, digest: str) -> float:
    """When a build last used ``digest`` (0.0: never marked)."""
    try:
        return usage.used_marker(images_dir, digest).stat().st_mtime
    except OSError:
        return 0.0


def measure(images_dir: Path, layers: LayerCache) -> dict[str, int]:
    """Allocated bytes of what counts against the limit, each hard-linked file once."""
    alloc = usage.Allocation()
    layer_bytes = alloc.add(layers.root) if layers.root.is_dir() else 0
    parts = usage.add_usage(images_dir, alloc)
    return {"layers": layer_bytes, **parts, "total": alloc.total}


def snapshot_roots(store) -> list[Path]:
    """Where the node's snapshot store keeps snapshot dirs on this node: posix_fs's root;
    s3's local copies (``local``) and its download cache (``cache``)."""
    roots = []
    for part in (store, getattr(store, "local", None), getattr(store, "cache", None)):
        root = getattr(part, "root", None)
        if root is not None:
            roots.append(Path(root))
    return roots


def referenced_paths(snapshot_dirs: Iterable[Path], images_dir: Path) -> set[str]:
    """Every absolute path named by a snapshot manifest on this node: ``<root>/<id>/
    manifest.json`` under each of ``snapshot_dirs`` (downloads in progress too) and the
    booted templates' ``<images_dir>/snapshots/<image>/<shape>/manifest.json``."""
    manifests = [m for root in snapshot_dirs for m in Path(root).glob("*/manifest.json")]
    manifests += Path(images_dir).glob("snapshots/*/*/manifest.json")
    out: set[str] = set()
    for manifest in manifests:
        try:
            _collect_paths(json.loads(manifest.read_text()), out)
        except (OSError, ValueError):
            continue
    return out


def _collect_paths(value, out: set[str]) -> None:
    if isinstance(value, str):
        if value.startswith("/"):
            out.add(value)
    elif isinstance(value, dict):
        for v in value.values():
            _collect_paths(v, out)
    elif isinstance(value, list):
        for v in value:
            _collect_paths(v, out)


def _real(paths: Iterable[str]) -> set[str]:
    return {os.path.realpath(p) for p in paths}


def enforce(limit_bytes: int, *, images_dir: Path, layers: LayerCache, in_use: set[str],
            keep_digests: set[str] = frozenset(), recent_s: float = 0.0) -> dict:
    """Evicts until the cache fits ``limit_bytes`` or nothing more may go (see the module
    doc). ``in_use``: paths VMs and snapshots read. Returns what happened: bytes before and
    after, the layer keys and image digests evicted, blobs removed, why images were kept."""
    images_dir = Path(images_dir)
    with _enforcing:
        before = measure(images_dir, layers)
        report = {"limit_bytes": int(limit_bytes), "before_bytes": before["total"], "after_bytes": before["total"],
                  "freed_bytes": 0, "layers_evicted": [], "images_evicted": [], "blobs_removed": 0,
                  "kept": {}}
        if before["total"] <= limit_bytes:
            return report
        used = set(in_use) | _real(in_use)
        report["layers_evicted"] = layers.evict(before["total"] - limit_bytes, used)
        total = measure(images_dir, layers)["total"] if report["layers_evicted"] else before["total"]
        stacked = _real(p for e in layers.entries() for p in e.chain)
        now = time.time()
        for image in usage.inventory(images_dir):
            if total <= limit_bytes:
                break
            why = _why_kept(image, images_dir, used, stacked, keep_digests, now - recent_s)
            if why:
                report["kept"][image.digest] = why
                continue
            try:
                usage.remove_image(images_dir, image)
            except usage.DisksBusy as exc:
                report["kept"][image.digest] = f"not now: {exc}"
                break
            report["images_evicted"].append(image.digest)
            report["blobs_removed"] += oci_store.gc(images_dir)
            total = measure(images_dir, layers)["total"]
        report["after_bytes"] = total
        report["freed_bytes"] = max(0, before["total"] - total)
    _log(report)
    return report


def _why_kept(image: usage.OciImage, images_dir: Path, used: set[str], stacked: set[str], keep_digests,
              since: float) -> str:
    if image.digest in keep_digests:
        return "kept by the caller"
    if max(image.last_used, last_used(images_dir, image.digest)) > since:
        return "used by a build recently"
    files = image.files()
    if files & used:
        return "in use by a VM or a snapshot"
    if files & stacked:
        return "a cached layer stacks on it"
    return ""


def _log(report: dict) -> None:
    mib = 2**20
    over = report["after_bytes"] > report["limit_bytes"]
    if not (report["layers_evicted"] or report["images_evicted"] or over):
        return
    log.log(logging.WARNING if over else logging.INFO,
            "image cache: %.1f -> %.1f MiB (limit %.1f MiB): evicted %d layer cache entries, %d images %s "
            "(%d blobs)%s", report["before_bytes"] / mib, report["after_bytes"] / mib, report["limit_bytes"] / mib,
            len(report["layers_evicted"]), len(report["images_evicted"]), report["images_evicted"],
            report["blobs_removed"], f"; still over the limit, kept: {report['kept']}" if over else "")


def enforce_on_node(*, images_dir: Path, layers: LayerCache, driver, store, recent_s: float) -> dict:
    """``enforce`` with the node's limit (``AENV_IMAGE_CACHE_MB``, read now) and what its
    VMs (``driver.files_in_use()``) and its snapshots read."""
    from django.conf import settings

    limit = int(settings.AENV_IMAGE_CACHE_MB) << 20
    in_use = set(driver.files_in_use()) | referenced_paths(snapshot_roots(store), images_dir)
    return enforce(limit, images_dir=images_dir, layers=layers, in_use=in_use, recent_s=recent_s)
