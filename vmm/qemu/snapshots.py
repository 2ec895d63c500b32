"""QEMU driver, snapshot half: snapshot (a brief stop: new disk top, device state, RAM copy),
restore (a destination QEMU over the snapshot's files, copy-on-write RAM or, for booted
templates, a RAM copy of its own) and fork (one capture, N restores); fork captures are the
driver's and go with their last child.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import subprocess
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from vmm.driver import BootSpec, HostDiskFull, SealedLayer, SnapshotManifest, SnapshotUnusable, VMError, VMInfo
from vmm.net import ENVD_PORT, NetworkSpec
from vmm.qemu import disk_chain, live_capture, ramfile, uffd
from vmm.qemu.cmdline import VMPaths
from vmm.qemu.lifecycle import disk_full
from vmm.qemu.process import qemu_version, run
from vmm.qemu.qmp import QMP, QMPError, migrate_to_file
from vmm.qemu.state import VMState, other_forwards, valid_sandbox_id
from vmm.qemu.tops import create_top
from vmm.vm_status import VmLifecycle

log = logging.getLogger(__name__)


class SnapshotMixin:
    """snapshot / restore / fork of QemuDriver (needs its _lock, _load, _paths, _cleanup,
    _spawn_incoming, _guest_sync, _to_info, fingerprint, check_snapshot)."""

    # How a memory capture stops the guest (_capture_how): "auto", "background" or "stop-copy".
    capture_mode = os.environ.get("AENV_CAPTURE_MODE", "auto")
    # What a create from a booted template does with the template's RAM (restore(template=True)):
    # "copy" (its own share=on file: later pauses and snapshots save only the device state),
    # "shared" (copy-on-write over the template's file: a sandbox owns only the pages it writes,
    # more idle sandboxes per node, but its pauses and snapshots carry its whole RAM), or "auto":
    # "copy", except while the template's memory is still arriving on this node (a lazily
    # filled file, and no ready-made copy yet): then "shared" for that create, so it waits for
    # the pages its guest touches and not for the whole copy (issue 24), and a copy is made in
    # the background for the creates after it.
    template_ram = os.environ.get("AENV_TEMPLATE_RAM", "auto")
    TEMPLATE_RAM_WAYS = ("auto", "copy", "shared")
    # How many sealed layers of its own a VM's disk chain may hold before a snapshot streams
    # them into the top (vmm.qemu.disk_chain): each one costs every later capture a copy.
    max_disk_layers = int(os.environ.get("AENV_MAX_DISK_LAYERS", "16"))
    chain_stream_timeout = float(os.environ.get("AENV_CHAIN_STREAM_TIMEOUT", "600"))

    def snapshot(self, sandbox_id: str, dest_dir: Path, memory: bool = True,
                 with_base: bool = False) -> SnapshotManifest:
        return self._snapshot(sandbox_id, dest_dir, memory=memory, with_base=with_base)

    def _snapshot(self, sandbox_id: str, dest_dir: Path, memory_file: Path | None = None,
                  memory: bool = True, with_base: bool = False, for_fork: bool = False) -> SnapshotManifest:
        """memory_file: where the RAM copy goes (default dest_dir/memory.ram); fork captures put
        it on /dev/shm, where the copy is a page-cache-speed memcpy and children map it.
        memory=False: the guest syncs first and only the disk layers are captured (no device
        state, no RAM copy: a pause of a few ms); the manifest's memory and device state
        files are "" and sandboxes start from it with BootSpec(layers=manifest.layers).
        for_fork: a fork's capture (see _capture_how: "auto" captures those stopped)."""
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
            t0 = time.monotonic()
            with QMP(paths.qmp, timeout=30.0) as q:
                was_running = q.execute("query-status").get("status") == "running" and not resumed_for_sync
                how = self._capture_how(state, was_running, for_fork) if memory else "disk-only"
                timings = None
                if how in ("background", "pre-copy"):
                    try:
                        timings = self._capture_live(q, state, paths, was_running, ram_copy, device_state, how)
                    except live_capture.CaptureRefused as e:  # nothing touched yet: today's way
                        log.warning("sandbox %s: background capture refused, stop-and-copy instead: %s",
                                    sandbox_id, e)
                        how = "stop-copy"
                if timings is None:
                    timings = self._capture_stopped(q, state, paths, was_running, ram_copy, device_state, memory)
                t_cont = time.monotonic()
            log.info("sandbox %s: %s capture, vCPUs stopped %.1f ms", sandbox_id, how, timings["pause_ms"])
            # Outside the pause: copy the sealed layers (immutable now) so the snapshot dir does
            # not depend on the sandbox, and point each copy at the previous one.
            layers = _copy_chain(state.chain, dest, with_base)
            t_copied = time.monotonic()
            own = _own_layers(state)
            if len(own) > self.max_disk_layers:
                self._shorten_chain(state, paths, own)
            t_done = time.monotonic()
            timings.update({"chain_stream_ms": (t_done - t_copied) * 1e3,
                            "capture_background": 1.0 if how == "background" else 0.0,
                            "capture_precopy": 1.0 if how == "pre-copy" else 0.0,
                            "layers_copy_ms": (t_copied - t_cont) * 1e3, "total_ms": (t_done - t0) * 1e3})
            manifest = self._manifest(state, dest, layers, str(ram_copy) if memory else "",
                                      str(device_state) if memory else "", timings)
            state.timings.update({f"snapshot.{k}": v for k, v in timings.items()})
            state.save()
            return manifest

    def _shorten_chain(self, state: VMState, paths: VMPaths, dropped: list[str]) -> None:
        """The sandbox's own sealed layers streamed into the running top (vmm.qemu.disk_chain),
        down to the last layer it inherited (its image, or the snapshot it was restored from:
        those are shared, and a template's may hold gigabytes a stream would copy into every
        sandbox); the state then names the inherited layers alone under the top, and the
        streamed files are deleted. A stream that fails leaves the chain as it was: the
        snapshot already holds its copy, so it only logs. ``dropped``: its own layers
        (``_own_layers``), the top of its chain."""
        keep = len(state.chain) - len(dropped)
        try:
            with QMP(paths.qmp, timeout=30.0) as q:
                disk_chain.stream_into_top(q, state.top_node, state.chain[keep - 1], self.chain_stream_timeout)
        except (VMError, OSError) as e:
            log.warning("sandbox %s: its %d disk layers stay as they are: %s", state.sandbox_id, len(dropped), e)
            return
        state.chain = state.chain[:keep]
        state.save()
        for layer in dropped:
            Path(layer).unlink(missing_ok=True)
        log.info("sandbox %s: %d disk layers streamed into its top", state.sandbox_id, len(dropped))

    def _capture_how(self, state: VMState, running: bool = True, for_fork: bool = False) -> str:
        """How a memory capture stops the guest (capture_mode, AENV_CAPTURE_MODE; see
        vmm.qemu.live_capture): "background" (QEMU's background-snapshot: userfaultfd
        write-protect, where the kernel catches a write to a protected tmpfs page,
        vmm.qemu.uffd), "pre-copy" (RAM copied while the guest runs; only where QEMU's dirty
        tracking is sound: KVM, or TCG from QEMU 9.0 on) or "stop-copy" (the vCPUs stop while
        the whole RAM is copied). "auto": pre-copy, else background, else stop-copy; a way that
        cannot work here falls back the same way, with a warning. Pre-copy first: its stop is
        the dirty rest plus the device state (a 2 GiB guest under QEMU 10.0: 9-13 ms), while
        background-snapshot still reads and write-protects every page inside its stop (81-130 ms;
        docs/benchmarks.md, "QEMU 10.0"). A copy-on-write VM is captured
        stopped: live, its RAM would stream straight into the device state, a path no VM test
        covers yet. A VM that is not running
        (paused in memory) has no pause to shorten: stop-and-copy, which also leaves QEMU as it
        was (a finished migration would leave its disks handed over until a cont).
        A fork under "auto" is captured stopped too: a live capture streams the RAM through a
        second QEMU, which made a 256 MiB fork's whole call 2-3x longer here (1.8-2.5 s against
        0.8 s, bench/capture_window.py), and a rollout batch waits for its children, not for the
        parent's window; "background" asks for it on forks as well."""
        mode = self.capture_mode
        if mode not in live_capture.MODES:
            raise VMError(f"capture mode {mode!r} is none of {', '.join(live_capture.MODES)}")
        if not running or mode == "stop-copy" or (for_fork and mode == "auto"):
            return "stop-copy"
        background = uffd.tmpfs_write_protect(self.shm_dir)
        precopy = live_capture.precopy_safe(state.accel, self._qemu_version(state))
        if not state.ram_share:  # copy-on-write RAM (a fork child, a restored snapshot): see below
            return "stop-copy"
        if mode == "background" and background or mode == "pre-copy" and precopy:
            return mode
        how = "pre-copy" if precopy and mode == "auto" else "background" if background else "stop-copy"
        if mode != "auto":
            log.warning("sandbox %s: capture mode %s cannot work here (%s), %s instead", state.sandbox_id, mode,
                        "QEMU's dirty tracking under TCG loses writes before QEMU 9.0" if mode == "pre-copy"
                        else "the kernel does not write-protect tmpfs pages", how)
        return how

    def _qemu_version(self, state: VMState | None = None, *, required: bool = False) -> str:
        """The --version line of the VM's QEMU (or this driver's, without a VM): "" when it
        cannot be asked, a VMError instead when ``required`` (a fingerprint must name it)."""
        qemu = (state.qemu if state is not None else "") or self.qemu
        try:
            return qemu_version(qemu)
        except (OSError, subprocess.SubprocessError) as e:
            if required:
                raise VMError(f"cannot run {qemu} --version: {e}") from None
            return ""

    def _capture_stopped(self, q: QMP, state: VMState, paths: VMPaths, was_running: bool, ram_copy: Path,
                         device_state: Path, memory: bool) -> dict:
        """Stop, new disk top, device state, RAM copy (share=on RAM: the file; copy-on-write
        RAM is in the device state), cont."""
        prepared = self._prepare_top(q, state, paths)
        del q.events[:]
        t0 = time.monotonic()
        try:
            q.execute("stop")
        except BaseException:
            self._drop_top(q, state, paths, prepared)
            raise
        t_stop = time.monotonic()
        try:
            self._switch_top(q, state, paths, prepared)
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
        return {"stop_ms": (t_stop - t0) * 1e3, "disk_ms": (t_disk - t_stop) * 1e3,
                "device_ms": (t_dev - t_disk) * 1e3, "memory_copy_ms": (t_mem - t_dev) * 1e3,
                "pause_ms": _stopped(q, t_cont - t0, was_running), "pause_wall_ms": (t_cont - t0) * 1e3}

    def _capture_live(self, q: QMP, state: VMState, paths: VMPaths, was_running: bool, ram_copy: Path,
                      device_state: Path, how: str = "background") -> dict:
        """The live captures (vmm.qemu.live_capture), the same files as _capture_stopped.
        background: the vCPUs stopped for the disk switch, the device state and the
        write-protect; pre-copy: RAM copied while the guest runs, the vCPUs stopped (by QEMU)
        for the disk switch, the last dirty pages and the device state. Raises CaptureRefused
        (nothing changed) when QEMU or the vessel refuses before the stop."""
        t0 = time.monotonic()
        cow = not state.ram_share
        precopy = how == "pre-copy"
        vessel = None
        prefilled = 0
        # The vessel's RAM is on tmpfs even for a snapshot kept on disk (moved there after): a
        # guest write waits for its page to be in the stream, and the stream for the vessel.
        vessel_ram = ram_copy if _same_fs(ram_copy.parent, self.shm_dir) else (
            self.shm_dir / f"aenv-capture-{state.sandbox_id}-{uuid.uuid4().hex[:8]}.ram")
        if not cow:  # the vessel's loader reads (on tmpfs: allocates) every page before the punch
            free = shutil.disk_usage(vessel_ram.parent).free
            if free < state.memory_mb << 20:
                raise live_capture.CaptureRefused(f"{vessel_ram.parent} has {free >> 20} MiB free, less than the "
                                                  f"guest's {state.memory_mb} MiB")
        try:
            if not cow and not precopy:  # QEMU's populate inside the stop then maps pages only
                prefilled = live_capture.prefill(Path(state.ram))
            t_prefilled = time.monotonic()
            if not cow:  # the stream is loaded into ram_copy by a vessel QEMU
                work = Path(tempfile.mkdtemp(prefix="capture-", dir=paths.state_dir))
                argv = live_capture.vessel_argv(self._argv(state, incoming=True), ram=vessel_ram,
                                                qmp=work / "qmp.sock", console=work / "console.log",
                                                disk_bytes=state.disk_size_mb << 20,
                                                tools_bytes=Path(state.tools).stat().st_size)
                vessel = live_capture.Vessel(argv, work, netns=state.net_mode == "netns")
                vessel.start_incoming()
            t_ready = time.monotonic()
            if precopy:  # copy-on-write RAM is not shared: in the stream with x-ignore-shared on
                live_capture.set_precopy(q, True, ignore_shared=cow)
            else:
                live_capture.set_background(q, True, ignore_shared=cow)
        except live_capture.CaptureRefused:
            if vessel is not None:
                vessel.close()
            _drop(vessel_ram, ram_copy)
            raise
        except (VMError, OSError) as e:
            if vessel is not None:
                vessel.close()
            _drop(vessel_ram, ram_copy)
            try:
                live_capture.set_precopy(q, False) if precopy else None
            except QMPError:
                pass
            raise live_capture.CaptureRefused(f"capture vessel: {e}") from e
        uri = f"unix:{vessel.sock}" if vessel else f"exec:cat > {shlex.quote(str(device_state))}"
        try:
            prepared = self._prepare_top(q, state, paths)
        except BaseException:
            live_capture.set_precopy(q, False) if precopy else live_capture.set_background(q, False, True)
            if vessel is not None:
                vessel.close()
            _drop(vessel_ram, ram_copy)
            raise
        switched = False
        del q.events[:]
        who, rest = "", 0
        try:
            if precopy:
                t_copy0 = time.monotonic()
                q.execute("migrate", uri=uri)
                who, rest = live_capture.wait_switchover(q)
                t_stop0 = t_stop = time.monotonic()  # QEMU stopped it (STOP event: stopped_ms below)
                try:
                    self._switch_top(q, state, paths, prepared)
                    switched = True
                    t_disk = time.monotonic()
                    q.execute("migrate-continue", state="pre-switchover")
                    done = live_capture.wait_completed(q, timeout=60.0, poll=0.0005)  # the guest waits
                    t_armed = time.monotonic()
                finally:
                    if was_running:
                        q.execute("cont")
                t_cont = t_streamed = time.monotonic()
            else:
                t_stop0 = time.monotonic()
                q.execute("stop")
                t_stop = time.monotonic()
                try:
                    self._switch_top(q, state, paths, prepared)
                    switched = True
                    t_disk = time.monotonic()
                    q.execute("migrate", uri=uri)
                    live_capture.wait_armed(q)
                    t_armed = time.monotonic()
                finally:
                    if was_running:
                        q.execute("cont")
                t_cont = time.monotonic()
                done = live_capture.wait_completed(q)
                t_streamed = time.monotonic()
            if vessel is not None:
                vessel.wait_loaded()
                t_loaded = time.monotonic()
                vessel.save_device_state(device_state)
            t_saved = time.monotonic()
        except BaseException:
            try:  # a migration still running would keep write-protecting the guest's RAM
                q.execute("migrate_cancel")
                if was_running and q.execute("query-status").get("status") != "running":
                    q.execute("cont")
            except (QMPError, OSError):
                pass
            if not switched:
                self._drop_top(q, state, paths, prepared)
            _drop(vessel_ram, ram_copy)
            raise
        finally:
            try:
                if precopy:
                    live_capture.set_precopy(q, False)
                else:
                    live_capture.set_background(q, False, ignore_shared=True)
            except QMPError as e:  # still migrating (cancelled above): the next capture sets it again
                log.warning("sandbox %s: resetting the capture capabilities: %s", state.sandbox_id, e)
            if vessel is not None:
                vessel.close()
        timings = {"prefill_ms": (t_prefilled - t0) * 1e3, "prefill_mb": prefilled / 2**20,
                   "vessel_ms": (t_ready - t_prefilled) * 1e3, "stop_ms": (t_stop - t_stop0) * 1e3,
                   "disk_ms": (t_disk - t_stop) * 1e3, "device_ms": (t_armed - t_disk) * 1e3,
                   "memory_copy_ms": (t_streamed - t_cont) * 1e3,
                   "pause_ms": _stopped(q, t_cont - t_stop0, was_running), "pause_wall_ms": (t_cont - t_stop0) * 1e3,
                   "qemu_downtime_ms": float(done.get("downtime", 0)),
                   "qemu_setup_ms": float(done.get("setup-time", 0))}
        if precopy:
            timings.update({"precopy_ms": (t_stop - t_copy0) * 1e3,
                            "precopy_stopped_by_driver": 0.0 if who == "qemu" else 1.0,
                            "precopy_timed_out": 1.0 if who == "timeout" else 0.0,
                            "precopy_rest_mb": rest / 2**20,
                            "precopy_dirty_syncs": float((done.get("ram") or {}).get("dirty-sync-count", 0))})
        if vessel is not None:
            t_punch = time.monotonic()
            try:
                freed = ramfile.punch_zero_pages(vessel_ram)
                t_move = time.monotonic()
                if vessel_ram != ram_copy:
                    _move_sparse(vessel_ram, ram_copy)
            finally:
                if vessel_ram != ram_copy:
                    vessel_ram.unlink(missing_ok=True)
            timings.update({"vessel_load_ms": (t_loaded - t_streamed) * 1e3,
                            "device_save_ms": (t_saved - t_loaded) * 1e3,
                            "punch_ms": (t_move - t_punch) * 1e3, "punched_mb": freed / 2**20,
                            "move_ms": (time.monotonic() - t_move) * 1e3})
        return timings

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
    def _prepare_top(q: QMP, state: VMState, paths: VMPaths) -> str:
        """While the VM runs: the next ``top-N.qcow2`` made (over the current top, without
        opening it) and opened in QEMU without a backing, so the switch inside the stop is
        only a graph change (blockdev-snapshot), not a file created and opened (~10 ms).
        Returns its node name; _drop_top undoes it."""
        gen = state.generation + 1
        new_top = paths.state_dir / f"top-{gen}.qcow2"
        node = f"top{gen}"
        new_top.unlink(missing_ok=True)
        run(["qemu-img", "create", "-q", "-f", "qcow2", "-u", "-b", state.top, "-F", "qcow2", str(new_top),
             f"{state.disk_size_mb}M"])
        try:
            q.execute("blockdev-add", **{"driver": "qcow2", "node-name": node, "backing": None,
                                         "file": {"driver": "file", "node-name": f"{node}file",
                                                  "filename": str(new_top)}})
        except BaseException:
            new_top.unlink(missing_ok=True)
            raise
        return node

    @staticmethod
    def _drop_top(q: QMP, state: VMState, paths: VMPaths, node: str) -> None:
        """A prepared top that was not switched to (the capture failed before its stop)."""
        try:
            q.execute("blockdev-del", **{"node-name": node})
        except (QMPError, OSError):
            pass
        (paths.state_dir / f"top-{state.generation + 1}.qcow2").unlink(missing_ok=True)

    @staticmethod
    def _switch_top(q: QMP, state: VMState, paths: VMPaths, prepared: str | None = None) -> str:
        """With the VM stopped: seals its current top (read-only from now on, owned by the
        sandbox) and continues on a new empty ``top-N.qcow2`` over it (``prepared``: the node
        of _prepare_top, else made here). Returns the sealed file."""
        gen = state.generation + 1
        new_top = paths.state_dir / f"top-{gen}.qcow2"
        node = f"top{gen}"
        if prepared:
            q.execute("blockdev-snapshot", node=state.top_node, overlay=prepared)
        else:
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

    def check_template_ram(self) -> None:
        if self.template_ram not in self.TEMPLATE_RAM_WAYS:
            raise VMError(f"AENV_TEMPLATE_RAM={self.template_ram!r} is none of {', '.join(self.TEMPLATE_RAM_WAYS)}")

    def restore(self, manifest: SnapshotManifest, spec: BootSpec, template: bool = False,
                source_stays: bool = False) -> VMInfo:
        # A template's RAM is copied into the sandbox's own share=on file (see _restore_locked),
        # unless template_ram says "shared" (or "auto" while it is still arriving, see above).
        self.check_template_ram()
        return self._restore(manifest, spec, capture_ref="", own_ram=template and self.template_ram != "shared",
                             source_stays=source_stays)

    def _restore(self, manifest: SnapshotManifest, spec: BootSpec, capture_ref: str,
                 own_ram: bool = False, source_stays: bool = False) -> VMInfo:
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
                return self._restore_locked(manifest, spec, capture_ref, own_ram, source_stays)
            except BaseException as exc:
                lock.discard()
                full = disk_full(exc, self.sandboxes_dir)
                if full:  # nothing of it is left; a cold boot would not find room either
                    raise HostDiskFull(f"sandbox {sid}: not started, no room on the node's disk ({full})") from exc
                raise

    def _restore_locked(self, manifest: SnapshotManifest, spec: BootSpec, capture_ref: str, own_ram: bool,
                        source_stays: bool = False) -> VMInfo:
        """own_ram=False: RAM is MAP_PRIVATE over the snapshot's file (copy-on-write, page cache
        shared between restores; but the VM's own later pause/snapshot must carry its whole RAM in
        the migration stream). own_ram=True: the snapshot's RAM is first copied (sparse) into
        the sandbox's own share=on file, exactly like a booted VM's, so every later verb stays on
        the cheap device-state-only path (used for template snapshots). source_stays (a
        template's): a ready-made copy is taken when there is one and another made for the next
        restore once this VM runs; with none and the snapshot's RAM on a lazily filled file
        (template_ram "auto"), the RAM is mapped instead (own_ram=False) rather than waited for."""
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
            reused = own_ram and source_stays  # a copy for the next create is worth making
            warm = reused and self.warm_ram.take(Path(manifest.memory_file), paths.ram)
            mapped_arriving = (reused and not warm and self.template_ram == "auto"
                               and ramfile.on_fuse(manifest.memory_file))
            if mapped_arriving:  # the guest waits for the pages it touches, not for the whole copy
                own_ram = False
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
        if reused:
            timings["ram_ready_made"] = 1 if warm else 0
            timings["ram_mapped_arriving"] = 1 if mapped_arriving else 0
            self.warm_ram.refill_later(Path(manifest.memory_file))  # for the next create, now that this one runs
        timings = {"disk_ms": (t_disk - t0) * 1e3, **timings, "total_ms": (time.monotonic() - t0) * 1e3}
        state.timings = timings  # its status: RUNNING since its record was made
        try:
            state.save()  # its pid: without it no verb finds the VM, so it must not outlive a failure here
        except BaseException:
            self._cleanup(state_dir, paths, unlink_ram=own_ram)
            self.net.detach(network, state_dir)
            raise
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
            manifest = self._snapshot(sandbox_id, capture, memory_file=capture_ram, for_fork=True)
        except BaseException as exc:
            full = disk_full(exc, capture.parent)  # before the partial capture frees room
            shutil.rmtree(capture, ignore_errors=True)
            capture_ram.unlink(missing_ok=True)
            if full:  # the capture's failure left the parent as it was (as for any other cause)
                raise HostDiskFull(f"sandbox {sandbox_id}: not forked, no room on the node's disk for the "
                                   f"capture ({full})") from exc
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


