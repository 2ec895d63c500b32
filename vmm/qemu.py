"""QEMU microvm driver: boot, kill, info, list, pause/resume, snapshot/restore and fork of VMs
kept in per-sandbox state dirs.

Why this shape: QEMU daemonizes (new session, pidfile) so VMs outlive the worker; every file a
VM uses is under home/sandboxes/<id>/ or /dev/shm/aenv-<id>.ram and recorded in vm.json, so
kill() leaves nothing behind and list() can reattach after a restart.

Lifecycle (qemu-feasibility §4 recipe B, §5, §6): guest RAM is a memory-backend-file on /dev/shm
with share=on and every QEMU has the `x-ignore-shared` migration capability, so "saving the VM"
means migrating only the device state (~60 KiB); the RAM file itself is the memory snapshot.
Destinations are spawned from the recorded config with the identical command line except the RAM
share mode, the disk top, the hostfwd port and `-incoming defer` (nothing checks that configs
match, so they are only ever derived from vm.json / manifest.json).

File ownership:
  home/sandboxes/<id>/    the sandbox's: top, sealed layers (top-N.qcow2 chain), device state
  /dev/shm/aenv-<id>.ram  the sandbox's RAM (booted sandboxes only)
  <snapshot dir>          the snapshot() caller's; restored sandboxes map its RAM file and read its
                          layers, so it must outlive them
  home/forks/<id>-<x>/    a fork capture: the driver's; deleted when its last child is killed
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

from vmm import hostinfo, ports, qemu_cmdline, ramfile
from vmm.accel import detect_accel, kvm_openable
from vmm.driver import BootSpec, BootTimeout, SnapshotManifest, SnapshotUnusable, VMDriver, VMError, VMInfo
from vmm.images import find_image
from vmm.locks import LockTimeout, vm_lock
from vmm.qemu_cmdline import QEMU, VMPaths, qemu_command
from vmm.qmp import QMP, QMPError, migrate_from_file, migrate_to_file, prepare_migration, set_ignore_shared
from vmm.state import VMState, process_alive, read_pidfile, reap, valid_sandbox_id

log = logging.getLogger(__name__)

DEFAULT_BOOT_TIMEOUT = 60.0
GUEST_SYNC_TIMEOUT = 120.0
SYNC_PATH = "/aenv/sync"  # envd: sync(2), no token needed
# vm.json statuses without a QEMU process: device state + RAM kept, or only the disk kept.
OFFLINE = ("paused_disk", "paused_fs")


def envd_healthy(host: str, port: int, timeout: float = 1.0) -> bool:
    """True when envd answers GET /health with 204 (slirp accepts then drops until the guest listens)."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 204
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


@lru_cache(maxsize=8)
def qemu_version(qemu: str = QEMU) -> str:
    out = subprocess.run([qemu, "--version"], capture_output=True, text=True, check=True).stdout
    return out.splitlines()[0].strip()


def cmdline_digest() -> str:
    """The command-line builder's source: a changed device or kernel argument no longer
    matches a saved device state."""
    return hashlib.sha256(Path(qemu_cmdline.__file__).read_bytes()).hexdigest()[:16]


