"""QEMU driver, snapshot half: snapshot (a brief stop: new disk top, device state, RAM copy),
restore (a destination QEMU over the snapshot's files, copy-on-write RAM or, for booted
templates, a RAM copy of its own) and fork (one capture, N restores); fork captures are the
driver's and go with their last child.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from vmm.driver import BootSpec, SealedLayer, SnapshotManifest, SnapshotUnusable, VMError, VMInfo
from vmm.net import ENVD_PORT, NetworkSpec
from vmm.qemu import ramfile
from vmm.qemu.cmdline import VMPaths
from vmm.qemu.process import run
from vmm.qemu.qmp import QMP, migrate_to_file
from vmm.qemu.state import VMState, other_forwards, valid_sandbox_id
from vmm.qemu.tops import create_top
from vmm.vm_status import VmLifecycle


class SnapshotMixin:
    """snapshot / restore / fork of QemuDriver (needs its _lock, _load, _paths, _cleanup,
    _spawn_incoming, _guest_sync, _to_info, fingerprint, check_snapshot)."""

    def snapshot(self, sandbox_id: str, dest_dir: Path, memory: bool = True,
                 with_base: bool = False) -> SnapshotManifest:
        return self._snapshot(sandbox_id, dest_dir, memory=memory, with_base=with_base)

    def _snapshot(self, sandbox_id: str, dest_dir: Path, memory_file: Path | None = None,
                  memory: bool = True, with_base: bool = False) -> SnapshotManifest:
        """memory_file: where the RAM copy goes (default dest_dir/memory.ram); fork captures put
        it on /dev/shm, where the copy is a page-cache-speed memcpy and children map it.
        memory=False: the guest syncs first and only the disk layers are captured (no device
        state, no RAM copy: a pause of a few ms); the manifest's memory and device state
        files are "" and sandboxes start from it with BootSpec(layers=manifest.layers)."""
        dest = Path(dest_dir).absolute()
        dest.mkdir(parents=True, exist_ok=True)
        if any(dest.iterdir()):
            raise VMError(f"snapshot dir {dest} is not empty")
        with self._lock(sandbox_id):
            state = self._load(sandbox_id)
            if state.status.offline:
                raise VMError(f"sandbox {sandbox_id} is paused to disk; resume it before a snapshot")
            paths = self._paths(state)
            device_state = dest / "device.state"
            ram_copy = Path(memory_file) if memory_file else dest / "memory.ram"
            # filesystem-only: the page cache must reach the disk first
            resumed_for_sync = self._sync_running(state, paths) if not memory else False
            with QMP(paths.qmp, timeout=30.0) as q:
                was_running = q.execute("query-status").get("status") == "running" and not resumed_for_sync
                t0 = time.monotonic()
                q.execute("stop")
                t_stop = time.monotonic()
                try:
                    self._switch_top(q, state, paths)
                    t_disk = time.monotonic()
                    if memory:
                        migrate_to_file(q, device_state)
                    t_dev = time.monotonic()
                    if not memory:
                        pass
                    elif state.ram_share:
                        run(["cp", "--sparse=always", state.ram, str(ram_copy)])
                    else:  # copy-on-write RAM is all in the device state; restores only need a base
                        with open(ram_copy, "wb") as f:
                            f.truncate(state.memory_mb << 20)
                    t_mem = time.monotonic()
                finally:
                    if was_running:
                        q.execute("cont")
                t_cont = time.monotonic()
            # Outside the pause: copy the sealed layers (immutable now) so the snapshot dir does
            # not depend on the sandbox, and point each copy at the previous one.
            layers = _copy_chain(state.chain, dest, with_base)
            t_done = time.monotonic()
            timings = {"stop_ms": (t_stop - t0) * 1e3, "disk_ms": (t_disk - t_stop) * 1e3,
                       "device_ms": (t_dev - t_disk) * 1e3, "memory_copy_ms": (t_mem - t_dev) * 1e3,
                       "pause_ms": (t_cont - t0) * 1e3, "layers_copy_ms": (t_done - t_cont) * 1e3,
                       "total_ms": (t_done - t0) * 1e3}
            manifest = self._manifest(state, dest, layers, str(ram_copy) if memory else "",
                                      str(device_state) if memory else "", timings)
            state.timings.update({f"snapshot.{k}": v for k, v in timings.items()})
            state.save()
            return manifest

    def _manifest(self, state: VMState, dest: Path, layers: list[str], memory_file: str, device_state_file: str,
                  timings: dict) -> SnapshotManifest:
        manifest = SnapshotManifest(
            dir=dest, fingerprint=self.fingerprint(), layers=layers, memory_file=memory_file,
            device_state_file=device_state_file,
            cpu_count=state.cpu_count, memory_mb=state.memory_mb, disk_size_mb=state.disk_size_mb,
            machine={"qemu": state.qemu, "accel": state.accel, "kernel": state.kernel, "initrd": state.initrd,
                     "tools": state.tools, "tsc_khz": state.tsc_khz, "resize": state.resize,
                     "image": state.image, "image_dir": state.image_dir, "source_argv": state.argv},
            source_sandbox_id=state.sandbox_id, created_at=time.time(), timings=timings)
        manifest.save()
        return manifest

    def export_saved(self, sandbox_id: str, dest_dir: Path) -> SnapshotManifest:
        """A VM saved to disk with its own memory, as a self-contained snapshot: its whole disk
        (the base linked, every layer and the top copied and re-chained), its RAM (from tmpfs
        or disk) and device state. The VM is unchanged. A copy-on-write VM (restored or forked,
        not resumed since) carries its RAM inside its device state in a format restores do not
        read: refused, like a VM that is not saved with its memory."""
        dest = Path(dest_dir).absolute()
        dest.mkdir(parents=True, exist_ok=True)
        if any(dest.iterdir()):
            raise VMError(f"snapshot dir {dest} is not empty")
        with self._lock(sandbox_id):
            state = self._load(sandbox_id)
            if state.status is not VmLifecycle.PAUSED_DISK or not state.device_state:
                raise VMError(f"sandbox {sandbox_id} is not paused to disk with its memory")
            if state.device_state_full_ram or not state.ram_share:
                raise VMError(f"sandbox {sandbox_id} keeps its memory copy-on-write over a snapshot's; resume it "
                              "once before it can move")
            t0 = time.monotonic()
            layers = _copy_chain([*state.chain, state.top], dest, with_base=True)
            ram = dest / "memory.ram"
            fd = os.open(ram, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            try:
                os.ftruncate(fd, Path(state.ram).stat().st_size)
                ramfile.copy_sparse_into(state.ram, fd)
            finally:
                os.close(fd)
            run(["cp", str(state.device_state), str(dest / "device.state")])
            timings = {"total_ms": (time.monotonic() - t0) * 1e3}
            return self._manifest(state, dest, layers, str(ram), str(dest / "device.state"), timings)

    @staticmethod
    def _switch_top(q: QMP, state: VMState, paths: VMPaths) -> str:
        """With the VM stopped: seals its current top (read-only from now on, owned by the
        sandbox) and continues on a new empty ``top-N.qcow2`` over it. Returns the sealed file."""
        gen = state.generation + 1
        new_top = paths.state_dir / f"top-{gen}.qcow2"
        node = f"top{gen}"
        q.execute("blockdev-snapshot-sync", **{"node-name": state.top_node, "snapshot-file": str(new_top),
                                                "snapshot-node-name": node, "format": "qcow2"})
        sealed = state.top
        state.chain.append(sealed)
        state.top, state.top_node, state.generation = str(new_top), node, gen
        state.save()
        return sealed

    def seal_layer(self, sandbox_id: str, dest: Path) -> SealedLayer:
        """Guest sync, a stop of a few ms for the new top, then (the VM running again) a sparse
        copy of the sealed top to ``dest`` re-pointed at the layer below it: the boot's last
        layer, or the previous seal's dest. Only a chain that grew by seals alone can be
        sealed: a snapshot in between, or a copy that failed, left a layer in the state dir
        that no dest holds (the next seal would lack its writes), so those are refused."""
        dest = Path(dest).absolute()
        if dest.exists():
            raise VMError(f"layer {dest} already exists")
        with self._lock(sandbox_id):
            state = self._load(sandbox_id)
            if state.status.offline:
                raise VMError(f"sandbox {sandbox_id} is paused to disk; resume it before sealing a layer")
            below = state.chain[-1]
            if state.seal_chain:
                base = list(state.seal_chain)
                ok = below == state.seal_source
            else:
                base = list(state.chain)
                ok = Path(state.state_dir) not in Path(below).parents
            if not ok:
                raise VMError(f"sandbox {sandbox_id}: its disk chain changed since it booted or was last sealed "
                              "(a snapshot, or a seal that failed); it cannot be sealed as a layer")
            paths = self._paths(state)
            t0 = time.monotonic()
            resumed_for_sync = self._sync_running(state, paths)
            t_sync = time.monotonic()
            with QMP(paths.qmp, timeout=30.0) as q:
                was_running = q.execute("query-status").get("status") == "running" and not resumed_for_sync
                q.execute("stop")
                try:
                    sealed = self._switch_top(q, state, paths)
                finally:
                    if was_running:
                        q.execute("cont")
            t_switch = time.monotonic()
            tmp = dest.with_name(f".{dest.name}.tmp-{uuid.uuid4().hex[:8]}")
            try:
                dest.parent.mkdir(parents=True, exist_ok=True)
                run(["cp", "--sparse=always", sealed, str(tmp)])
                run(["qemu-img", "rebase", "-u", "-f", "qcow2", "-F", "qcow2", "-b", base[-1], str(tmp)])
                os.replace(tmp, dest)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            state.seal_chain, state.seal_source = [*base, str(dest)], sealed
            state.save()
            t_done = time.monotonic()
            return SealedLayer(path=str(dest), layers=list(state.seal_chain), size_bytes=dest.stat().st_blocks * 512,
                               timings={"sync_ms": (t_sync - t0) * 1e3, "pause_ms": (t_switch - t_sync) * 1e3,
                                        "copy_ms": (t_done - t_switch) * 1e3, "total_ms": (t_done - t0) * 1e3})

    def prepare_restores(self, manifest: SnapshotManifest) -> None:
        """Readies what a restore of this booted template copies (its RAM file, made ahead)."""
        if manifest.memory_file:
            self.warm_ram.prepare(Path(manifest.memory_file))

    def restore(self, manifest: SnapshotManifest, spec: BootSpec, template: bool = False) -> VMInfo:
        # A template's RAM is copied into the sandbox's own share=on file (see _restore_locked).
        return self._restore(manifest, spec, capture_ref="", own_ram=template)

    def _restore(self, manifest: SnapshotManifest, spec: BootSpec, capture_ref: str,
                 own_ram: bool = False) -> VMInfo:
        sid = spec.sandbox_id
        if not valid_sandbox_id(sid):
            raise VMError(f"invalid sandbox id {sid!r}")
        m = manifest.machine
        if m.get("accel") != self.accel:
            raise SnapshotUnusable(f"snapshot was taken under {m.get('accel')}, this host runs {self.accel}")
        self.check_snapshot(manifest)
        self.net.check(spec.network)
        self._check_shm(manifest.memory_mb, sid)
        with self._lock(sid) as lock:
            try:
                return self._restore_locked(manifest, spec, capture_ref, own_ram)
            except BaseException:
                lock.discard()
                raise

    def _restore_locked(self, manifest: SnapshotManifest, spec: BootSpec, capture_ref: str, own_ram: bool) -> VMInfo:
        """own_ram=False: RAM is MAP_PRIVATE over the snapshot's file (copy-on-write, page cache
        shared between restores; but the VM's own later pause/snapshot must carry its whole RAM in
        the migration stream). own_ram=True: the snapshot's RAM is first copied (sparse) into
        the sandbox's own share=on file, exactly like a booted VM's, so every later verb stays on
        the cheap device-state-only path (used for template snapshots)."""
        m = manifest.machine
        sid = spec.sandbox_id
        state_dir = self.sandboxes_dir / sid
        if state_dir.exists():
            raise VMError(f"sandbox {sid} already exists ({state_dir})")
        t0 = time.monotonic()
        paths = VMPaths.for_sandbox(state_dir, sid, self.shm_dir)
        copy = None
        network = None
        try:
            warm = own_ram and self.warm_ram.take(Path(manifest.memory_file), paths.ram)
            if own_ram and not warm:  # copied in the background while the disk is made and QEMU starts
                copy = ramfile.RamCopy(Path(manifest.memory_file), paths.ram, manifest.memory_mb << 20,
                                       copier=self.lazy_ram_copier)
            network = self.net.attach(sid, state_dir, spec.network)
            state_dir.mkdir(parents=True, exist_ok=True)
            create_top(self.tops_dir, manifest.layers[-1], manifest.disk_size_mb, paths.top)
            t_disk = time.monotonic()
            state = VMState(sandbox_id=sid, pid=0, accel=m["accel"], host_address=network.host_address,
                            host_port=network.host_port(ENVD_PORT),
                            forwards=other_forwards(network),
                            state_dir=str(state_dir), top=str(paths.top), qmp=str(paths.qmp),
                            console=str(paths.console), pidfile=str(paths.pidfile),
                            ram=str(paths.ram) if own_ram else manifest.memory_file,
                            image=m.get("image", "base"), image_dir=m.get("image_dir", ""), kernel=m["kernel"],
                            initrd=m["initrd"], rootfs=manifest.layers[0], tools=m["tools"],
                            cpu_count=manifest.cpu_count, memory_mb=manifest.memory_mb,
                            disk_size_mb=manifest.disk_size_mb, argv=[], created_at=time.time(),
                            tsc_khz=m["tsc_khz"], resize=m["resize"], qemu=m["qemu"], ram_share=own_ram,
                            ram_owned=own_ram, chain=list(manifest.layers), capture_ref=capture_ref,
                            net_mode=network.backend, net_slot=network.slot or 0, network=spec.network.to_json())
            timings = self._spawn_incoming(state, Path(manifest.device_state_file),
                                           before_incoming=copy.wait if copy else None)
        except BaseException:
            if copy is not None:
                copy.wait(raise_error=False)
            self._cleanup(state_dir, paths, unlink_ram=own_ram)
            if network is not None:
                self.net.detach(network, state_dir)
            raise
        if copy is not None:
            timings["ram_copy_ms"] = copy.elapsed_ms
            timings["ram_copy_wait_ms"] = copy.waited_ms
            timings["ram_copy_readers"] = copy.readers
            timings["ram_copy_daemon"] = 1 if copy.how == "daemon" else 0
        if own_ram:
            timings["ram_ready_made"] = 1 if warm else 0
            self.warm_ram.refill_later(Path(manifest.memory_file))  # for the next create, now that this one runs
        timings = {"disk_ms": (t_disk - t0) * 1e3, **timings, "total_ms": (time.monotonic() - t0) * 1e3}
        state.timings = timings  # its status: RUNNING since its record was made
        state.save()
        return self._to_info(state)

    def fork(self, sandbox_id: str, count: int, child_ids: list[str] | None = None) -> list[VMInfo | Exception]:
        if count < 1:
            raise VMError("fork count must be >= 1")
        tag = uuid.uuid4().hex[:6]
        ids = child_ids or [f"{sandbox_id[:48]}-f{tag}-{i}" for i in range(count)]
        if len(ids) != count or len(set(ids)) != count:
            raise VMError("child_ids must be `count` distinct ids")
        parent = self._load(sandbox_id)
        network = NetworkSpec.from_json(parent.network)  # children inherit the parent's policy
        capture = (self.home / "forks" / f"{sandbox_id}-{tag}").absolute()
        capture_ram = self.shm_dir / f"aenv-fork-{sandbox_id}-{tag}.ram"
        t0 = time.monotonic()
        try:
            manifest = self._snapshot(sandbox_id, capture, memory_file=capture_ram)
        except BaseException:
            shutil.rmtree(capture, ignore_errors=True)
            capture_ram.unlink(missing_ok=True)
            raise
        t_cap = time.monotonic()

        def child(cid: str) -> VMInfo:
            info = self._restore(manifest, BootSpec(cid, network=network), capture_ref=str(capture))
            info.timings.update({f"capture.{k}": v for k, v in manifest.timings.items()})
            return info

        with ThreadPoolExecutor(max_workers=min(count, 16)) as pool:
            futures = [pool.submit(child, cid) for cid in ids]
            results: list[VMInfo | Exception] = []
            for f in futures:
                exc = f.exception()
                results.append(exc if exc is not None else f.result())
        t_all = time.monotonic()
        for r in results:
            if isinstance(r, VMInfo):
                r.timings["fork_all_ready_ms"] = (t_all - t0) * 1e3
                r.timings["fork_capture_ms"] = (t_cap - t0) * 1e3
        self._release_capture(capture)  # gone at once if every child failed
        return results


    def _release_capture(self, capture: Path) -> None:
        """Deletes a fork capture once no sandbox state dir refers to it any more."""
        for d in self.sandboxes_dir.iterdir() if self.sandboxes_dir.exists() else []:
            other = VMState.load(d)
            if other is not None and other.capture_ref == str(capture):
                return
        try:  # the capture's RAM copy lives on /dev/shm, outside the capture dir
            memory = Path(SnapshotManifest.load(capture).memory_file)
            if capture not in memory.parents:
                memory.unlink(missing_ok=True)
        except (OSError, ValueError, TypeError):
            pass
        shutil.rmtree(capture, ignore_errors=True)

    # -- queries ----------------------------------------------------------------------------


def _copy_chain(chain: list[str], dest: Path, with_base: bool) -> list[str]:
    """The disk layers above ``chain[0]`` copied into ``dest`` (sparse), each re-pointed at the
    one below; ``with_base``: the base too (a hard link where it can be, a copy otherwise)."""
    layers = [chain[0]]
    if with_base:  # read-only: a hard link shares it at no cost (a copy across file systems)
        base = dest / "base.qcow2"
        try:
            os.link(chain[0], base)
        except OSError:
            run(["cp", "--sparse=always", chain[0], str(base)])
        layers = [str(base)]
    for i, layer in enumerate(chain[1:]):
        copy = dest / f"layer-{i}.qcow2"
        run(["cp", "--sparse=always", layer, str(copy)])
        run(["qemu-img", "rebase", "-u", "-f", "qcow2", "-F", "qcow2", "-b", layers[-1], str(copy)])
        layers.append(str(copy))
    return layers
