"""The node's template builder (E2B's, spec §4): ``agent.tasks.build_template`` hands it a
build the control plane placed here, and it reports back only through
``template_builds.progress`` (accept, log lines, finish).

| module | job |
|---|---|
| ``plan`` | the pure rules: build context, chain keys and ``force``, COPY / WORKDIR / ENV semantics |
| ``base`` | the starting point: an image pulled from a registry (``vmm.oci``) or a base template's snapshot |
| ``guest`` | a step inside the build VM, through envd; the start command |
| ``layers`` | the node's layer cache, one entry per step, LRU-bounded |
| ``images`` | the node's image cache limit (``AENV_IMAGE_CACHE_MB``): layers, image disks, OCI blobs; what is evicted |
| ``log`` | the build log, batched into the database; how a cancel is noticed |
| ``build`` | one build start to finish: boot on the cached prefix, steps, finalize, the template snapshot |
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path

from agent.builder import images
from agent.builder.build import BUILD_VM_PREFIX, Build, Failure, Node, Request, internal_error
from agent.builder.layers import LayerCache
from agent.builder.log import BuildLog, Cancelled

log = logging.getLogger(__name__)

NODE_RESTARTED = "the node worker restarted during the build"

_caches: dict = {}
_cache_lock = threading.Lock()


def layer_cache() -> LayerCache:
    """The node's one layer cache per images dir (its pins are this process's running builds)."""
    from django.conf import settings

    root = Path(settings.AENV_IMAGES_DIR) / "layers"
    with _cache_lock:
        if root not in _caches:
            _caches[root] = LayerCache(root)
        return _caches[root]


def node_context(driver=None) -> Node:
    from django.conf import settings

    from envd.state import TEMPLATE_DEFAULTS
    from template_builds.files import get_file_store

    from agent.driver import get_driver
    from agent.stores import get_store

    return Node(node_id=settings.AENV_NODE_ID, driver=driver or get_driver(), store=get_store(),
                files=get_file_store(), images_dir=settings.AENV_IMAGES_DIR, cache=layer_cache(),
                build_timeout=float(settings.AENV_TEMPLATE_BUILD_TIMEOUT),
                ready_timeout=float(settings.AENV_TEMPLATE_READY_TIMEOUT),
                insecure_registries=list(settings.AENV_INSECURE_REGISTRIES),
                private_registries=list(settings.AENV_PRIVATE_REGISTRIES), defaults_file=TEMPLATE_DEFAULTS)


def build_template(*, build_id: str, template_id: str, spec: dict, cpu_count: int, memory_mb: int,
                   disk_size_mb: int, node: Node | None = None) -> dict:
    """Builds ``build_id`` here and reports its outcome; returns a summary for the task log.
    Then the image cache is brought under its limit (after the report: a build's outcome
    never waits for eviction)."""
    from template_builds import progress

    node = node or node_context()
    if not progress.accept(build_id, node.node_id):
        log.info("template build %s of %s is no longer building here; skipped", build_id, template_id)
        return {"status": "skipped"}
    try:
        return _build_and_report(node, build_id, template_id, spec, cpu_count, memory_mb, disk_size_mb)
    finally:
        trim_image_cache(node, recent_s=node.build_timeout)  # other builds may be between pull and boot


def _build_and_report(node: Node, build_id: str, template_id: str, spec: dict, cpu_count: int, memory_mb: int,
                      disk_size_mb: int) -> dict:
    from django.conf import settings
    from template_builds import progress

    holder: dict = {}
    blog = BuildLog(str(build_id), progress.report_many, on_cancel=lambda: holder["build"].kill_vm(),
                    max_output_bytes=settings.AENV_BUILD_LOG_MAX_MB * 1024 * 1024)
    build = holder["build"] = Build(node, Request(str(build_id), template_id, spec, cpu_count, memory_mb,
                                                  disk_size_mb), blog)
    outcome = error = None
    step = ""
    try:
        outcome = build.run()
    except Failure as exc:
        error, step = exc.message, exc.step
    except Cancelled:
        pass
    except Exception as exc:  # noqa: BLE001 - reported as the build's reason, never lost
        if not blog.cancelled:
            log.exception("template build %s of %s failed", build_id, template_id)
            error = internal_error(exc)
    finally:
        build.cleanup()
    if blog.cancelled or (error is None and outcome is None):
        blog.close()
        _discard(node, outcome)
        log.info("template build %s of %s was cancelled", build_id, template_id)
        return {"status": "cancelled"}
    if error is not None:
        blog.close()
        progress.finish(build_id, error=error, step=step)
        log.warning("template build %s of %s failed at step %s: %s", build_id, template_id, step or "-", error)
        return {"status": "error", "step": step, "reason": error}
    snapshot = None if outcome.reused else _record_snapshot(node, build.req, outcome)
    blog.close()
    result = progress.BuildResult(snapshot_id=outcome.snapshot_id, image=outcome.image, disk_size_mb=disk_size_mb,
                                  details=outcome.details)
    if not progress.finish(build_id, result):  # cancelled at the very end: nobody's now
        _discard(node, outcome, snapshot)
        return {"status": "cancelled"}
    log.info("template build %s of %s ready: snapshot %s%s", build_id, template_id, outcome.snapshot_id,
             " (reused)" if outcome.reused else "")
    return {"status": "ready", "snapshot": outcome.snapshot_id}


def _record_snapshot(node: Node, req: Request, outcome):
    """The template snapshot's row: one of the template's, never of the team's list."""
    from snapshots.models import Snapshot, SnapshotState

    return Snapshot.objects.create(
        id=outcome.snapshot_id, team_id=req.spec["team_id"], template_id=req.template_id, node_id=node.node_id,
        memory=True, build_result=True, state=SnapshotState.READY, manifest=outcome.manifest,
        size_bytes=outcome.size_bytes, cpu_count=req.cpu_count, memory_mb=req.memory_mb,
        disk_size_mb=req.disk_size_mb, envd_version=req.spec.get("envd_version") or "0.6.4")


