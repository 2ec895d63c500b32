"""Celery tasks that run on a node worker (queue ``node.<id>``) and drive its VMs.

Exceptions propagate unchanged: with the JSON result serializer Celery stores their
class name and args, which the control plane turns into NodeTaskFailed(kind, message).
Task names are the protocol's (``nodes.protocol``), shared with the control plane's gateway.
"""
import errno
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from functools import partial

from celery import shared_task
from django.conf import settings

from nodes import protocol
from nodes.sealed import open_fields
from nodes.signing import ClaimedTask

from agent import console_logs, egress_trust, moves
from agent import volumes as guest_volumes
from agent.driver import get_driver, get_templates
from agent.guest import EnvdInitFailed, GuestUnresponsive, guest_responds, handoff_token, init_envd

log = logging.getLogger(__name__)


class NodeTask(ClaimedTask):
    """A node task: run only as signed and claimed (``nodes.signing``), its secrets opened
    (``nodes.sealed``: sealed by the control plane with the shared DJANGO_SECRET_KEY)."""

    abstract = True
    # Celery reprs every result for its success log line and events, whatever the log level: a
    # boot's or a snapshot's result (its timings) took ~5 % of the node's CPU on the control
    # plane's path at the default 1,024 characters (issue 26). The node's own logs say more.
    resultrepr_maxsize = 80

    def open_kwargs(self, kwargs: dict) -> dict:
        return open_fields(kwargs, settings.SECRET_KEY)


node_task = partial(shared_task, base=NodeTask)

def _round(timings: dict | None) -> dict:
    return {k: round(float(v), 2) for k, v in (timings or {}).items()}


def _step_or_undo(step, info, *, undo, what: str, label: str) -> None:
    """Runs ``step()`` on a freshly started VM; if it fails, ``undo(sandbox_id)`` puts the
    VM back in a consistent state (killed after a boot, paused after a resume) and the
    failure propagates."""
    try:
        step()
    except BaseException:
        log.warning("%s failed for %s; %s", label, info.sandbox_id, what)
        try:
            undo(info.sandbox_id)
        except Exception:
            log.exception("could not undo %s after a failed %s", info.sandbox_id, label)
        raise


def _init_envd_or_undo(info, env_vars: dict, access_token: str | None, *, undo, what: str, network=None) -> None:
    """Initialises a freshly started VM's envd, undoing the start if that fails; a sandbox
    whose ``network`` has rules then trusts the node's TLS-interception CA (agent.egress_trust)."""
    _step_or_undo(lambda: init_envd(info.envd_host, info.envd_port, env_vars, access_token), info,
                  undo=undo, what=what, label="envd init")
    if egress_trust.needs_ca(network):
        _step_or_undo(lambda: egress_trust.install_in_guest(info.envd_host, info.envd_port, access_token), info,
                      undo=undo, what=what, label="CA install")


def _envd_result(info, timings: dict) -> dict:
    """What a started VM's task returns: its routes (envd's, and ``guest_host`` where every
    guest port is reachable, "" on the slirp fallback), pid, accelerator and timings."""
    return {"envd_host": info.envd_host, "envd_port": info.envd_port, "guest_host": info.guest_host,
            "pid": info.pid, "accel": info.accel, "timings": timings}


def _network(network: dict | None):
    """A task's ``network`` argument (NetworkSpec JSON; None: the open default) as a NetworkSpec."""
    from vmm.net.spec import NetworkSpec

    return NetworkSpec.from_json(network)


def _start_vm(driver, spec):
    """A new VM for ``spec``: the node, not the driver, decides how. A booted template of
    the image, shape and driver fingerprint (``vmm.templates``) → ``driver.restore(...,
    template=True)`` (~0.3 s); none, or its restore failed (e.g. a damaged template) → a
    cold boot (seconds). ``timings["from_template_snapshot"]`` says which (1 / 0)."""
    from vmm.driver import HostDiskFull, UnsupportedNetworkPolicy, VMError

    template = get_templates().find(driver, spec)
    if template is not None:
        try:
            info = driver.restore(template, spec, template=True, source_stays=True)
            info.timings["from_template_snapshot"] = 1
            return info
        except (UnsupportedNetworkPolicy, HostDiskFull):
            raise  # a cold boot could not enforce it / find room either
        except (VMError, OSError) as exc:  # the driver removed what it started; a cold boot still works
            log.warning("sandbox %s: template restore failed, cold booting: %s", spec.sandbox_id, exc)
    info = driver.boot(spec)
    info.timings["from_template_snapshot"] = 0
    return info


