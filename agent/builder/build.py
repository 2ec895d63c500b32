"""One template build on this node, start to finish (E2B's builder, spec §4): the base,
the steps in one VM with a disk layer sealed per step and cached by its chain key, then
finalize (the template's defaults, the start command, the ready check) and the template
snapshot a create restores. With lazy restores (the S3 store), that snapshot is then restored
once here to record what a restore reads first: its prefetch list, stored with it
(``S3Store.record_prefetch``), which the first create on any other node fetches ahead.

The steps run in a real VM of the build's shape, booted on the longest cached prefix of
the chain (a rebuild of unchanged steps boots once and runs nothing but finalize). Every
log line reaches the build record within a fraction of a second (``BuildLog``); a build
cancelled meanwhile stops at its next line, the VM killed under a running command.
Whatever happens, the build VM is killed and nothing half-made is left for a create:
the build's result exists only once ``template_builds.progress.finish`` accepted it."""
from __future__ import annotations

import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from envd_client import EnvdUnavailable

from agent.builder import base as bases
from agent.builder import plan
from agent.builder.guest import BuildGuest, StartCommand, StepFailed
from agent.builder.layers import LayerCache
from agent.builder.log import BuildLog, Cancelled

log = logging.getLogger(__name__)

READY_INTERVAL = 2.0  # E2B's: the ready command every 2 s ...
BUILD_VM_PREFIX = "build-"  # build VMs' ids (a node restart kills them: agent.builder.abandon)
DEFAULT_READY = "sleep 20"  # E2B's ready command for a start command that names none


def vm_id_of(build_id: str) -> str:
    """Short: the VM's QMP socket path (<home>/sandboxes/<id>/qmp.sock) must fit a Unix socket."""
    return f"{BUILD_VM_PREFIX}{uuid.UUID(str(build_id)).hex[:16]}"


def recording_vm_id(build_id: str) -> str:
    """The VM that records the template snapshot's prefetch list (a build VM too: a node
    restart kills it with them)."""
    return f"{vm_id_of(build_id)}-p"


@dataclass
class Failure(Exception):
    """The build fails with ``message`` at ``step`` ("base", "1".."N", "finalize")."""

    message: str
    step: str


@dataclass
class Request:
    build_id: str
    template_id: str
    spec: dict  # lifecycle.templates.start.node_spec
    cpu_count: int
    memory_mb: int
    disk_size_mb: int


@dataclass
class Outcome:
    snapshot_id: str
    manifest: dict
    size_bytes: int
    image: str
    details: dict = field(default_factory=dict)
    reused: bool = False  # an earlier build's template snapshot (not this build's to record or remove)


@dataclass
class Node:
    """What a build needs of the node: its driver, snapshot store, COPY file store, image
    dir and layer cache, and the limits it works within."""

    node_id: str
    driver: object
    store: object
    files: object
    images_dir: Path
    cache: LayerCache
    build_timeout: float = 3600.0
    ready_timeout: float = 600.0
    insecure_registries: list[str] = field(default_factory=list)
    private_registries: list[str] = field(default_factory=list)
    defaults_file: str = "/etc/aenv/template.json"


