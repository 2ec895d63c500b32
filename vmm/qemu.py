"""QEMU microvm driver: cold boot, kill, info and list of VMs kept in per-sandbox state dirs.

Why this shape: QEMU daemonizes (new session, pidfile) so VMs outlive the worker; every file a
VM uses is under home/sandboxes/<id>/ or /dev/shm/aenv-<id>.ram and recorded in vm.json, so
kill() leaves nothing behind and list() can reattach after a restart.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

from vmm import hostinfo, ports
from vmm.accel import detect_accel, kvm_openable
from vmm.driver import BootSpec, BootTimeout, VMDriver, VMError, VMInfo
from vmm.images import find_image
from vmm.qemu_cmdline import QEMU, VMPaths, qemu_command
from vmm.qmp import QMP, QMPError
from vmm.state import VMState, process_alive, read_pidfile, reap, valid_sandbox_id

DEFAULT_BOOT_TIMEOUT = 60.0


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


def console_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class QemuDriver(VMDriver):
    def __init__(self, home: Path, images_dir: Path, host_address: str = "127.0.0.1",
                 boot_timeout: float = DEFAULT_BOOT_TIMEOUT, qemu: str = QEMU, shm_dir: Path = Path("/dev/shm"),
                 port_range: tuple[int, int] = ports.PORT_RANGE, accel: str | None = None):
        if shutil.which(qemu) is None:
            raise VMError(f"{qemu} not found on PATH (apt-get install qemu-system-x86)")
        self.home = Path(home)
        self.images_dir = Path(images_dir)
        self.sandboxes_dir = self.home / "sandboxes"
        self.sandboxes_dir.mkdir(parents=True, exist_ok=True)
        self.host_address = host_address
        self.boot_timeout = boot_timeout
        self.qemu = qemu
        self.shm_dir = Path(shm_dir)
        self.port_range = port_range
        self._accel = accel
        self._accel_lock = threading.Lock()

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

    # -- boot -------------------------------------------------------------------------------

    def boot(self, spec: BootSpec) -> VMInfo:
        if not valid_sandbox_id(spec.sandbox_id):
            raise VMError(f"invalid sandbox id {spec.sandbox_id!r}")
        image = find_image(self.images_dir, spec.image)
        accel = self.accel
        state_dir = self.sandboxes_dir / spec.sandbox_id
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
                raise
        last = failures[-1]
        msg = f"sandbox {spec.sandbox_id}: envd not healthy after 2 attempts ({'; '.join(map(str, failures))})"
        if last.timed_out:
            raise BootTimeout(msg, last.console)
        raise VMError(msg + (f"\n--- console tail ---\n{last.console}" if last.console else ""))

    def _boot_once(self, spec: BootSpec, image, accel: str, state_dir: Path, attempt: int) -> VMInfo:
        t0 = time.monotonic()
        paths = VMPaths.for_sandbox(state_dir, spec.sandbox_id, self.shm_dir)
        port = ports.allocate(self.sandboxes_dir, state_dir, self.host_address, self.port_range)
        base_mb = _virtual_size_mb(image.rootfs)
        disk_mb = max(spec.disk_size_mb, base_mb)
        _run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(image.rootfs), "-F", "qcow2",
              str(paths.top), f"{disk_mb}M"])
        t_disk = time.monotonic()
        argv = qemu_command(paths=paths, kernel=image.kernel, initrd=image.initrd, tools=image.tools, accel=accel,
                            cpu_count=spec.cpu_count, memory_mb=spec.memory_mb, host_address=self.host_address,
                            host_port=port, tsc_khz=hostinfo.tsc_khz(), resize=disk_mb > base_mb, qemu=self.qemu)
        state = VMState(sandbox_id=spec.sandbox_id, pid=0, accel=accel, host_address=self.host_address,
                        host_port=port, state_dir=str(state_dir), top=str(paths.top), qmp=str(paths.qmp),
                        console=str(paths.console), pidfile=str(paths.pidfile), ram=str(paths.ram),
                        image=spec.image, image_dir=str(image.kernel.parent), kernel=str(image.kernel),
                        initrd=str(image.initrd), rootfs=str(image.rootfs), tools=str(image.tools),
                        cpu_count=spec.cpu_count, memory_mb=spec.memory_mb, disk_size_mb=disk_mb, argv=argv,
                        created_at=time.time())
        state.save()  # before spawning: a crash from here on still leaves a killable record
        proc = subprocess.run(argv, capture_output=True, text=True, start_new_session=True, stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            raise _BootAttemptFailed(f"attempt {attempt}: qemu exited {proc.returncode}: {proc.stderr.strip()[-500:]}",
                                     console_tail(paths.console))
        pid = read_pidfile(paths.pidfile)
        if pid is None:
            raise _BootAttemptFailed(f"attempt {attempt}: no pidfile", console_tail(paths.console))
        state.pid = pid
        t_spawn = time.monotonic()
        state.save()
        deadline = t_spawn + self.boot_timeout
        while not envd_healthy(self.host_address, port):
            if not process_alive(pid, str(paths.qmp)):
                raise _BootAttemptFailed(f"attempt {attempt}: qemu died during boot", console_tail(paths.console))
            if time.monotonic() > deadline:
                raise _BootAttemptFailed(f"attempt {attempt}: no /health after {self.boot_timeout:.0f}s",
                                         console_tail(paths.console), timed_out=True)
            time.sleep(0.05)
        t_ready = time.monotonic()
        state.timings = {"disk_ms": (t_disk - t0) * 1e3, "spawn_ms": (t_spawn - t_disk) * 1e3,
                         "envd_ms": (t_ready - t_spawn) * 1e3, "total_ms": (t_ready - t0) * 1e3,
                         "attempt": attempt}
        state.save()
        return self._to_info(state)

    # -- kill -------------------------------------------------------------------------------

    def kill(self, sandbox_id: str) -> bool:
        if not valid_sandbox_id(sandbox_id):
            return False
        state_dir = self.sandboxes_dir / sandbox_id
        paths = VMPaths.for_sandbox(state_dir, sandbox_id, self.shm_dir)
        state = VMState.load(state_dir)
        if state is not None:
            paths = VMPaths(state_dir=state_dir, top=Path(state.top), qmp=Path(state.qmp),
                            console=Path(state.console), pidfile=Path(state.pidfile), ram=Path(state.ram))
        existed = state_dir.exists() or paths.ram.exists()
        self._cleanup(state_dir, paths)
        return existed

    def _cleanup(self, state_dir: Path, paths: VMPaths) -> None:
        """Stops the VM (QMP quit, SIGTERM, SIGKILL) and deletes its state dir and RAM file."""
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
        shutil.rmtree(state_dir, ignore_errors=True)
        try:
            paths.ram.unlink()
        except FileNotFoundError:
            pass

    # -- queries ----------------------------------------------------------------------------

    def info(self, sandbox_id: str) -> VMInfo | None:
        if not valid_sandbox_id(sandbox_id):
            return None
        state = VMState.load(self.sandboxes_dir / sandbox_id)
        if state is None or not process_alive(state.pid, state.qmp):
            return None
        return self._to_info(state)

    def list(self) -> list[VMInfo]:
        out = []
        for d in sorted(self.sandboxes_dir.iterdir()) if self.sandboxes_dir.exists() else []:
            state = VMState.load(d)
            if state is not None and process_alive(state.pid, state.qmp):
                out.append(self._to_info(state))
        return out

    def capacity(self) -> dict:
        return hostinfo.capacity()

    @staticmethod
    def _to_info(state: VMState) -> VMInfo:
        return VMInfo(sandbox_id=state.sandbox_id, pid=state.pid, envd_host=state.host_address,
                      envd_port=state.host_port, accel=state.accel, state_dir=Path(state.state_dir),
                      timings=dict(state.timings))


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