@node_task(name=protocol.BOOT_SANDBOX)
def boot_sandbox(*, sandbox_id: str, image: str, cpu_count: int, memory_mb: int, disk_size_mb: int,
                 env_vars: dict, access_token: str | None, network: dict | None = None,
                 volumes: list | None = None) -> dict:
    from vmm.driver import BootSpec

    driver = get_driver()
    spec = BootSpec(sandbox_id=sandbox_id, image=image, cpu_count=cpu_count,
                    memory_mb=memory_mb, disk_size_mb=disk_size_mb, network=_network(network))
    info = _start_vm(driver, spec)
    kill = _killer(driver)
    _step_or_undo(lambda: guest_volumes.serve(driver, sandbox_id, volumes), info, undo=kill,
                  what="killing its VM", label="volume server")
    started = time.perf_counter()
    _init_envd_or_undo(info, env_vars, access_token, undo=kill, what="killing its VM", network=spec.network)
    _step_or_undo(lambda: guest_volumes.mount(info, access_token, volumes, everything=True), info, undo=kill,
                  what="killing its VM", label="volume mounts")
    timings = _round(info.timings)
    timings["init"] = round((time.perf_counter() - started) * 1000, 2)
    return _envd_result(info, timings)


def _killer(driver):
    """``undo`` of a VM that may have a volume server: both go."""
    def kill(sid: str) -> None:
        try:
            driver.kill(sid)
        finally:
            guest_volumes.stop(sid)
    return kill


@node_task(name=protocol.KILL_SANDBOX)
def kill_sandbox(*, sandbox_id: str) -> dict:
    driver = get_driver()
    console_logs.flush(driver, sandbox_id, gone=True)  # the console goes with the VM
    killed = bool(driver.kill(sandbox_id))
    guest_volumes.stop(sandbox_id)
    if moves.shared_store():
        moves.forget(_store(), sandbox_id)  # its exported pause, if it had one
    return {"killed": killed}


@node_task(name=protocol.PAUSE_SANDBOX)
def pause_sandbox(*, sandbox_id: str, to_disk: bool = True, memory: bool = True,
                  require_healthy_guest: bool = False) -> dict:
    """Pauses the VM: to disk (device state saved, QEMU process stopped, RAM file kept)
    or in memory (vCPUs frozen, process kept). ``memory=False`` is the filesystem-only
    pause: the guest syncs, only the disk is kept, a resume cold-boots on it.

    First its envd is asked whether it answers. If not, a filesystem-only pause (it needs
    the guest's sync) and a ``require_healthy_guest`` one raise GuestUnresponsive and the
    VM runs on untouched; any other pause proceeds and says so (``envd_unresponsive``).
    Returns {"to_disk", "memory", "envd_unresponsive", "timings"}."""
    driver = get_driver()
    started = time.perf_counter()
    unresponsive = _guest_unresponsive(driver, sandbox_id)
    if unresponsive and (require_healthy_guest or not memory):
        raise GuestUnresponsive(f"sandbox {sandbox_id}: its guest agent (envd) does not answer; it was not paused "
                                "and keeps running")
    probed_ms = round((time.perf_counter() - started) * 1000, 2)
    console_logs.flush(driver, sandbox_id)  # a resume starts a new console
    if not memory:
        timings = driver.pause_to_disk(sandbox_id, memory=False)
    else:
        timings = driver.pause_to_disk(sandbox_id) if to_disk else driver.pause(sandbox_id)
    if to_disk or not memory:
        guest_volumes.stop(sandbox_id)  # its slot is gone: a resume starts a server in the next one
    timings = _round(timings)
    timings["guest_probe"] = probed_ms
    timings["total_ms"] = round((time.perf_counter() - started) * 1000, 2)
    if to_disk and memory and moves.shared_store():  # other nodes may resume it (agent.moves)
        moves.export_later(driver, _store(), sandbox_id)
    return {"to_disk": bool(to_disk or not memory), "memory": bool(memory), "envd_unresponsive": unresponsive,
            "timings": timings}