def _discard(node: Node, outcome, snapshot=None) -> None:
    """Removes what a cancelled build made (never an earlier build's snapshot it reused)."""
    if outcome is not None and not outcome.reused:
        node.store.delete(outcome.snapshot_id)
    if snapshot is not None:
        snapshot.delete()


def trim_image_cache(node: Node, recent_s: float) -> dict | None:
    """Evicts from the node's image cache down to ``AENV_IMAGE_CACHE_MB``
    (``agent.builder.images``); ``recent_s``: images a build used that recently stay. A
    failure only logs: neither a build nor the node's start depends on it."""
    try:
        return images.enforce_on_node(images_dir=Path(node.images_dir), layers=node.cache, driver=node.driver,
                                      store=node.store, recent_s=recent_s)
    except Exception:  # noqa: BLE001 - the cache stays as it is until the next pass
        log.exception("image cache: eviction on %s failed", node.node_id)
        return None


def trim_image_cache_at_start(driver) -> dict | None:
    """At node start no build runs (``abandon_interrupted`` ended them): nothing is recent."""
    try:
        node = node_context(driver=driver)
    except Exception:  # noqa: BLE001
        log.exception("image cache: cannot check it at start")
        return None
    return trim_image_cache(node, recent_s=0.0)


def abandon_interrupted(node_id: str, driver) -> list[str]:
    """At node start: builds that were building here died with the previous worker (their
    task was dropped with the queue), so they fail, saying so; their VMs and the layer
    cache's unfinished entries are removed."""
    from template_builds import progress
    from template_builds.models import BuildStatus, TemplateBuild

    killed = [vm for vm in sorted(driver.sandbox_ids()) if vm.startswith(BUILD_VM_PREFIX) and driver.kill(vm)]
    failed = []
    for build_id in TemplateBuild.objects.filter(node_id=node_id, status=BuildStatus.BUILDING).values_list(
            "pk", flat=True):
        if progress.finish(build_id, error=NODE_RESTARTED):
            failed.append(str(build_id))
    removed = layer_cache().gc()
    if killed or failed or removed:
        log.info("builds interrupted on %s: %d failed, %d build VMs killed, %d unfinished layers removed",
                 node_id, len(failed), len(killed), removed)
    return failed