def _same_fs(a: Path, b: Path) -> bool:
    try:
        return os.stat(a).st_dev == os.stat(b).st_dev
    except OSError:
        return False


def _drop(vessel_ram: Path, ram_copy: Path) -> None:
    """A failed capture's vessel RAM file on tmpfs (the caller removes ram_copy)."""
    if vessel_ram != ram_copy:
        vessel_ram.unlink(missing_ok=True)


def _move_sparse(src: Path, dest: Path) -> None:
    """``src`` (tmpfs) copied, holes kept, into the new file ``dest`` on another file system."""
    fd = os.open(dest, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        os.ftruncate(fd, src.stat().st_size)
        ramfile.copy_sparse_into(src, fd)
    except BaseException:
        os.close(fd)
        dest.unlink(missing_ok=True)
        raise
    os.close(fd)


def _stopped(q: QMP, wall_s: float, was_running: bool) -> float:
    """The parent's vCPU stop in ms: QEMU's STOP to RESUME events where it ran before (QEMU
    stops it itself in a pre-copy), else the driver's own clock around its stop and cont."""
    ms = live_capture.stopped_ms(q.events) if was_running else None
    return ms if ms is not None else wall_s * 1e3


def _own_layers(state: VMState) -> list[str]:
    """The sealed layers at the top of the chain that the sandbox made (its state dir holds
    them), above every layer it inherited; never the chain's first (its image or snapshot base)."""
    own = Path(state.state_dir)
    layers = []
    for layer in reversed(state.chain[1:]):
        if Path(layer).parent != own:
            break
        layers.append(layer)
    return layers[::-1]


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