def _guest_unresponsive(driver, sandbox_id: str) -> bool:
    """True when the running VM's envd does not answer /health; False when it does or
    when there is nothing to ask (no such VM, or not running: the pause says why)."""
    from vmm.driver import VMStatus

    info = driver.info(sandbox_id)
    if info is None or info.status != VMStatus.RUNNING:
        return False
    return not guest_responds(info.envd_host, info.envd_port)


@node_task(name=protocol.RESUME_SANDBOX)
def resume_sandbox(*, sandbox_id: str, env_vars: dict, access_token: str | None, memory: bool = True,
                   network: dict | None = None, volumes: list | None = None) -> dict:
    """Resumes a paused VM, then re-inits envd (fresh timestamp: the guest clock stood
    still while paused). ``memory=False`` cold-boots on the disk, discarding a memory
    snapshot (E2B's "reboot" resume). If /init fails the VM is paused again the way it
    came back (to disk with memory, or filesystem-only after a cold boot), so the sandbox
    stays consistently paused. Returns envd host/port, pid and timings like boot.

    ``network`` (the control plane's row): given to the saved VM before it runs again. The
    driver keeps a VM's policy across a pause anyway; this makes the row the truth, so a
    network update the node never confirmed is in force once the sandbox resumes."""
    driver = get_driver()
    started = time.perf_counter()
    if network is not None:
        driver.update_network(sandbox_id, _network(network))
    info = driver.resume(sandbox_id, memory=memory)
    t_resumed = time.perf_counter()
    cold = bool(info.timings.get("cold_boot"))

    def pause_again(sid: str) -> None:
        guest_volumes.stop(sid)
        if cold:  # nothing in memory worth keeping; the disk is what the sandbox is
            try:
                driver.pause_to_disk(sid, memory=False)
                return
            except Exception:
                log.warning("filesystem pause of %s failed; pausing with memory", sid)
        driver.pause_to_disk(sid)

    # The guest's NFS client (in its memory) reconnects to this new slot's server by itself.
    _step_or_undo(lambda: guest_volumes.serve(driver, sandbox_id, volumes), info, undo=pause_again,
                  what="pausing it again", label="volume server")
    _init_envd_or_undo(info, env_vars, access_token, undo=pause_again, what="pausing it again", network=network)
    if cold:  # a rebooted guest mounts again
        _step_or_undo(lambda: guest_volumes.mount(info, access_token, volumes, everything=True), info,
                      undo=pause_again, what="pausing it again", label="volume mounts")
    timings = _round(info.timings)
    timings["resume_ms"] = round((t_resumed - started) * 1000, 2)
    timings["init"] = round((time.perf_counter() - t_resumed) * 1000, 2)
    return _envd_result(info, timings)


# --- snapshots, restore and fork ---------------------------------------------

class StorageFull(Exception):
    """The snapshot store ran out of space while capturing (nothing partial is kept)."""


def _is_disk_full(exc: BaseException) -> bool:
    return getattr(exc, "errno", None) == errno.ENOSPC or "No space left on device" in str(exc)


def _take_over_envd(info, env_vars: dict, access_token: str | None, source_token: str | None, *,
                    undo, what: str, network=None) -> None:
    """/init of a VM started from a capture: its own token (handed over from the
    source's), its env vars, a fresh clock; on failure ``undo`` (kill) it."""
    if source_token and source_token != access_token:
        def handoff() -> None:
            if not access_token:
                raise EnvdInitFailed("a sandbox started from a secure source needs its own access token")
            handoff_token(info.envd_host, info.envd_port, source_token, access_token)

        _step_or_undo(handoff, info, undo=undo, what=what, label="envd token handoff")
    _init_envd_or_undo(info, env_vars, access_token, undo=undo, what=what, network=network)


