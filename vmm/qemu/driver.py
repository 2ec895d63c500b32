"""QEMU driver core: construction, accelerator and fingerprint, cold boot, kill, queries.

The lifecycle verbs (vmm.qemu.lifecycle), a paused VM's memory moving to disk and back
(vmm.qemu.ram_moves) and snapshot / restore / fork (vmm.qemu.snapshots) are mixed into
QemuDriver from their own modules; see the package docstring for the why.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from vmm import hostinfo
from vmm.driver import (BootSpec, BootTimeout, HostDiskFull, HostMemoryFull, SnapshotManifest, SnapshotUnusable, VMDriver,
                        VMError, VMInfo, VMNotFound)
from vmm.hostinfo import kvm_openable
from vmm.images import find_image
from vmm.locks import LockTimeout, vm_lock
from vmm.net import ENVD_PORT, Attachment, NetworkSpec, choose_backend, ports, slots
from vmm.net.spec import DEFAULT_WARM_SLOTS
from vmm.qemu import console, ramfile
from vmm.qemu.accel import detect_accel
from vmm.qemu.cmdline import QEMU, VMPaths, qemu_command
from vmm.qemu.host import HostMixin
from vmm.qemu.iolimits import DiskLimits
from vmm.qemu.lifecycle import LifecycleMixin, disk_full
from vmm.qemu.process import (DEFAULT_BOOT_TIMEOUT, BootAttemptFailed, attempts_error, cmdline_digest,
                              console_tail, envd_healthy, release_mismatch, run,
                              virtual_size_mb)
from vmm.qemu.qmp import QMP, QMPError, prepare_migration
from vmm.qemu.ram_moves import RamMovesMixin
from vmm.qemu.snapshots import SnapshotMixin
from vmm.qemu.tops import create_top
from vmm.qemu.warm_ram import WarmRamCopies
from vmm.qemu.state import VMState, other_forwards, process_alive, read_pidfile, reap, valid_sandbox_id

DEFAULT_SHM_HEADROOM_MB = 1024  # tmpfs kept free for running guests' RAM to grow into
DEFAULT_WARM_RAM_COPIES = 1  # ready RAM files per recently used booted template

log = logging.getLogger(__name__)


class QemuDriver(LifecycleMixin, RamMovesMixin, SnapshotMixin, HostMixin, VMDriver):
    name = "qemu"

    def __init__(self, home: Path, images_dir: Path, host_address: str = "127.0.0.1",
                 boot_timeout: float = DEFAULT_BOOT_TIMEOUT, qemu: str = QEMU, shm_dir: Path = Path("/dev/shm"),
                 port_range: tuple[int, int] = ports.PORT_RANGE, accel: str | None = None,
                 network: str | None = None, net_prefix: str | None = None, net_pool: str | None = None,
                 net_warm: int = DEFAULT_WARM_SLOTS, net_deny_extra: tuple[str, ...] = (), net_allow_extra: tuple[str, ...] = (),
                 net_ingress_from: tuple[str, ...] = (), net_limits=None, net_dns_limits=None, shm_headroom_mb: int = DEFAULT_SHM_HEADROOM_MB,
                 warm_ram_copies: int = DEFAULT_WARM_RAM_COPIES, disk_limits: DiskLimits | None = None,
                 net_egress_options: dict | None = None):
        if shutil.which(qemu) is None:
            raise VMError(f"{qemu} not found on PATH (apt-get install qemu-system-x86)")
        self.check_template_ram()  # a node with a bad setting does not start (creates would cold-boot)
        self.home = Path(home).absolute()  # QEMU -daemonize chdirs to /: every path must be absolute
        self.images_dir = Path(images_dir).resolve()  # recorded paths must not go through a symlink that may vanish
        self.sandboxes_dir = self.home / "sandboxes"
        self.sandboxes_dir.mkdir(parents=True, exist_ok=True)
        self.host_address = host_address
        self.boot_timeout = boot_timeout
        self.qemu = qemu
        self.shm_dir = Path(shm_dir)
        self.shm_headroom_mb = int(shm_headroom_mb)
        self.disk_limits = disk_limits or DiskLimits()  # every guest's root disk I/O (vmm.qemu.iolimits)
        self.port_range = port_range
        self._accel = accel
        self._accel_lock = threading.Lock()
        self.locks_dir = self.home / "locks"
        self.tops_dir = self.home / "tops"  # pristine empty overlays (vmm.qemu.tops)
        # RAM files made ahead for the next restore of a booted template (vmm.qemu.warm_ram)
        self.warm_ram = WarmRamCopies(self.shm_dir, tag=hashlib.sha256(str(self.home).encode()).hexdigest()[:8],
                                      per_source=warm_ram_copies, headroom_mb=self.shm_headroom_mb)
        self.lazy_ram_copier: ramfile.LazyCopier | None = None  # set_lazy_ram_copier
        self._spill_mutex = threading.Lock()  # paused VMs' RAM moving to disk (ram_moves._spill_later)
        self._spill_pool = None
        self._spills: list = []
        # The VMs' network (vmm.net.choose_backend): a netns slot per VM where the node can
        # make them, else restricted slirp (no egress, no host access; envd's port forwarded).
        # Unset: the environment (AENV_NETWORK / AENV_NET_PREFIX / AENV_NET_POOL, as the node's
        # settings), so every driver of one instance, test drivers included, shares its slots.
        env = os.environ.get
        network = network or env("AENV_NETWORK") or "auto"
        net_prefix = net_prefix or env("AENV_NET_PREFIX") or slots.DEFAULT_PREFIX
        net_pool = net_pool or env("AENV_NET_POOL") or slots.DEFAULT_POOL
        self.net = choose_backend(network, home=self.home, host_address=host_address,
                                  sandboxes_dir=self.sandboxes_dir, port_range=port_range, prefix=net_prefix,
                                  pool=net_pool, warm=net_warm, deny_extra=tuple(net_deny_extra),
                                  allow_extra=tuple(net_allow_extra), ingress_from=tuple(net_ingress_from),
                                  limits=net_limits, dns_limits=net_dns_limits, egress_options=net_egress_options)

    def set_lazy_ram_copier(self, copier: ramfile.LazyCopier | None) -> None:
        """Who copies a lazily filled snapshot RAM file (template and moved restores, ready-made
        copies): the node's chunkfs daemon through the agent's S3 store; None: this process."""
        self.lazy_ram_copier = copier
        self.warm_ram.copier = copier

    @contextmanager
    def _lock(self, sandbox_id: str):
        """Serializes lifecycle verbs on one sandbox across threads and processes (flock)."""
        try:
            with vm_lock(self.locks_dir, sandbox_id) as lock:
                yield lock
        except LockTimeout as e:
            raise VMError(str(e)) from None

    def _check_shm(self, memory_mb: int, sandbox_id: str) -> None:
        """Guest RAM files grow in ``shm_dir`` (tmpfs) as guests touch their memory, and a
        guest whose tmpfs fills up dies: a VM starts only while the tmpfs has room for all of
        its memory plus the headroom kept for the running ones (HostMemoryFull otherwise)."""
        free_mb = shutil.disk_usage(self.shm_dir).free >> 20
        if free_mb < memory_mb + self.shm_headroom_mb and self.warm_ram.drop_all():
            free_mb = shutil.disk_usage(self.shm_dir).free >> 20  # guests before ready-made copies
        if free_mb < memory_mb + self.shm_headroom_mb:
            raise HostMemoryFull(f"sandbox {sandbox_id}: {self.shm_dir} has {free_mb} MiB free, less than its "
                                 f"{memory_mb} MiB of memory plus the {self.shm_headroom_mb} MiB kept for the "
                                 "running guests")

    @property
    def accel(self) -> str:
        """'kvm' or 'tcg', detected once (probe boot, cached in images_dir/accel.json)."""
        with self._accel_lock:
            if self._accel is None:
                if not kvm_openable():
                    self._accel = "tcg"
                else:  # needs the guest kernel for the probe boot
                    image = find_image(self.images_dir, "base")
                    self._accel = detect_accel(self.images_dir, image.kernel, image.initrd)
            return self._accel

    def fingerprint(self) -> dict:
        """A memory snapshot restores only into the identical machine: same accelerator, same
        QEMU (device state format) and the same command line (see vmm.qemu.cmdline)."""
        return {"driver": self.name, "accel": self.accel, "qemu": self._qemu_version(required=True),
                "cmdline": cmdline_digest(), "net": self.net.name}

    def check_snapshot(self, manifest: SnapshotManifest) -> None:
        """The snapshot is QEMU's, and this host has what it needs from outside its own dir:
        the template base layer under its disk chain, the kernel, initrd and tools drive the
        device state belongs to (from the image build it was taken on, unless the snapshot
        carries them: a pause image, or a download whose node's build differs)."""
        taken_by = (manifest.fingerprint or {}).get("driver", self.name)
        if taken_by != self.name:
            raise SnapshotUnusable(f"snapshot was taken by the {taken_by} driver; this host runs {self.name}")
        taken_with = (manifest.fingerprint or {}).get("qemu", "")
        why = release_mismatch(taken_with, self._qemu_version(required=True)) if taken_with else ""
        if why:  # QEMU would only say "load of migration failed" after starting (issue 26's QEMU 10 move)
            raise SnapshotUnusable(f"snapshot cannot be restored on this node: {why}; take it again on a node "
                                   "with this QEMU (booted templates are rebuilt by themselves: their key holds "
                                   "the QEMU version)")
        taken_on = (manifest.fingerprint or {}).get("net", "slirp")
        if taken_on != self.net.name:  # the guest configured its network for the other one
            raise SnapshotUnusable(f"snapshot was taken on the {taken_on} network; this node runs {self.net.name} "
                                   "(a guest keeps the addresses it booted with)")
        machine = manifest.machine or {}
        base = manifest.layers[0] if manifest.layers else ""
        needed = [("template base layer", base)] + [
            (what, machine.get(key) or "") for what, key in
            (("guest kernel", "kernel"), ("initrd", "initrd"), ("tools drive", "tools"))]
        for what, path in needed:
            if path and Path(path).parent == Path(manifest.dir):  # carried by the snapshot itself
                continue
            if not path or not Path(path).is_file():
                build = Path(machine.get("image_dir") or "").name or "unknown"
                raise SnapshotUnusable(
                    f"needs its {what} {path or '(none)'} (image build {build}) which this node does not have in "
                    f"{self.images_dir}; build the same image here "
                    f"(python -m vmm.images build --name {machine.get('image') or 'base'})")

    # -- boot -------------------------------------------------------------------------------

    def boot(self, spec: BootSpec) -> VMInfo:
        if not valid_sandbox_id(spec.sandbox_id):
            raise VMError(f"invalid sandbox id {spec.sandbox_id!r}")
        self.net.check(spec.network)  # a policy the backend cannot enforce: refused before anything
        image = find_image(self.images_dir, spec.image)
        self._check_shm(spec.memory_mb, spec.sandbox_id)
        accel = self.accel
        for layer in spec.layers or ():
            if not Path(layer).is_file():
                raise VMError(f"disk layer {layer} does not exist")
        state_dir = self.sandboxes_dir / spec.sandbox_id
        with self._lock(spec.sandbox_id) as lock:
            if state_dir.exists():
                raise VMError(f"sandbox {spec.sandbox_id} already exists ({state_dir})")
            failures = []
            for attempt in (1, 2):
                try:
                    return self._boot_once(spec, image, accel, state_dir, attempt)
                except BootAttemptFailed as e:
                    failures.append(e)
                    self._cleanup(state_dir, VMPaths.for_sandbox(state_dir, spec.sandbox_id, self.shm_dir))
                except BaseException:
                    self._cleanup(state_dir, VMPaths.for_sandbox(state_dir, spec.sandbox_id, self.shm_dir))
                    lock.discard()
                    raise
            lock.discard()
        raise self._boot_failed(spec.sandbox_id, spec.memory_mb, failures)

    def _boot_failed(self, sandbox_id: str, memory_mb: int, failures: list) -> VMError:
        """The error of a boot whose attempts all failed. Guests that died while the tmpfs of
        guest RAM is short of room (what admission saw free was taken meanwhile: guests
        growing, boots at once) are HostMemoryFull, a node with no room now (503), not a
        broken boot (500). Found by the chaos bench's full tmpfs (bench/chaos.py)."""
        error = attempts_error(sandbox_id, failures)
        free_mb = shutil.disk_usage(self.shm_dir).free >> 20
        if not isinstance(error, BootTimeout) and free_mb < memory_mb + self.shm_headroom_mb:
            return HostMemoryFull(f"{error}; {self.shm_dir} has {free_mb} MiB free, less than its {memory_mb} MiB "
                                  f"of memory plus the {self.shm_headroom_mb} MiB kept for the running guests")
        return error

    def _boot_once(self, spec: BootSpec, image, accel: str, state_dir: Path, attempt: int) -> VMInfo:
        t0 = time.monotonic()
        paths = VMPaths.for_sandbox(state_dir, spec.sandbox_id, self.shm_dir)
        network = self.net.attach(spec.sandbox_id, state_dir, spec.network)
        try:
            state_dir.mkdir(parents=True, exist_ok=True)
            return self._boot_attached(spec, image, accel, state_dir, attempt, paths, network, t0)
        except BaseException:
            self._stop_process(paths)  # a QEMU holding tap0 would keep the slot's netns alive
            self.net.detach(network, state_dir)
            raise

    def _boot_attached(self, spec: BootSpec, image, accel: str, state_dir: Path, attempt: int, paths: VMPaths,
                       network: Attachment, t0: float) -> VMInfo:
        port = network.host_port(ENVD_PORT)
        chain = [str(p) for p in spec.layers] if spec.layers else [str(image.rootfs)]
        base_mb = virtual_size_mb(Path(chain[-1]))
        disk_mb = max(spec.disk_size_mb, base_mb)
        create_top(self.tops_dir, chain[-1], disk_mb, paths.top)
        t_disk = time.monotonic()
        tsc = hostinfo.tsc_khz()
        argv = qemu_command(paths=paths, kernel=image.kernel, initrd=image.initrd, tools=image.tools, accel=accel,
                            cpu_count=spec.cpu_count, memory_mb=spec.memory_mb, network=network,
                            tsc_khz=tsc, resize=disk_mb > base_mb, qemu=self.qemu)
        state = VMState(sandbox_id=spec.sandbox_id, pid=0, accel=accel, host_address=network.host_address,
                        host_port=port, forwards=other_forwards(network), state_dir=str(state_dir),
                        top=str(paths.top), qmp=str(paths.qmp),
                        console=str(paths.console), pidfile=str(paths.pidfile), ram=str(paths.ram),
                        image=spec.image, image_dir=str(image.kernel.parent), kernel=str(image.kernel),
                        initrd=str(image.initrd), rootfs=chain[0], tools=str(image.tools),
                        cpu_count=spec.cpu_count, memory_mb=spec.memory_mb, disk_size_mb=disk_mb, argv=argv,
                        created_at=time.time(), tsc_khz=tsc, resize=disk_mb > base_mb, qemu=self.qemu,
                        chain=chain, net_mode=network.backend, net_slot=network.slot or 0,
                        network=spec.network.to_json())
        state.save()  # before spawning: a crash from here on still leaves a killable record
        t_spawn, t_ready = self._spawn_cold(state, paths, attempt)
        state.timings = {"disk_ms": (t_disk - t0) * 1e3, "spawn_ms": (t_spawn - t_disk) * 1e3,
                         "envd_ms": (t_ready - t_spawn) * 1e3, "total_ms": (t_ready - t0) * 1e3,
                         "attempt": attempt}
        state.save()
        return self._to_info(state)

    def _spawn_cold(self, state: VMState, paths: VMPaths, attempt: int) -> tuple[float, float]:
        """Starts QEMU with state.argv (a cold boot of the guest kernel) and waits for envd.
        Returns (spawned, ready) monotonic times; raises BootAttemptFailed."""
        proc = subprocess.run(self._launch(state) + state.argv, capture_output=True, text=True,
                              start_new_session=True, stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            raise BootAttemptFailed(f"attempt {attempt}: qemu exited {proc.returncode}: {proc.stderr.strip()[-500:]}",
                                     console_tail(paths.console))
        pid = read_pidfile(paths.pidfile)
        if pid is None:
            raise BootAttemptFailed(f"attempt {attempt}: no pidfile", console_tail(paths.console))
        state.pid = pid
        t_spawn = time.monotonic()
        state.save()
        try:
            with QMP(paths.qmp, timeout=10.0) as q:
                self._prepare(q)
        except (QMPError, OSError) as e:
            raise BootAttemptFailed(f"attempt {attempt}: QMP setup failed: {e}", console_tail(paths.console))
        deadline = t_spawn + self.boot_timeout
        while not envd_healthy(state.host_address, state.host_port):
            if not process_alive(pid, str(paths.qmp)):
                raise BootAttemptFailed(f"attempt {attempt}: qemu died during boot", console_tail(paths.console))
            if time.monotonic() > deadline:
                raise BootAttemptFailed(f"attempt {attempt}: no /health after {self.boot_timeout:.0f}s",
                                         console_tail(paths.console), timed_out=True)
            time.sleep(0.05)
        return t_spawn, time.monotonic()

    def _prepare(self, q: QMP) -> None:
        """What every QEMU the driver starts gets over QMP right after it starts: ready for
        pause_to_disk / snapshot / fork, and its disk I/O limits."""
        prepare_migration(q)
        self.disk_limits.apply(q)

    # -- kill -------------------------------------------------------------------------------

    def kill(self, sandbox_id: str) -> bool:
        if not valid_sandbox_id(sandbox_id):
            return False
        with self._lock(sandbox_id) as lock:
            state_dir = self.sandboxes_dir / sandbox_id
            paths = VMPaths.for_sandbox(state_dir, sandbox_id, self.shm_dir)
            state = VMState.load(state_dir)
            unlink_ram = True
            if state is not None:
                paths = self._paths(state)
                unlink_ram = state.ram_owned
            existed = state_dir.exists() or (unlink_ram and paths.ram.exists())
            self._cleanup(state_dir, paths, unlink_ram=unlink_ram)
            if state is not None:
                self.net.detach(self._attachment(state), state_dir)
            lock.discard()
        if state is not None and state.capture_ref:
            self._release_capture(Path(state.capture_ref))
        return existed

    def _stop_process(self, paths: VMPaths) -> None:
        """Stops the QEMU of `paths` if it runs (QMP quit, SIGTERM, SIGKILL)."""
        pid = read_pidfile(paths.pidfile)
        marker = str(paths.qmp)
        if pid and process_alive(pid, marker):
            try:
                with QMP(paths.qmp, timeout=2.0) as q:
                    q.execute("quit")
            except (QMPError, OSError):
                pass
            for sig, wait in ((None, 2.0), (signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
                if sig is not None:
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        break
                end = time.monotonic() + wait
                while time.monotonic() < end and process_alive(pid, marker):
                    time.sleep(0.02)
                if not process_alive(pid, marker):
                    break
            reap(pid)

    def _cleanup(self, state_dir: Path, paths: VMPaths, unlink_ram: bool = True) -> None:
        """Stops the VM and deletes its state dir (top, sealed layers, device state) and, if it
        owns it, its RAM file."""
        self._stop_process(paths)
        shutil.rmtree(state_dir, ignore_errors=True)
        if unlink_ram:
            try:
                paths.ram.unlink()
            except FileNotFoundError:
                pass


    def info(self, sandbox_id: str) -> VMInfo | None:
        if not valid_sandbox_id(sandbox_id):
            return None
        state = VMState.load(self.sandboxes_dir / sandbox_id)
        if state is None:
            return None
        if state.status.offline:
            return self._to_info(state)
        if not process_alive(state.pid, state.qmp):
            return None
        return self._to_info(state)

    def console_path(self, sandbox_id: str) -> Path | None:
        state = VMState.load(self.sandboxes_dir / sandbox_id) if valid_sandbox_id(sandbox_id) else None
        return Path(state.console) if state is not None and state.console else None

    def trim_console(self, sandbox_id: str, keep_bytes: int) -> int:
        path = self.console_path(sandbox_id)
        return console.trim(path, keep_bytes) if path is not None else 0

    def list(self) -> list[VMInfo]:
        out = []
        for d in sorted(self.sandboxes_dir.iterdir()) if self.sandboxes_dir.exists() else []:
            state = VMState.load(d)
            if state is not None and (state.status.offline or process_alive(state.pid, state.qmp)):
                out.append(self._to_info(state))
        return out

    def slot_of(self, sandbox_id: str):
        """The network slot the VM runs in now (a ``vmm.net.slots.Slot``), or None (no such
        VM, paused to disk, or on the slirp fallback): where its volume server must run."""
        state = VMState.load(self.sandboxes_dir / sandbox_id) if valid_sandbox_id(sandbox_id) else None
        if state is None or state.net_mode != "netns" or not state.net_slot:
            return None
        return self.net.slot(self._attachment(state))

    # -- lifecycle --------------------------------------------------------------------------

    def _load(self, sandbox_id: str) -> VMState:
        state = VMState.load(self.sandboxes_dir / sandbox_id) if valid_sandbox_id(sandbox_id) else None
        if state is None:
            raise VMNotFound(f"unknown sandbox {sandbox_id!r}")
        if not state.status.offline and not process_alive(state.pid, state.qmp):
            raise VMError(f"sandbox {sandbox_id}: QEMU process is gone")
        return state

    @staticmethod
    def _paths(state: VMState) -> VMPaths:
        return VMPaths(state_dir=Path(state.state_dir), top=Path(state.top), qmp=Path(state.qmp),
                       console=Path(state.console), pidfile=Path(state.pidfile), ram=Path(state.ram))

    def _argv(self, state: VMState, incoming: bool) -> list[str]:
        """The command line from the recorded config only (identical for source and destination;
        in a netns it runs under ``_launch``, which is not part of it)."""
        return qemu_command(paths=QemuDriver._paths(state), kernel=Path(state.kernel), initrd=Path(state.initrd),
                            tools=Path(state.tools), accel=state.accel, cpu_count=state.cpu_count,
                            memory_mb=state.memory_mb, network=self._attachment(state),
                            tsc_khz=state.tsc_khz, resize=state.resize, qemu=state.qemu,
                            ram_share=state.ram_share, incoming=incoming)

    def _attachment(self, state: VMState) -> Attachment:
        """The VM's network from its record: slirp forwards stay with the VM; a netns VM has
        its slot while it has a process (none when paused to disk)."""
        if state.net_mode == "netns":
            if state.net_slot:
                return self.net.attachment_of(state.sandbox_id, state.net_slot)
            return Attachment("netns", state.sandbox_id, "", {})
        forwards = {ENVD_PORT: state.host_port, **{int(g): h for g, h in state.forwards.items()}}
        return Attachment("slirp", state.sandbox_id, state.host_address, forwards)

    def _launch(self, state: VMState) -> list[str]:
        """What QEMU's command line runs under: its slot's netns (nsenter), or nothing."""
        if state.net_mode == "netns":
            if not state.net_slot:
                raise VMError(f"sandbox {state.sandbox_id} has no network slot to start in")
            return self.net.launch_prefix(self._attachment(state))
        return []

    def _take_slot(self, state: VMState) -> None:
        """A netns VM about to run again (resume from disk) gets a fresh slot with its policy."""
        if state.net_mode != "netns" or state.net_slot:
            return
        network = self.net.attach(state.sandbox_id, Path(state.state_dir), NetworkSpec.from_json(state.network))
        before = state.host_address, state.host_port
        state.net_slot, state.host_address, state.host_port = network.slot, network.host_address, ENVD_PORT
        try:
            state.save()
        except BaseException:  # not recorded (a full disk): given back, or no record would ever name it
            state.net_slot, (state.host_address, state.host_port) = 0, before
            self.net.detach(network, Path(state.state_dir))
            raise

    def _give_back_slot(self, state: VMState) -> None:
        """A netns VM whose process is gone (paused to disk, a failed resume) returns its slot."""
        if state.net_mode != "netns" or not state.net_slot:
            return
        attachment = self._attachment(state)
        slot, address = state.net_slot, state.host_address
        state.net_slot, state.host_address = 0, ""
        try:
            state.save()
        except OSError:  # not recorded as given back (a full disk): it stays the VM's
            state.net_slot, state.host_address = slot, address
            raise
        self.net.detach(attachment, Path(state.state_dir))

    def start_network(self) -> dict:
        """At node start: the netns backend adopts the slots of VMs that outlived the worker
        and removes every other slot of this instance (vmm.net.netns); slirp needs nothing.
        Returns what the node reports: the backend and the slots kept / removed."""
        if self.net.name != "netns":
            return {"network": self.net.name}
        in_use = set()
        for d in sorted(self.sandboxes_dir.iterdir()) if self.sandboxes_dir.exists() else []:
            state = VMState.load(d)
            if state is not None and state.net_mode == "netns" and state.net_slot:
                in_use.add(state.net_slot)
        removed = self.net.start(in_use)
        return {"network": self.net.name, "slots_kept": len(in_use), "slots_removed": len(removed)}

    def stop_network(self) -> None:
        """At node stop: the netns backend removes its warm slots and, once no VM keeps a
        slot, its accepts in the host's firewall (vmm.net.host_firewall); slirp needs nothing."""
        if self.net.name == "netns":
            self.net.close()

    def _wait_health(self, state: VMState, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not envd_healthy(state.host_address, state.host_port):
            if not process_alive(state.pid, state.qmp):
                raise VMError(f"sandbox {state.sandbox_id}: qemu died\n{console_tail(Path(state.console))}")
            if time.monotonic() > deadline:
                raise BootTimeout(f"sandbox {state.sandbox_id}: no /health after {timeout:.0f}s",
                                  console_tail(Path(state.console)))
            time.sleep(0.005)


    def capacity(self) -> dict:
        return hostinfo.capacity()

    def update_network(self, sandbox_id: str, network: NetworkSpec) -> None:
        self.net.check(network)
        with self._lock(sandbox_id):
            state = self._load(sandbox_id)
            attachment = self._attachment(state)
            recorded = state.network
            if attachment.slot:  # has a network now: applied before it is recorded
                self.net.apply_egress(attachment, network)
            state.network = network.to_json()
            try:
                state.save()
            except OSError as exc:  # not recorded: the recorded policy stays the one in force
                if attachment.slot:
                    self.net.apply_egress(attachment, NetworkSpec.from_json(recorded))
                full = disk_full(exc, Path(state.state_dir))
                if full:  # e.g. a resume's first step (agent.tasks.resume_sandbox): 503, it stays as it was
                    raise HostDiskFull(f"sandbox {sandbox_id}: network policy not changed, no room on the "
                                       f"node's disk ({full})") from exc
                raise

    @staticmethod
    def _to_info(state: VMState) -> VMInfo:
        guest_host = state.host_address if state.net_mode == "netns" and state.net_slot else ""
        return VMInfo(sandbox_id=state.sandbox_id, pid=state.pid, envd_host=state.host_address, guest_host=guest_host,
                      envd_port=state.host_port, accel=state.accel, state_dir=Path(state.state_dir),
                      timings=dict(state.timings), status=state.status.reported)