def console_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class QemuDriver(VMDriver):
    name = "qemu"

    def __init__(self, home: Path, images_dir: Path, host_address: str = "127.0.0.1",
                 boot_timeout: float = DEFAULT_BOOT_TIMEOUT, qemu: str = QEMU, shm_dir: Path = Path("/dev/shm"),
                 port_range: tuple[int, int] = ports.PORT_RANGE, accel: str | None = None):
        if shutil.which(qemu) is None:
            raise VMError(f"{qemu} not found on PATH (apt-get install qemu-system-x86)")
        self.home = Path(home).absolute()  # QEMU -daemonize chdirs to /: every path must be absolute
        self.images_dir = Path(images_dir).resolve()  # recorded paths must not go through a symlink that may vanish
        self.sandboxes_dir = self.home / "sandboxes"
        self.sandboxes_dir.mkdir(parents=True, exist_ok=True)
        self.host_address = host_address
        self.boot_timeout = boot_timeout
        self.qemu = qemu
        self.shm_dir = Path(shm_dir)
        self.port_range = port_range
        self._accel = accel
        self._accel_lock = threading.Lock()
        self.locks_dir = self.home / "locks"

    @contextmanager
    def _lock(self, sandbox_id: str):
        """Serializes lifecycle verbs on one sandbox across threads and processes (flock)."""
        try:
            with vm_lock(self.locks_dir, sandbox_id) as lock:
                yield lock
        except LockTimeout as e:
            raise VMError(str(e)) from None

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
        QEMU (device state format) and the same command line (see qemu_cmdline)."""
        try:
            version = qemu_version(self.qemu)
        except (OSError, subprocess.SubprocessError) as e:
            raise VMError(f"cannot run {self.qemu} --version: {e}") from None
        return {"driver": self.name, "accel": self.accel, "qemu": version, "cmdline": cmdline_digest()}

    def check_snapshot(self, manifest: SnapshotManifest) -> None:
        """The snapshot is QEMU's, and this host has the image build it was taken on: the
        template base layer under its disk chain, the kernel, initrd and tools drive the
        device state belongs to (every node builds its images itself, at the same paths)."""
        taken_by = (manifest.fingerprint or {}).get("driver", self.name)
        if taken_by != self.name:
            raise SnapshotUnusable(f"snapshot was taken by the {taken_by} driver; this host runs {self.name}")
        machine = manifest.machine or {}
        needed = [("template base layer", manifest.layers[0] if manifest.layers else "")] + [
            (what, machine.get(key) or "") for what, key in
            (("guest kernel", "kernel"), ("initrd", "initrd"), ("tools drive", "tools"))]
        for what, path in needed:
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
        image = find_image(self.images_dir, spec.image)
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
                except _BootAttemptFailed as e:
                    failures.append(e)
                    self._cleanup(state_dir, VMPaths.for_sandbox(state_dir, spec.sandbox_id, self.shm_dir))
                except BaseException:
                    self._cleanup(state_dir, VMPaths.for_sandbox(state_dir, spec.sandbox_id, self.shm_dir))
                    lock.discard()
                    raise
            lock.discard()
        raise _attempts_error(spec.sandbox_id, failures)

    def _boot_once(self, spec: BootSpec, image, accel: str, state_dir: Path, attempt: int) -> VMInfo:
        t0 = time.monotonic()
        paths = VMPaths.for_sandbox(state_dir, spec.sandbox_id, self.shm_dir)
        port = ports.allocate(self.sandboxes_dir, state_dir, self.host_address, self.port_range)
        chain = [str(p) for p in spec.layers] if spec.layers else [str(image.rootfs)]
        base_mb = _virtual_size_mb(Path(chain[-1]))
        disk_mb = max(spec.disk_size_mb, base_mb)
        _run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", chain[-1], "-F", "qcow2",
              str(paths.top), f"{disk_mb}M"])
        t_disk = time.monotonic()
        tsc = hostinfo.tsc_khz()
        argv = qemu_command(paths=paths, kernel=image.kernel, initrd=image.initrd, tools=image.tools, accel=accel,
                            cpu_count=spec.cpu_count, memory_mb=spec.memory_mb, host_address=self.host_address,
                            host_port=port, tsc_khz=tsc, resize=disk_mb > base_mb, qemu=self.qemu)
        state = VMState(sandbox_id=spec.sandbox_id, pid=0, accel=accel, host_address=self.host_address,
                        host_port=port, state_dir=str(state_dir), top=str(paths.top), qmp=str(paths.qmp),
                        console=str(paths.console), pidfile=str(paths.pidfile), ram=str(paths.ram),
                        image=spec.image, image_dir=str(image.kernel.parent), kernel=str(image.kernel),
                        initrd=str(image.initrd), rootfs=chain[0], tools=str(image.tools),
                        cpu_count=spec.cpu_count, memory_mb=spec.memory_mb, disk_size_mb=disk_mb, argv=argv,
                        created_at=time.time(), tsc_khz=tsc, resize=disk_mb > base_mb, qemu=self.qemu,
                        chain=chain)
        state.save()  # before spawning: a crash from here on still leaves a killable record
        t_spawn, t_ready = self._spawn_cold(state, paths, attempt)
        state.timings = {"disk_ms": (t_disk - t0) * 1e3, "spawn_ms": (t_spawn - t_disk) * 1e3,
                         "envd_ms": (t_ready - t_spawn) * 1e3, "total_ms": (t_ready - t0) * 1e3,
                         "attempt": attempt}
        state.save()
        return self._to_info(state)

    def _spawn_cold(self, state: VMState, paths: VMPaths, attempt: int) -> tuple[float, float]:
        """Starts QEMU with state.argv (a cold boot of the guest kernel) and waits for envd.
        Returns (spawned, ready) monotonic times; raises _BootAttemptFailed."""
        proc = subprocess.run(state.argv, capture_output=True, text=True, start_new_session=True,
                              stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            raise _BootAttemptFailed(f"attempt {attempt}: qemu exited {proc.returncode}: {proc.stderr.strip()[-500:]}",
                                     console_tail(paths.console))
        pid = read_pidfile(paths.pidfile)
        if pid is None:
            raise _BootAttemptFailed(f"attempt {attempt}: no pidfile", console_tail(paths.console))
        state.pid = pid
        t_spawn = time.monotonic()
        state.save()
        try:
            with QMP(paths.qmp, timeout=10.0) as q:
                prepare_migration(q)  # always ready for pause_to_disk / snapshot / fork
        except (QMPError, OSError) as e:
            raise _BootAttemptFailed(f"attempt {attempt}: QMP setup failed: {e}", console_tail(paths.console))
        deadline = t_spawn + self.boot_timeout
        while not envd_healthy(state.host_address, state.host_port):
            if not process_alive(pid, str(paths.qmp)):
                raise _BootAttemptFailed(f"attempt {attempt}: qemu died during boot", console_tail(paths.console))
            if time.monotonic() > deadline:
                raise _BootAttemptFailed(f"attempt {attempt}: no /health after {self.boot_timeout:.0f}s",
                                         console_tail(paths.console), timed_out=True)
            time.sleep(0.05)
        return t_spawn, time.monotonic()

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

    def info(self, sandbox_id: str) -> VMInfo | None:
        if not valid_sandbox_id(sandbox_id):
            return None
        state = VMState.load(self.sandboxes_dir / sandbox_id)
        if state is None:
            return None
        if state.status in OFFLINE:
            return self._to_info(state)
        if not process_alive(state.pid, state.qmp):
            return None
        return self._to_info(state)

    def list(self) -> list[VMInfo]:
        out = []
        for d in sorted(self.sandboxes_dir.iterdir()) if self.sandboxes_dir.exists() else []:
            state = VMState.load(d)
            if state is not None and (state.status in OFFLINE or process_alive(state.pid, state.qmp)):
                out.append(self._to_info(state))
        return out

    # -- lifecycle --------------------------------------------------------------------------

    def _load(self, sandbox_id: str) -> VMState:
        state = VMState.load(self.sandboxes_dir / sandbox_id) if valid_sandbox_id(sandbox_id) else None
        if state is None:
            raise VMError(f"unknown sandbox {sandbox_id!r}")
        if state.status not in OFFLINE and not process_alive(state.pid, state.qmp):
            raise VMError(f"sandbox {sandbox_id}: QEMU process is gone")
        return state

    @staticmethod
    def _paths(state: VMState) -> VMPaths:
        return VMPaths(state_dir=Path(state.state_dir), top=Path(state.top), qmp=Path(state.qmp),
                       console=Path(state.console), pidfile=Path(state.pidfile), ram=Path(state.ram))

    @staticmethod
    def _argv(state: VMState, incoming: bool) -> list[str]:
        """The command line from the recorded config only (identical for source and destination)."""
        return qemu_command(paths=QemuDriver._paths(state), kernel=Path(state.kernel), initrd=Path(state.initrd),
                            tools=Path(state.tools), accel=state.accel, cpu_count=state.cpu_count,
                            memory_mb=state.memory_mb, host_address=state.host_address, host_port=state.host_port,
                            tsc_khz=state.tsc_khz, resize=state.resize, qemu=state.qemu,
                            ram_share=state.ram_share, incoming=incoming)

    def _wait_health(self, state: VMState, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not envd_healthy(state.host_address, state.host_port):
            if not process_alive(state.pid, state.qmp):
                raise VMError(f"sandbox {state.sandbox_id}: qemu died\n{console_tail(Path(state.console))}")
            if time.monotonic() > deadline:
                raise BootTimeout(f"sandbox {state.sandbox_id}: no /health after {timeout:.0f}s",
                                  console_tail(Path(state.console)))
            time.sleep(0.005)

    def _spawn_incoming(self, state: VMState, device_state: Path, ignore_shared: bool = True,
                        before_cont=None, before_incoming=None) -> dict[str, float]:
        """Starts a destination QEMU for `state` (-incoming defer), loads the device state, runs
        it and waits for envd. On failure the new process is stopped and the error raised."""
        t0 = time.monotonic()
        if not device_state.is_file():  # `exec:cat` of a missing file leaves QEMU waiting forever
            raise VMError(f"sandbox {state.sandbox_id}: device state {device_state} is missing")
        state.argv = self._argv(state, incoming=True)
        state.top_node = "root"
        state.pid = 0
        state.save()
        paths = self._paths(state)
        try:
            paths.pidfile.unlink()
        except FileNotFoundError:
            pass
        try:
            proc = subprocess.run(state.argv, capture_output=True, text=True, start_new_session=True,
                                  stdin=subprocess.DEVNULL)
            if proc.returncode != 0:
                raise VMError(f"sandbox {state.sandbox_id}: qemu exited {proc.returncode}: "
                              f"{proc.stderr.strip()[-500:]}")
            pid = read_pidfile(paths.pidfile)
            if pid is None:
                raise VMError(f"sandbox {state.sandbox_id}: no pidfile")
            state.pid = pid
            t_spawn = time.monotonic()
            with QMP(paths.qmp, timeout=30.0) as q:
                prepare_migration(q)
                if before_incoming is not None:  # e.g. the RAM file must be complete before the guest runs
                    before_incoming()
                if not ignore_shared:  # a full-RAM stream written without x-ignore-shared
                    set_ignore_shared(q, False)
                migrate_from_file(q, device_state, before_cont=before_cont)
                if not ignore_shared:
                    set_ignore_shared(q, True)
            t_run = time.monotonic()
            self._wait_health(state, self.boot_timeout)
        except BaseException:
            self._stop_process(paths)
            raise
        t_ready = time.monotonic()
        return {"spawn_ms": (t_spawn - t0) * 1e3, "incoming_ms": (t_run - t_spawn) * 1e3,
                "envd_ms": (t_ready - t_run) * 1e3, "total_ms": (t_ready - t0) * 1e3}

    def pause(self, sandbox_id: str) -> dict[str, float]:
        with self._lock(sandbox_id):
            state = self._load(sandbox_id)
            if state.status in OFFLINE:
                raise VMError(f"sandbox {sandbox_id} is paused to disk")
            t0 = time.monotonic()
            with QMP(Path(state.qmp)) as q:
                q.execute("stop")
            timings = {"pause_ms": (time.monotonic() - t0) * 1e3}
            state.status = "paused"
            state.timings.update(timings)
            state.save()
            return timings

    def pause_to_disk(self, sandbox_id: str, memory: bool = True) -> dict[str, float]:
        with self._lock(sandbox_id):
            state = self._load(sandbox_id)
            if state.status == ("paused_disk" if memory else "paused_fs"):
                return {}
            if state.status in OFFLINE:
                raise VMError(f"sandbox {sandbox_id} is already paused to disk "
                              f"({'without' if state.status == 'paused_fs' else 'with'} its memory); resume it first")
            if not memory:
                return self._pause_fs(state)
            paths = self._paths(state)
            device_state = paths.state_dir / "device.state"
            t0 = time.monotonic()
            with QMP(paths.qmp, timeout=30.0) as q:
                was_running = q.execute("query-status").get("status") == "running"
                q.execute("stop")
                t_stop = time.monotonic()
                full_ram = not state.ram_share  # copy-on-write RAM travels in the stream anyway
                try:
                    if full_ram:  # plain format, so a share=on destination loads it (see _resume_incoming)
                        set_ignore_shared(q, False)
                    migrate_to_file(q, device_state)
                except BaseException:
                    if full_ram:
                        set_ignore_shared(q, True)
                    if was_running:
                        q.execute("cont")
                    raise
                t_saved = time.monotonic()
                # From here the device state + RAM file are the VM: record that before QEMU exits.
                state.status = "paused_disk"
                state.device_state = str(device_state)
                state.device_state_full_ram = full_ram
                state.save()
                try:
                    q.execute("quit")
                except QMPError:
                    pass  # the socket may close before the reply
            self._wait_exit(state, paths)
            t_exit = time.monotonic()
            state.pid = 0
            timings = {"stop_ms": (t_stop - t0) * 1e3, "save_ms": (t_saved - t_stop) * 1e3,
                       "pause_to_disk_ms": (t_saved - t0) * 1e3, "exit_ms": (t_exit - t_saved) * 1e3,
                       "total_ms": (t_exit - t0) * 1e3}
            state.timings.update({f"pause_to_disk.{k}": v for k, v in timings.items()})
            state.save()
            return timings

    def _wait_exit(self, state: VMState, paths: VMPaths) -> None:
        """Waits for a QEMU that was told to quit; stops it harder after 10 s."""
        pid = state.pid
        end = time.monotonic() + 10.0
        while process_alive(pid, state.qmp) and time.monotonic() < end:
            time.sleep(0.002)
        if process_alive(pid, state.qmp):
            self._stop_process(paths)
        reap(pid)

    def _guest_sync(self, state: VMState) -> None:
        """Has envd run sync(2) so the guest page cache is on the virtual disk; raises VMError."""
        conn = http.client.HTTPConnection(state.host_address, state.host_port, timeout=GUEST_SYNC_TIMEOUT)
        try:
            conn.request("POST", SYNC_PATH)
            resp = conn.getresponse()
            resp.read()
            if resp.status != 204:
                raise VMError(f"sandbox {state.sandbox_id}: guest sync answered {resp.status}")
        except (OSError, http.client.HTTPException) as e:
            raise VMError(f"sandbox {state.sandbox_id}: guest sync failed: {e!r}") from None
        finally:
            conn.close()

    def _pause_fs(self, state: VMState) -> dict[str, float]:
        """Filesystem-only pause: guest sync, QEMU quits, RAM file deleted, disk chain kept.
        A failed sync leaves the VM as it was (a dirty page cache must not be thrown away)."""
        paths = self._paths(state)
        t0 = time.monotonic()
        was_paused = state.status == "paused"
        if was_paused:  # the guest must run to flush its page cache
            with QMP(paths.qmp) as q:
                q.execute("cont")
        try:
            self._guest_sync(state)
        except BaseException:
            if was_paused:
                with QMP(paths.qmp) as q:
                    q.execute("stop")
            raise
        t_sync = time.monotonic()
        with QMP(paths.qmp, timeout=30.0) as q:
            q.execute("stop")
            # From here only the disk is the VM: record that before QEMU exits.
            state.status = "paused_fs"
            state.device_state = ""
            state.save()
            try:
                q.execute("quit")
            except QMPError:
                pass  # the socket may close before the reply
        t_stop = time.monotonic()
        self._wait_exit(state, paths)
        t_exit = time.monotonic()
        if state.ram_owned:
            try:
                paths.ram.unlink()
            except FileNotFoundError:
                pass
        # The next start is a cold boot on a RAM file of its own (even if restored from a snapshot).
        state.ram = str(VMPaths.for_sandbox(paths.state_dir, state.sandbox_id, self.shm_dir).ram)
        state.ram_share = state.ram_owned = True
        state.pid = 0
        timings = {"sync_ms": (t_sync - t0) * 1e3, "stop_ms": (t_stop - t_sync) * 1e3,
                   "exit_ms": (t_exit - t_stop) * 1e3, "total_ms": (time.monotonic() - t0) * 1e3}
        state.timings.update({f"pause_fs.{k}": v for k, v in timings.items()})
        state.save()
        return timings

    def _discard_memory(self, state: VMState) -> None:
        """Turns a memory-paused VM into a filesystem-paused one without a guest sync (the
        guest is not running): its process, device state and RAM go, the disk stays."""
        paths = self._paths(state)
        self._stop_process(paths)
        if state.device_state:
            Path(state.device_state).unlink(missing_ok=True)
        if state.ram_owned:
            paths.ram.unlink(missing_ok=True)
        state.status = "paused_fs"
        state.device_state = ""
        state.ram = str(VMPaths.for_sandbox(paths.state_dir, state.sandbox_id, self.shm_dir).ram)
        state.ram_share = state.ram_owned = True
        state.pid = 0
        state.save()

    def _resume_cold(self, state: VMState) -> dict[str, float]:
        """Cold-boots a filesystem-only paused VM on its own disk (same id, port and top).
        On failure it stays paused_fs with no process and no RAM file."""
        paths = self._paths(state)
        self._stop_process(paths)  # a QEMU left by an interrupted pause
        failures = []
        for attempt in (1, 2):
            t0 = time.monotonic()
            state.argv = self._argv(state, incoming=False)
            state.top_node = "root"
            state.pid = 0
            state.save()
            for stale in (paths.pidfile, paths.ram):
                try:
                    stale.unlink()
                except FileNotFoundError:
                    pass
            try:
                t_spawn, t_ready = self._spawn_cold(state, paths, attempt)
                return {"spawn_ms": (t_spawn - t0) * 1e3, "envd_ms": (t_ready - t_spawn) * 1e3,
                        "total_ms": (t_ready - t0) * 1e3, "attempt": attempt, "cold_boot": 1}
            except _BootAttemptFailed as e:
                failures.append(e)
            except BaseException:
                self._undo_spawn(state, paths)
                raise
            self._undo_spawn(state, paths)
        raise _attempts_error(state.sandbox_id, failures)

    def _undo_spawn(self, state: VMState, paths: VMPaths) -> None:
        self._stop_process(paths)
        try:
            paths.ram.unlink()
        except FileNotFoundError:
            pass
        state.pid = 0
        state.save()

    def _resume_incoming(self, state: VMState) -> dict[str, float]:
        """Resume after pause_to_disk with memory. A copy-on-write VM (restored or forked:
        share=off over a snapshot's RAM) saved its whole RAM into the device state; it comes
        back on a share=on RAM file of its own that the stream fills, so its next pause or
        snapshot saves only the device state again."""
        device_state = Path(state.device_state)
        saved = (state.ram, state.ram_share, state.ram_owned)
        converting = not state.ram_share and state.device_state_full_ram
        if converting:
            own = VMPaths.for_sandbox(Path(state.state_dir), state.sandbox_id, self.shm_dir).ram
            try:
                own.unlink()
            except FileNotFoundError:
                pass
            state.ram, state.ram_share, state.ram_owned = str(own), True, True
        try:
            punched = {}

            def give_back_zero_pages():  # loading the stream touched (allocated) every page
                t = time.monotonic()
                punched["ram_zero_punched_mb"] = ramfile.punch_zero_pages(state.ram) / (1 << 20)
                punched["ram_punch_ms"] = (time.monotonic() - t) * 1e3

            timings = self._spawn_incoming(state, device_state, ignore_shared=not state.device_state_full_ram,
                                           before_cont=give_back_zero_pages if converting else None)
            timings.update(punched)
        except BaseException:
            if converting:
                try:
                    Path(state.ram).unlink()
                except FileNotFoundError:
                    pass
                state.ram, state.ram_share, state.ram_owned = saved
                state.pid = 0
                state.save()
            raise
        if converting:
            timings["ram_converted"] = 1
        try:
            device_state.unlink()
        except FileNotFoundError:
            pass
        state.device_state = ""
        state.device_state_full_ram = False
        return timings

    def resume(self, sandbox_id: str, memory: bool = True) -> VMInfo:
        with self._lock(sandbox_id):
            state = self._load(sandbox_id)
            if not memory and state.status in ("paused", "paused_disk"):
                self._discard_memory(state)
            if state.status == "paused_fs":
                timings = self._resume_cold(state)
            elif state.status == "paused_disk":
                timings = self._resume_incoming(state)
            else:
                t0 = time.monotonic()
                with QMP(Path(state.qmp)) as q:
                    q.execute("cont")
                t_cont = time.monotonic()
                self._wait_health(state, self.boot_timeout)
                timings = {"cont_ms": (t_cont - t0) * 1e3, "total_ms": (time.monotonic() - t0) * 1e3}
            state.status = "running"
            state.timings.update({f"resume.{k}": v for k, v in timings.items()})
            state.save()
            info = self._to_info(state)
            info.timings = timings
            return info

    def snapshot(self, sandbox_id: str, dest_dir: Path, memory: bool = True) -> SnapshotManifest:
        return self._snapshot(sandbox_id, dest_dir, memory=memory)

    def _snapshot(self, sandbox_id: str, dest_dir: Path, memory_file: Path | None = None,
                  memory: bool = True) -> SnapshotManifest:
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
            if state.status in OFFLINE:
                raise VMError(f"sandbox {sandbox_id} is paused to disk; resume it before a snapshot")
            paths = self._paths(state)
            gen = state.generation + 1
            new_top = paths.state_dir / f"top-{gen}.qcow2"
            node = f"top{gen}"
            device_state = dest / "device.state"
            ram_copy = Path(memory_file) if memory_file else dest / "memory.ram"
            resumed_for_sync = False
            if not memory:  # the page cache must reach the disk; the guest has to run for that
                if state.status == "paused":
                    with QMP(paths.qmp) as q:
                        q.execute("cont")
                    resumed_for_sync = True
                try:
                    self._guest_sync(state)
                except BaseException:
                    if resumed_for_sync:
                        with QMP(paths.qmp) as q:
                            q.execute("stop")
                    raise
            with QMP(paths.qmp, timeout=30.0) as q:
                was_running = q.execute("query-status").get("status") == "running" and not resumed_for_sync
                t0 = time.monotonic()
                q.execute("stop")
                t_stop = time.monotonic()
                try:
                    q.execute("blockdev-snapshot-sync", **{"node-name": state.top_node, "snapshot-file": str(new_top),
                                                            "snapshot-node-name": node, "format": "qcow2"})
                    state.chain.append(state.top)  # sealed: read-only from now on, owned by the sandbox
                    state.top, state.top_node, state.generation = str(new_top), node, gen
                    state.save()
                    t_disk = time.monotonic()
                    if memory:
                        migrate_to_file(q, device_state)
                    t_dev = time.monotonic()
                    if not memory:
                        pass
                    elif state.ram_share:
                        _run(["cp", "--sparse=always", state.ram, str(ram_copy)])
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
            layers = [state.chain[0]]
            for i, layer in enumerate(state.chain[1:]):
                copy = dest / f"layer-{i}.qcow2"
                _run(["cp", "--sparse=always", layer, str(copy)])
                _run(["qemu-img", "rebase", "-u", "-f", "qcow2", "-F", "qcow2", "-b", layers[-1], str(copy)])
                layers.append(str(copy))
            t_done = time.monotonic()
            timings = {"stop_ms": (t_stop - t0) * 1e3, "disk_ms": (t_disk - t_stop) * 1e3,
                       "device_ms": (t_dev - t_disk) * 1e3, "memory_copy_ms": (t_mem - t_dev) * 1e3,
                       "pause_ms": (t_cont - t0) * 1e3, "layers_copy_ms": (t_done - t_cont) * 1e3,
                       "total_ms": (t_done - t0) * 1e3}
            manifest = SnapshotManifest(
                dir=dest, fingerprint=self.fingerprint(), layers=layers, memory_file=str(ram_copy) if memory else "",
                device_state_file=str(device_state) if memory else "",
                cpu_count=state.cpu_count, memory_mb=state.memory_mb, disk_size_mb=state.disk_size_mb,
                machine={"qemu": state.qemu, "accel": state.accel, "kernel": state.kernel, "initrd": state.initrd,
                         "tools": state.tools, "tsc_khz": state.tsc_khz, "resize": state.resize,
                         "image": state.image, "image_dir": state.image_dir, "source_argv": state.argv},
                source_sandbox_id=sandbox_id, created_at=time.time(), timings=timings)
            manifest.save()
            state.timings.update({f"snapshot.{k}": v for k, v in timings.items()})
            state.save()
            return manifest

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
        with self._lock(sid) as lock:
            try:
                return self._restore_locked(manifest, sid, capture_ref, own_ram)
            except BaseException:
                lock.discard()
                raise

    def _restore_locked(self, manifest: SnapshotManifest, sid: str, capture_ref: str, own_ram: bool) -> VMInfo:
        """own_ram=False: RAM is MAP_PRIVATE over the snapshot's file (copy-on-write, page cache
        shared between restores; but the VM's own later pause/snapshot must carry its whole RAM in
        the migration stream). own_ram=True: the snapshot's RAM is first copied (sparse) into
        the sandbox's own share=on file, exactly like a booted VM's, so every later verb stays on
        the cheap device-state-only path (used for template snapshots)."""
        m = manifest.machine
        state_dir = self.sandboxes_dir / sid
        if state_dir.exists():
            raise VMError(f"sandbox {sid} already exists ({state_dir})")
        t0 = time.monotonic()
        paths = VMPaths.for_sandbox(state_dir, sid, self.shm_dir)
        copy = None
        try:
            if own_ram:  # copied in the background while the disk is made and QEMU starts
                copy = _RamCopy(Path(manifest.memory_file), paths.ram, manifest.memory_mb << 20)
            port = ports.allocate(self.sandboxes_dir, state_dir, self.host_address, self.port_range)
            _run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", manifest.layers[-1], "-F", "qcow2",
                  str(paths.top), f"{manifest.disk_size_mb}M"])
            t_disk = time.monotonic()
            state = VMState(sandbox_id=sid, pid=0, accel=m["accel"], host_address=self.host_address,
                            host_port=port, state_dir=str(state_dir), top=str(paths.top), qmp=str(paths.qmp),
                            console=str(paths.console), pidfile=str(paths.pidfile),
                            ram=str(paths.ram) if own_ram else manifest.memory_file,
                            image=m.get("image", "base"), image_dir=m.get("image_dir", ""), kernel=m["kernel"],
                            initrd=m["initrd"], rootfs=manifest.layers[0], tools=m["tools"],
                            cpu_count=manifest.cpu_count, memory_mb=manifest.memory_mb,
                            disk_size_mb=manifest.disk_size_mb, argv=[], created_at=time.time(),
                            tsc_khz=m["tsc_khz"], resize=m["resize"], qemu=m["qemu"], ram_share=own_ram,
                            ram_owned=own_ram, chain=list(manifest.layers), capture_ref=capture_ref)
            timings = self._spawn_incoming(state, Path(manifest.device_state_file),
                                           before_incoming=copy.wait if copy else None)
        except BaseException:
            if copy is not None:
                copy.wait(raise_error=False)
            self._cleanup(state_dir, paths, unlink_ram=own_ram)
            raise
        if copy is not None:
            timings["ram_copy_ms"] = copy.elapsed_ms
            timings["ram_copy_wait_ms"] = copy.waited_ms
        timings = {"disk_ms": (t_disk - t0) * 1e3, **timings, "total_ms": (time.monotonic() - t0) * 1e3}
        state.status = "running"
        state.timings = timings
        state.save()
        return self._to_info(state)

    def fork(self, sandbox_id: str, count: int, child_ids: list[str] | None = None) -> list[VMInfo | Exception]:
        if count < 1:
            raise VMError("fork count must be >= 1")
        tag = uuid.uuid4().hex[:6]
        ids = child_ids or [f"{sandbox_id[:48]}-f{tag}-{i}" for i in range(count)]
        if len(ids) != count or len(set(ids)) != count:
            raise VMError("child_ids must be `count` distinct ids")
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
            info = self._restore(manifest, BootSpec(cid), capture_ref=str(capture))
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

    def capacity(self) -> dict:
        return hostinfo.capacity()

    @staticmethod
    def _to_info(state: VMState) -> VMInfo:
        return VMInfo(sandbox_id=state.sandbox_id, pid=state.pid, envd_host=state.host_address,
                      envd_port=state.host_port, accel=state.accel, state_dir=Path(state.state_dir),
                      timings=dict(state.timings), status="running" if state.status == "running" else "paused")


class _RamCopy:
    """A sparse copy of a snapshot's RAM into a new file, running in a thread. The file gets
    its final size before the thread starts, so QEMU may map it meanwhile; it must not run the
    guest before wait() returned."""

    def __init__(self, src: Path, dst: Path, size: int):
        self.dst = dst
        self.error: BaseException | None = None
        self.waited_ms = 0.0
        fd = os.open(dst, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self.t0 = time.monotonic()
        self.t1 = self.t0
        self.thread = threading.Thread(target=self._run, args=(src, fd), daemon=True, name=f"ramcopy-{dst.name}")
        self.thread.start()

    def _run(self, src: Path, fd: int) -> None:
        try:
            ramfile.copy_sparse_into(src, fd)
        except BaseException as e:
            self.error = e
        finally:
            os.close(fd)
            self.t1 = time.monotonic()

    @property
    def elapsed_ms(self) -> float:
        return (self.t1 - self.t0) * 1e3

    def wait(self, raise_error: bool = True) -> None:
        t = time.monotonic()
        self.thread.join()
        self.waited_ms = (time.monotonic() - t) * 1e3
        if raise_error and self.error is not None:
            raise VMError(f"copying the snapshot RAM into {self.dst} failed: {self.error}")


def _attempts_error(sandbox_id: str, failures: list) -> VMError:
    last = failures[-1]
    msg = f"sandbox {sandbox_id}: envd not healthy after {len(failures)} attempts ({'; '.join(map(str, failures))})"
    if last.timed_out:
        return BootTimeout(msg, last.console)
    return VMError(msg + (f"\n--- console tail ---\n{last.console}" if last.console else ""))


class _BootAttemptFailed(Exception):
    def __init__(self, message: str, console: str, timed_out: bool = False):
        super().__init__(message)
        self.console = console
        self.timed_out = timed_out


def _run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise VMError(f"{' '.join(cmd)}: {proc.stderr.strip()}")
    return proc.stdout


_size_cache: dict[tuple[str, float], int] = {}


def _virtual_size_mb(qcow2: Path) -> int:
    """Virtual size of the template base (cached per file+mtime)."""
    key = (str(qcow2), qcow2.stat().st_mtime)
    if key not in _size_cache:
        info = json.loads(_run(["qemu-img", "info", "-U", "--output=json", str(qcow2)]))
        _size_cache[key] = int(info["virtual-size"]) >> 20
    return _size_cache[key]