def _store():
    from agent.stores import get_store  # noqa: PLC0415 - boto3 only on nodes that use s3

    return get_store()


@node_task(name=protocol.SNAPSHOT_SANDBOX)
def snapshot_sandbox(*, sandbox_id: str, snapshot_id: str, memory: bool = True, commit: bool = True) -> dict:
    """Captures the running VM into the snapshot store (the VM pauses briefly, then
    continues). ``memory=False``: the guest syncs first and only the disk layers are
    kept. ``commit=False``: only this node's copy, stored later by ``commit_snapshot`` (a
    fork across nodes starts the children here from it meanwhile). A failure removes
    whatever was written, so no partial snapshot stays; a full disk is reported as
    StorageFull. Returns {"manifest", "size_bytes", "memory", "timings"}."""
    driver = get_driver()
    store = _store()
    started = time.perf_counter()
    try:
        dest = store.prepare(snapshot_id)
    except OSError as exc:
        if _is_disk_full(exc):
            raise StorageFull(f"no space left in the snapshot store for {snapshot_id}: {exc}") from None
        raise
    try:
        # memory=False: the driver syncs the guest and captures the disk layers only.
        manifest = driver.snapshot(sandbox_id, dest, memory=memory)
        if commit:
            store.commit(snapshot_id)
    except BaseException as exc:
        store.delete(snapshot_id)
        if _is_disk_full(exc):
            raise StorageFull(f"no space left in the snapshot store while capturing {sandbox_id}: {exc}") from None
        raise
    timings = _round(manifest.timings)
    timings["task_ms"] = round((time.perf_counter() - started) * 1000, 2)
    return {"manifest": manifest.to_json(), "size_bytes": store.size_bytes(snapshot_id),
            "memory": bool(memory), "timings": timings}


@node_task(name=protocol.COMMIT_SNAPSHOT)
def commit_snapshot(*, snapshot_id: str) -> dict:
    """Stores a capture this node took with ``commit=False`` (with the S3 store: uploads it, so
    other nodes restore it). A failure leaves this node's copy as it was. Returns {"timings"}."""
    started = time.perf_counter()
    _store().commit(snapshot_id)
    return {"timings": {"commit_ms": round((time.perf_counter() - started) * 1000, 2)}}


@node_task(name=protocol.INDEX_SNAPSHOT)
def index_snapshot(*, snapshot_id: str) -> dict:
    """Hands a capture this node took with ``commit=False`` to the other nodes before its
    upload (a fork's early hand-off; the S3 store with peer fetch): its pending manifest in
    the store, its chunks served to peers from this node's files at once. The upload
    (``commit_snapshot``) follows. Returns {"chunks", "bytes", "timings"}."""
    from agent.chunk_peers import offer_own_now  # noqa: PLC0415 - the peers' module is the worker's

    started = time.perf_counter()
    store = _store()
    stats = store.index(snapshot_id)
    indexed = time.perf_counter()
    offer_own_now(store)
    return {**stats, "timings": {"index_ms": round((indexed - started) * 1000, 2),
                                 "offer_ms": round((time.perf_counter() - indexed) * 1000, 2)}}