class Build:
    def __init__(self, node: Node, req: Request, log: BuildLog):
        self.node, self.req, self.log = node, req, log
        self.vm_id = vm_id_of(req.build_id)
        self.deadline = time.monotonic() + node.build_timeout
        self.private_slots = []
        self.layers: list[dict] = []
        self.timings: dict[str, float] = {}
        self.vm_started = False

    # -- the phases -----------------------------------------------------------------------

    def run(self) -> Outcome:
        t0 = time.monotonic()
        base = self._base()
        self.timings["base_s"] = round(time.monotonic() - t0, 2)
        root = plan.base_key(str(self.req.spec["team_id"]), f"{base.id};default-user:{plan.DEFAULT_USER}")
        planned = plan.plan(root, self.req.spec.get("steps") or [], bool(self.req.spec.get("force")))
        cached, ctx, chain = self._cached_prefix(planned, base)
        start_cmd, ready_cmd = self._commands(base)
        last_key = planned[-1].key if planned else root
        outcome = None
        if len(cached) == len(planned) and not self.req.spec.get("force"):
            outcome = self._reuse(self._final_key(last_key, ctx, base, start_cmd, ready_cmd))
        if outcome is None:
            with self.node.cache.pinned(cached):
                outcome = self._build(base, planned[len(cached):], ctx, chain, last_key, start_cmd, ready_cmd)
        self.timings["total_s"] = round(time.monotonic() - t0, 2)
        outcome.details.update(layers=self.layers, timings=self.timings, cached_steps=len(cached),
                               steps=len(planned))
        return outcome

    def _cached_prefix(self, planned: list[plan.Planned], base: bases.Base):
        """The steps the layer cache already has, in order until the first miss or forced
        step, with the context and disk chain after them."""
        ctx = base.ctx.copy()
        ctx.user = plan.DEFAULT_USER  # E2B's default-user phase: every build's steps start as `user`
        chain, cached = base.layers, []
        for p in planned:
            entry = None if p.forced else self.node.cache.get(p.key)
            if entry is None:
                break
            cached.append(entry)
            ctx = plan.Context.from_json(entry.meta.get("ctx"))
            chain = entry.chain or chain
            self.layers.append(self._layer_info(p, entry.size_bytes if entry.layer else 0, True))
            self.log(level="info", message=f"CACHED {p.label} [{p.key[:12]}]", step=str(p.number))
        return cached, ctx, chain

    def _build(self, base: bases.Base, todo: list[plan.Planned], ctx: plan.Context, chain, last_key: str,
               start_cmd: str, ready_cmd: str) -> Outcome:
        """One VM on the cached prefix: the remaining steps, then finalize."""
        guest = self._boot(base, chain)
        try:
            guest.ensure_user(plan.DEFAULT_USER, sudo=True, step="base")
            for p in todo:
                t_step = time.monotonic()
                ctx, chain = self._step(guest, p, ctx, chain)
                self.timings[f"step_{p.number}_s"] = round(time.monotonic() - t_step, 2)
            t_fin = time.monotonic()
            outcome = self._finalize(guest, base, ctx, start_cmd, ready_cmd)
            outcome.details["final_key"] = self._final_key(last_key, ctx, base, start_cmd, ready_cmd)
            self.timings["finalize_s"] = round(time.monotonic() - t_fin, 2)
            return outcome
        finally:
            guest.close()

    def _commands(self, base: bases.Base) -> tuple[str, str]:
        """The start and ready commands: the request's, else those inherited from a base
        template; a start command without a ready command waits E2B's default."""
        spec = self.req.spec
        start_cmd, ready_cmd = spec.get("start_cmd") or "", spec.get("ready_cmd") or ""
        if not start_cmd and not ready_cmd:
            start_cmd, ready_cmd = base.start_cmd, base.ready_cmd
        if start_cmd and not ready_cmd:
            ready_cmd = DEFAULT_READY
        return start_cmd, ready_cmd

    def _final_key(self, last_key: str, ctx: plan.Context, base: bases.Base, start_cmd: str, ready_cmd: str) -> str:
        """What the template snapshot depends on besides the disk (the last step's key): the
        context, the start / ready commands, the shape, and the machine that runs it (driver
        fingerprint, the boot image's kernel and tools drive)."""
        import json

        from vmm.images import find_image

        recipe = find_image(self.node.images_dir, base.image).recipe_hash
        return plan.digest(last_key, "finalize", json.dumps(ctx.to_json(), sort_keys=True), start_cmd, ready_cmd,
                           f"{self.req.cpu_count}/{self.req.memory_mb}/{self.req.disk_size_mb}",
                           json.dumps(self.node.driver.fingerprint(), sort_keys=True), recipe)

    def _reuse(self, final_key: str) -> Outcome | None:
        """A rebuild that changed nothing (every step cached, same finalize inputs) takes the
        template snapshot of the template's earlier ready build that had the same key: no VM
        boots. Only within one template, so deleting another template never takes it away."""
        from template_builds.models import BuildStatus, TemplateBuild

        earlier = (TemplateBuild.objects.filter(template_id=self.req.template_id, status=BuildStatus.READY,
                                                snapshot__state="ready", snapshot__node_id=self.node.node_id)
                   .exclude(pk=self.req.build_id).select_related("snapshot").order_by("-finished_at"))
        for build in earlier[:20]:
            if (build.result or {}).get("final_key") != final_key:
                continue
            try:
                self.node.store.local_dir(build.snapshot_id)
            except Exception:  # noqa: BLE001 - its files are gone from here: build anew
                continue
            keep = ("context", "user", "workdir", "image", "base", "start_cmd", "ready_cmd")
            details = {k: v for k, v in (build.result or {}).items() if k in keep}
            details["final_key"] = final_key
            self.log.info(f"CACHED [finalize] template snapshot {build.snapshot_id} of build {build.pk}",
                          step="finalize")
            return Outcome(snapshot_id=build.snapshot_id, manifest=build.snapshot.manifest,
                           size_bytes=build.snapshot.size_bytes, image=build.image or details.get("image", ""),
                           details=details, reused=True)
        return None

    def _base(self) -> bases.Base:
        spec = self.req.spec
        try:
            if spec.get("from_image"):
                self.log.info(f"[base] FROM {spec['from_image']}", step="base")
                found = bases.from_image(spec["from_image"], spec.get("from_image_registry"), self.node.images_dir,
                                         self.node.insecure_registries,
                                         say=lambda m: self.log(level="info", message=f"[base] {m}", step="base"),
                                         private_allowed=self.node.private_registries)
                self.log.info(f"[base] image {found.details['digest']} as root disk {found.details['disk']}",
                              step="base")
            elif spec.get("from_template"):
                source = spec["from_template"]
                self.log.info(f"[base] FROM template {source.get('ref')}", step="base")
                found = bases.from_template(source, self.node.store, self.node.images_dir)
            else:
                raise StepFailed("the build names neither fromImage nor fromTemplate")
        except StepFailed as exc:
            raise Failure(str(exc), "base") from None
        self.log.info(f"[base] DEFAULT USER {plan.DEFAULT_USER}", step="base")
        return found

    def _boot(self, base: bases.Base, chain: list[str] | None) -> BuildGuest:
        from vmm.driver import BootSpec, VMError

        self.log.info(f"[base] booting the build VM ({self.req.cpu_count} vCPU, {self.req.memory_mb} MiB, "
                      f"{self.req.disk_size_mb} MiB disk)", step="base")
        t0 = time.monotonic()
        try:
            self.vm_started = True
            info = self.node.driver.boot(BootSpec(sandbox_id=self.vm_id, image=base.image,
                                                  cpu_count=self.req.cpu_count, memory_mb=self.req.memory_mb,
                                                  disk_size_mb=self.req.disk_size_mb, layers=chain))
        except VMError as exc:
            if self.log.cancelled:
                raise Cancelled("the build was cancelled") from None
            raise Failure(f"the build VM did not start: {exc}", "base") from None
        self.timings["boot_s"] = round(time.monotonic() - t0, 2)
        self.log.info(f"[base] build VM up in {self.timings['boot_s']:.1f}s", step="base")
        return BuildGuest(info.envd_host, info.envd_port, self.log, self.deadline)

    def _step(self, guest: BuildGuest, p: plan.Planned, ctx: plan.Context, chain):
        step_name = str(p.number)
        self.log.info(p.label, step=step_name)
        args = list(p.step.get("args") or [])
        ctx = ctx.copy()
        changes_disk = True
        try:
            guest.check_shell()  # every step needs one (E2B's run through bash): a shell-less image fails here
            if p.kind == "RUN":
                user = plan.check_user(args[1]) if len(args) > 1 and args[1] else ctx.user
                guest.run(args[0], user=user, ctx=ctx, prefix=f"[builder {p.number}/{p.total}]", step=step_name)
            elif p.kind == "COPY":
                self._copy(guest, p, ctx)
            elif p.kind == "ENV":
                env = {**guest.root_env(), **ctx.env}
                for key, value in plan.env_pairs(args):
                    ctx.env[key] = plan.expand(value, env)
                    env[key] = ctx.env[key]
                changes_disk = False
            elif p.kind == "WORKDIR":
                ctx.workdir = plan.workdir_after(ctx, args[0] if args else "")
                guest.make_workdir(ctx.workdir, ctx.user, step_name)
            elif p.kind == "USER":
                ctx.user = plan.check_user(args[0] if args else "")
                guest.ensure_user(ctx.user, sudo=len(args) > 1 and args[1] == "true", step=step_name)
            else:
                raise StepFailed(f"command type {p.step['type']} is not implemented")
        except (StepFailed, plan.StepError) as exc:
            raise Failure(str(exc), step_name) from None
        slot = self.node.cache.slot(p.key)
        if not slot.cached:
            self.private_slots.append(slot)
        size = 0
        if changes_disk:
            try:
                sealed = self.node.driver.seal_layer(self.vm_id, slot.layer_path)
            except BaseException:
                slot.abandon()
                raise
            chain, size = sealed.layers, sealed.size_bytes
        if slot.cached:
            slot.commit({"parent": p.key, "step": step_name, "type": p.step["type"], "args": args,
                         "files_hash": p.step.get("files_hash") or "", "ctx": ctx.to_json(), "chain": chain or [],
                         "layer": changes_disk, "build_id": self.req.build_id, "team_id": self.req.spec["team_id"]})
        self.layers.append(self._layer_info(p, size, False))
        return ctx, chain

    def _copy(self, guest: BuildGuest, p: plan.Planned, ctx: plan.Context) -> None:
        files_hash = p.step.get("files_hash") or ""
        cp = plan.copy_plan(list(p.step.get("args") or []), ctx)
        info = (self.req.spec.get("files") or {}).get(files_hash) or {}
        staging = Path(self.node.files.staging_dir()) / f"build-{uuid.uuid4().hex[:8]}-{files_hash[:16]}.tar"
        try:
            try:
                archive = self.node.files.fetch(self.req.spec["team_id"], files_hash, staging)
            except Exception as exc:  # noqa: BLE001 - a missing upload is the user's to fix
                raise StepFailed(f"the files of COPY {p.step['args'][0]} (hash {files_hash}) are not available: "
                                 f"{exc}") from None
            guest.copy(Path(archive), bool(info.get("gzip", True)), files_hash, cp, str(p.number))
        finally:
            staging.unlink(missing_ok=True)

    def _finalize(self, guest: BuildGuest, base: bases.Base, ctx: plan.Context, start_cmd: str,
                  ready_cmd: str) -> Outcome:
        self.log.info("[finalize] Finalizing template build", step="finalize")
        try:
            guest.check_shell()
            guest.write_defaults(ctx, self.node.defaults_file)
            if start_cmd or ready_cmd:
                self._start_and_wait(guest, ctx, start_cmd, ready_cmd)
            guest.drop_caches()
        except (StepFailed, plan.StepError) as exc:
            raise Failure(str(exc), "finalize") from None
        outcome = self._snapshot(base, ctx, start_cmd, ready_cmd)
        self._record_prefetch(outcome)
        return outcome

    def _record_prefetch(self, outcome: Outcome) -> None:
        """The snapshot's prefetch list, recorded by one restore here (where the store can:
        ``record_prefetch``). Never fails the build: without a list, the first lazy restore
        elsewhere records one, as before."""
        record = getattr(self.node.store, "record_prefetch", None)
        if record is None:
            return
        self.kill_vm()  # its snapshot is taken: the recording VM gets its room
        t0 = time.monotonic()
        try:
            chunks = record(outcome.snapshot_id, self._recording_vm)
        except Exception as exc:  # noqa: BLE001 - only later creates' speed depends on it
            log.warning("build %s: recording the prefetch list of snapshot %s failed", self.req.build_id,
                        outcome.snapshot_id, exc_info=True)
            self.log.info(f"[finalize] no prefetch list recorded: {exc}", step="finalize")
            return
        if chunks is None:
            return
        self.timings["prefetch_s"] = round(time.monotonic() - t0, 2)
        outcome.details["prefetch_chunks"] = chunks
        self.log.info(f"[finalize] prefetch list: {chunks} chunks a restore reads first, recorded in "
                      f"{self.timings['prefetch_s']:.1f}s", step="finalize")

    @contextlib.contextmanager
    def _recording_vm(self, snapshot_dir: Path):
        """A VM restored from ``snapshot_dir`` as a create's, its envd answering and /init done
        (what a create waits for), until the block ends; then killed. Its RAM is mapped, not
        copied: what is recorded is what the guest touches, not a whole copy."""
        from vmm.driver import BootSpec, SnapshotManifest

        from agent.guest import init_envd

        vm_id = recording_vm_id(self.req.build_id)
        try:
            info = self.node.driver.restore(SnapshotManifest.load(snapshot_dir), BootSpec(sandbox_id=vm_id))
            init_envd(info.envd_host, info.envd_port, {}, None)
            yield info
        finally:
            try:
                self.node.driver.kill(vm_id)
            except Exception:  # noqa: BLE001
                log.exception("build %s: killing its recording VM failed", self.req.build_id)

    def _start_and_wait(self, guest: BuildGuest, ctx: plan.Context, start_cmd: str, ready_cmd: str) -> None:
        started = None
        if start_cmd:
            self.log.info(f"[finalize] start command: {start_cmd}", step="finalize")
            started = StartCommand(guest, start_cmd, ctx, ctx.user)
        try:
            self.log.info(f"Waiting for template to be ready: {ready_cmd}", step="finalize")
            end = min(self.deadline, time.monotonic() + self.node.ready_timeout)
            while True:
                if started is not None and started.exited and started.exit_code != 0:
                    raise StepFailed(f"start command failed: '{start_cmd}': {started.status}")
                try:
                    guest.run(ready_cmd, user=ctx.user, ctx=ctx, prefix="[ready]", step="finalize")
                    break
                except StepFailed:
                    if started is not None and started.exited and started.exit_code != 0:
                        raise StepFailed(f"start command failed: '{start_cmd}': {started.status}") from None
                if time.monotonic() + READY_INTERVAL > end:
                    waited = int(self.node.ready_timeout)
                    raise StepFailed(f"ready command timed out after {waited // 60}m{waited % 60}s: '{ready_cmd}'")
                time.sleep(READY_INTERVAL)
            self.log.info("Template is ready", step="finalize")
        finally:
            if started is not None:
                started.detach()
                guest.sync()  # a round trip: envd has handled the stream's end before the snapshot

    def _snapshot(self, base: bases.Base, ctx: plan.Context, start_cmd: str, ready_cmd: str) -> Outcome:
        from snapshots.models import new_snapshot_id

        snapshot_id = new_snapshot_id()
        store = self.node.store
        dest = store.prepare(snapshot_id)
        t0 = time.monotonic()
        try:
            # with its base: another node restores it from the store without having the image
            manifest = self.node.driver.snapshot(self.vm_id, dest, memory=True, with_base=True)
            store.commit(snapshot_id)
        except BaseException:
            store.delete(snapshot_id)
            raise
        size = store.size_bytes(snapshot_id)
        self.timings["snapshot_s"] = round(time.monotonic() - t0, 2)
        self.log.info(f"[finalize] template snapshot {snapshot_id} ({size / 2**20:.0f} MiB) in "
                      f"{self.timings['snapshot_s']:.1f}s", step="finalize")
        details = {"context": ctx.to_json(), "user": ctx.user, "workdir": ctx.workdir or plan.home_of(ctx.user),
                   "image": base.image, "base": base.details, "start_cmd": start_cmd, "ready_cmd": ready_cmd}
        return Outcome(snapshot_id=snapshot_id, manifest=manifest.to_json(), size_bytes=size, image=base.image,
                       details=details)

    @staticmethod
    def _layer_info(p: plan.Planned, size: int, cached: bool) -> dict:
        return {"step": str(p.number), "type": p.step["type"], "key": p.key, "size_bytes": int(size),
                "cached": cached}

    # -- cleanup ----------------------------------------------------------------------------

    def kill_vm(self) -> None:
        if self.vm_started:
            try:
                self.node.driver.kill(self.vm_id)
            except Exception:  # noqa: BLE001
                log.exception("build %s: killing its VM failed", self.req.build_id)

    def cleanup(self) -> None:
        self.kill_vm()
        for slot in self.private_slots:
            self.node.cache.remove_private(slot)


def internal_error(exc: BaseException) -> str:
    if isinstance(exc, EnvdUnavailable):
        return f"the build VM stopped answering: {exc}"
    return f"internal error: {type(exc).__name__}: {exc}"