@node_task(name=protocol.RESTORE_SANDBOX)
def restore_sandbox(*, sandbox_id: str, snapshot_id: str, env_vars: dict, access_token: str | None,
                    source_token: str | None = None, network: dict | None = None, template: bool = False,
                    volumes: list | None = None, pending_wait: float = 0.0) -> dict:
    """Starts a new VM from a snapshot (copy-on-write memory and disk), then gives its
    envd the new sandbox's token, env vars and clock; killed if that fails. A
    filesystem-only snapshot is cold-booted on its disk layers instead. ``template``: a
    built template's snapshot, restored like a booted template (``driver.restore(...,
    template=True)``: its own RAM copy, so its later pauses stay cheap). ``pending_wait``
    (s): the snapshot may be a fork's capture handed over while its node still uploads it
    (``index_snapshot``), read lazily and waited for up to that long."""
    from vmm.driver import BootSpec, SnapshotManifest

    driver = get_driver()
    store = _store()
    located = time.perf_counter()
    manifest = SnapshotManifest.load(store.local_dir(snapshot_id, pending_wait=float(pending_wait)))
    # where the snapshot's files are (own, cached, downloaded or mounted lazily: its steps)
    located_ms = {"snapshot_dir_ms": round((time.perf_counter() - located) * 1000, 2),
                  **store.take_mount_timings(snapshot_id)}
    if manifest.memory_file:
        # a template's snapshot stays while sandboxes use it; a moved sandbox's pause image does not
        stays = template and snapshot_id != protocol.pause_image_of(sandbox_id)
        info = driver.restore(manifest, BootSpec(sandbox_id=sandbox_id, network=_network(network)),
                              template=template, source_stays=stays)
    else:
        info = driver.boot(BootSpec(sandbox_id=sandbox_id, image=manifest.machine.get("image") or "base",
                                    cpu_count=manifest.cpu_count, memory_mb=manifest.memory_mb,
                                    disk_size_mb=manifest.disk_size_mb, layers=list(manifest.layers),
                                    network=_network(network)))
        source_token = None  # a cold-booted envd starts without a token
    kill = _killer(driver)
    _step_or_undo(lambda: guest_volumes.serve(driver, sandbox_id, volumes), info, undo=kill,
                  what="killing its VM", label="volume server")
    started = time.perf_counter()
    _take_over_envd(info, env_vars, access_token, source_token, undo=kill, what="killing its VM",
                    network=network)
    # A memory snapshot's guest has the snapshot's mounts already: only the create's own are new.
    _step_or_undo(lambda: guest_volumes.mount(info, access_token, volumes, everything=not manifest.memory_file),
                  info, undo=kill, what="killing its VM", label="volume mounts")
    timings = {**_round(info.timings), **located_ms}
    timings["init"] = round((time.perf_counter() - started) * 1000, 2)
    try:
        store.restored(snapshot_id)  # a lazy restore's first-read chunks become its prefetch list
    except Exception:  # noqa: BLE001 - the sandbox runs; only later restores' speed depends on it
        log.warning("snapshot %s: after-restore bookkeeping failed", snapshot_id, exc_info=True)
    return _envd_result(info, timings)


FORK_INIT_THREADS = 16


@node_task(name=protocol.FORK_SANDBOX)
def fork_sandbox(*, sandbox_id: str, env_vars: dict, access_token: str | None, children: list[dict],
                 volumes: list | None = None) -> dict:
    """One capture of the running parent, then a child per entry of ``children``
    ({"sandbox_id", "env_vars", "access_token", "network"?}), each taking over its envd with
    its own token. A child inherits the parent's network policy in the driver; a ``network``
    (its row's) is then applied to it, so a child never runs with a policy its row does not
    say (an update of the parent racing the fork). A child that fails (restore, policy or
    /init) is killed and reported alone; its siblings are unaffected. The parent is re-inited
    too (its clock stood still).

    Returns {"parent": {"ok", "error"?}, "children": [{"sandbox_id", "ok", ...}], "timings"}."""
    from vmm.driver import VMInfo

    driver = get_driver()
    ids = [c["sandbox_id"] for c in children]
    started = time.perf_counter()
    results = driver.fork(sandbox_id, len(ids), ids)  # raises only if the capture failed
    t_forked = time.perf_counter()

    parent = {"ok": True}
    info = driver.info(sandbox_id)
    try:
        if info is None:
            raise EnvdInitFailed(f"parent {sandbox_id} is gone after the fork")
        init_envd(info.envd_host, info.envd_port, env_vars, access_token)
    except Exception as exc:  # reported; the parent keeps running as it is
        parent = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}

    def init_child(spec: dict, result) -> dict:
        cid = spec["sandbox_id"]
        if not isinstance(result, VMInfo):
            return {"sandbox_id": cid, "ok": False, "kind": type(result).__name__, "message": str(result)}
        t0 = time.perf_counter()
        try:
            # the parent's volumes, mounted in the child's memory: its own slot's server
            _step_or_undo(lambda: guest_volumes.serve(driver, cid, volumes), result, undo=_killer(driver),
                          what="killing its VM", label="volume server")
            if spec.get("network") is not None:
                _step_or_undo(lambda: driver.update_network(cid, _network(spec["network"])), result,
                              undo=_killer(driver), what="killing its VM", label="network policy")
            _take_over_envd(result, spec.get("env_vars") or {}, spec.get("access_token"), access_token,
                            undo=_killer(driver), what="killing its VM", network=spec.get("network"))
        except Exception as exc:
            return {"sandbox_id": cid, "ok": False, "kind": type(exc).__name__, "message": str(exc)}
        timings = _round(result.timings)
        timings["init"] = round((time.perf_counter() - t0) * 1000, 2)
        return {"sandbox_id": cid, "ok": True, **_envd_result(result, timings)}

    with ThreadPoolExecutor(max_workers=max(1, min(len(ids), FORK_INIT_THREADS))) as pool:
        out = list(pool.map(init_child, children, results))
    timings = {"fork_ms": round((t_forked - started) * 1000, 2),
               "total_ms": round((time.perf_counter() - started) * 1000, 2)}
    return {"parent": parent, "children": out, "timings": timings}


@node_task(name=protocol.UPDATE_NETWORK)
def update_network(*, sandbox_id: str, network: dict, access_token: str | None = None) -> dict:
    """Replaces the VM's egress policy (E2B's PUT /sandboxes/{id}/network) with ``network``
    (NetworkSpec JSON): at once for a running VM, recorded for one saved to disk. Raises
    VMNotFound, or UnsupportedNetworkPolicy (nothing changed) if its backend cannot enforce it.
    A policy with rules on a running VM: its guest first trusts the node's CA (``access_token``:
    its envd's), so a guest that could not is refused with nothing changed (TrustFailed); a
    saved VM gets it when it resumes."""
    started = time.perf_counter()
    driver = get_driver()
    if egress_trust.needs_ca(network):
        from vmm.driver import VMStatus  # noqa: PLC0415 - like the other vmm imports here

        info = driver.info(sandbox_id)
        if info is not None and info.status == VMStatus.RUNNING:
            egress_trust.install_in_guest(info.envd_host, info.envd_port, access_token)
    driver.update_network(sandbox_id, _network(network))
    return {"timings": {"total_ms": round((time.perf_counter() - started) * 1000, 2)}}


@node_task(name=protocol.DELETE_SNAPSHOT_FILES)
def delete_snapshot_files(*, snapshot_id: str) -> dict:
    """Removes a snapshot's files from this node's store; {"deleted": False} if none."""
    return {"deleted": bool(_store().delete(snapshot_id))}


@node_task(name=protocol.BUILD_TEMPLATE, ignore_result=True)
def build_template(*, build_id: str, template_id: str, spec: dict, cpu_count: int, memory_mb: int,
                   disk_size_mb: int) -> dict:
    """Builds template build ``build_id`` of ``template_id`` on this node (E2B's template
    builder, ``agent.builder``): the base (``spec["from_image"]`` pulled with
    ``spec["from_image_registry"]``'s credentials, or ``spec["from_template"]``'s ready
    build), ``spec["steps"]`` in a VM of ``cpu_count`` vCPU / ``memory_mb`` MiB with a
    ``disk_size_mb`` disk, a layer sealed and cached per step, ``spec["start_cmd"]`` started
    and ``spec["ready_cmd"]`` awaited, then the template snapshot a create restores.

    The control plane does not wait for this task: the builder reports through
    ``template_builds.progress`` (accept, every log line, finish with the result or the
    error and its step)."""
    from agent.builder import build_template as build

    return build(build_id=build_id, template_id=template_id, spec=spec, cpu_count=cpu_count,
                 memory_mb=memory_mb, disk_size_mb=disk_size_mb)
