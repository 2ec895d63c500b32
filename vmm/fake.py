"""An in-memory VM driver: no processes, no hypervisor, only the state machine.

Why: the driver contract (tests/contract/test_driver_contract.py) is written once and run
against this driver and the real QEMU one, so the verbs mean the same everywhere; code above
the drivers (node tasks, reconcile, snapshot stores, the template cache) is unit-tested on it
instead of on hand-written stubs that drift from the contract.

What it models: each VM's status (running / paused in memory / saved with or without its
memory: vmm.vm_status, moved by the same table as QEMU's records), a guest as two dicts
(``memory``: what a resume with memory keeps, e.g. processes; ``disk``: files, kept by every
pause), snapshots as JSON files in the caller's dir (so the snapshot stores and a second
driver instance can restore them), fork children that are independent copies, host capacity (a boot past it is refused), the fingerprint, and the
documented errors (VMNotFound for unknown ids, VMError for verbs the state does not allow).
Test hooks: ``guest(id)`` for the dicts, ``leave_process(id)`` for a stray process, ``crash(id)``
for a VM whose process died (STOPPED: only kill() helps), ``fail_disk(id)`` for failed disk requests.
"""

from __future__ import annotations

import copy
import itertools
import json
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from vmm.driver import (BootSpec, Leftover, SealedLayer, SnapshotManifest, SnapshotUnusable, VMDriver, VMError,
                        VMInfo, VMInspection, VMNotFound, VMStatus, valid_sandbox_id)
from vmm.images import ImageNotFound
from vmm.net import ENVD_PORT, Attachment, NetworkBackend, NetworkSpec
from vmm.vm_status import MovesByTable, VmLifecycle

STRAY_PROCESS, FORK_CAPTURE = "process", "fork capture"


class FakeNetwork(NetworkBackend):
    """Ports from a counter, policies in a dict. ``enforces_egress=True`` plays a backend
    that can filter (the next issue's), for tests of what sits above the drivers."""

    name = "fake"

    def __init__(self, host_address: str = "127.0.0.1", enforces_egress: bool = False):
        self.host_address, self.enforces_egress = host_address, enforces_egress
        self.policies: dict[str, NetworkSpec] = {}
        self._ports = itertools.count(40000)

    def forward(self, attachment: Attachment, state_dir: Path, guest_port: int) -> int:
        if guest_port not in attachment.forwards:
            attachment.forwards[guest_port] = next(self._ports)
        return attachment.forwards[guest_port]

    def apply_egress(self, attachment: Attachment, spec: NetworkSpec) -> None:
        self.check(spec)
        self.policies[attachment.sandbox_id] = spec

    def detach(self, attachment: Attachment, state_dir: Path) -> None:
        self.policies.pop(attachment.sandbox_id, None)


@dataclass
class FakeGuest:
    memory: dict = field(default_factory=dict)  # lost by a filesystem-only pause or a cold boot
    disk: dict = field(default_factory=dict)  # kept by every pause; copied by snapshots


@dataclass
class _VM(MovesByTable):
    spec: BootSpec
    network: Attachment
    pid: int
    guest: FakeGuest
    status: VmLifecycle = VmLifecycle.RUNNING  # changes only through move() (vmm.vm_status's table)
    crashed: bool = False  # crash(): its process died (STOPPED until killed), whatever its status
    disk_errors: int = 0  # fail_disk(): guest disk requests that failed on the host
    uses: tuple[str, ...] = ()  # files of the snapshot it was restored from
    capture: str = ""  # the fork capture it was restored from
    stray_process: bool = False
    timings: dict = field(default_factory=dict)
    sealed: list = field(default_factory=list)  # seal_layer(): the chain to boot its last sealed state
    sealable: bool = True  # like QEMU: a snapshot or fork changes the disk chain; no seal after it

    @property
    def memory_kept(self) -> bool:
        """Saved with its memory (or not saved at all): all but a filesystem-only pause."""
        return self.status is not VmLifecycle.PAUSED_FS

    @property
    def reported(self) -> VMStatus:
        return VMStatus.STOPPED if self.crashed else self.status.reported


class FakeDriver(VMDriver):
    name = "fake"

    def __init__(self, home: Path | None = None, images_dir: Path | None = None, host_address: str = "127.0.0.1",
                 accel: str = "none", vcpus: int = 64, memory_mb: int = 65536, images: set[str] | None = None,
                 network: NetworkBackend | None = None, **options):
        self.home = Path(home) if home else None
        self.images_dir = Path(images_dir) if images_dir else None
        self.host_address = host_address
        self.accel = accel
        self.vcpus, self.memory_mb = vcpus, memory_mb
        self.images = images  # None: every image name exists
        self.vms: dict[str, _VM] = {}
        self.captures: dict[str, set[str]] = {}  # fork capture -> children restored from it
        self._lock = threading.RLock()
        self.net = network or FakeNetwork(host_address)
        self._pids = itertools.count(100000)

    # -- identity ---------------------------------------------------------------------------

    def fingerprint(self) -> dict:
        return {"driver": self.name, "accel": self.accel}

    def check_snapshot(self, manifest: SnapshotManifest) -> None:
        taken_by = (manifest.fingerprint or {}).get("driver")
        if taken_by != self.name:
            raise SnapshotUnusable(f"snapshot was taken by the {taken_by} driver; this host runs {self.name}")

    def capacity(self) -> dict:
        return {"vcpus": self.vcpus, "memory_mb": self.memory_mb}

    # -- test hooks -------------------------------------------------------------------------

    def guest(self, sandbox_id: str) -> FakeGuest:
        return self._vm(sandbox_id).guest

    def fail_disk(self, sandbox_id: str, requests: int = 1) -> None:
        """``requests`` of its guest's disk requests failed on the host (the guest saw I/O errors)."""
        with self._lock:
            self._vm(sandbox_id).disk_errors += requests

    def crash(self, sandbox_id: str) -> None:
        """Its process died (or its boot was cut off): STOPPED until killed."""
        with self._lock:
            self._vm(sandbox_id, live=False).crashed = True

    def leave_process(self, sandbox_id: str) -> None:
        """As if the worker died between a save to disk and the hypervisor's exit."""
        vm = self._vm(sandbox_id)
        if not vm.status.offline:
            raise VMError(f"sandbox {sandbox_id} is not saved to disk")
        vm.stray_process = True

    # -- boot / kill ------------------------------------------------------------------------

    def boot(self, spec: BootSpec) -> VMInfo:
        self.net.check(spec.network)
        guest = FakeGuest()
        uses: tuple[str, ...] = ()
        if spec.layers:
            top = Path(spec.layers[-1])
            if not top.is_file():
                raise VMError(f"disk layer {top} does not exist")
            guest.disk = json.loads(top.read_text())
            uses = tuple(spec.layers)
        elif self.images is not None and spec.image not in self.images:
            raise ImageNotFound(f"image {spec.image!r} not built")
        return self._start(spec, guest, uses=uses, timings={"total_ms": 0.0, "attempt": 1})

    def _start(self, spec: BootSpec, guest: FakeGuest, uses=(), capture="", timings=None) -> VMInfo:
        if not valid_sandbox_id(spec.sandbox_id):
            raise VMError(f"invalid sandbox id {spec.sandbox_id!r}")
        with self._lock:
            if spec.sandbox_id in self.vms:
                raise VMError(f"sandbox {spec.sandbox_id} already exists")
            live = [vm.spec for vm in self.vms.values() if not vm.crashed and not vm.status.offline]
            if (sum(s.cpu_count for s in live) + spec.cpu_count > self.vcpus
                    or sum(s.memory_mb for s in live) + spec.memory_mb > self.memory_mb):
                raise VMError(f"no capacity for {spec.sandbox_id}: {self.capacity()} in use")
            network = self.net.attach(spec.sandbox_id, self._state_dir(spec.sandbox_id), spec.network)
            vm = _VM(spec=spec, status=VmLifecycle.RUNNING, network=network, pid=next(self._pids),
                     guest=guest, uses=tuple(uses), capture=capture, timings=dict(timings or {}))
            self.vms[spec.sandbox_id] = vm
            return self._info(vm)

    def kill(self, sandbox_id: str) -> bool:
        with self._lock:
            vm = self.vms.pop(sandbox_id, None)
            if vm is not None:
                self.net.detach(vm.network, self._state_dir(sandbox_id))
            if vm is not None and vm.capture:
                children = self.captures.get(vm.capture, set())
                children.discard(sandbox_id)
                if not children:
                    self.captures.pop(vm.capture, None)
            return vm is not None

    # -- queries ----------------------------------------------------------------------------

    def _vm(self, sandbox_id: str, live: bool = True) -> _VM:
        vm = self.vms.get(sandbox_id)
        if vm is None:
            raise VMNotFound(f"unknown sandbox {sandbox_id!r}")
        if live and vm.crashed:
            raise VMError(f"sandbox {sandbox_id}: its process is gone")
        return vm

    def _state_dir(self, sandbox_id: str) -> Path:
        return (self.home or Path("/nonexistent")) / "sandboxes" / sandbox_id  # never created

    def _info(self, vm: _VM, timings: dict | None = None) -> VMInfo:
        return VMInfo(sandbox_id=vm.spec.sandbox_id, pid=vm.pid if not vm.status.offline else 0,
                      envd_host=vm.network.host_address, envd_port=vm.network.host_port(ENVD_PORT),
                      accel=self.accel, state_dir=self._state_dir(vm.spec.sandbox_id),
                      timings=dict(vm.timings if timings is None else timings), status=vm.reported,
                      guest_host=vm.network.guest_host)

    def info(self, sandbox_id: str) -> VMInfo | None:
        with self._lock:
            vm = self.vms.get(sandbox_id)
            return None if vm is None or vm.crashed else self._info(vm)

    def list(self) -> list[VMInfo]:
        with self._lock:
            return [self._info(vm) for _, vm in sorted(self.vms.items()) if not vm.crashed]

    def inspect(self, sandbox_id: str) -> VMInspection:
        with self._lock:
            vm = self.vms.get(sandbox_id)
            if vm is None:
                return VMInspection(sandbox_id, VMStatus.UNKNOWN)
            status = vm.reported
            running = status in (VMStatus.RUNNING, VMStatus.PAUSED)
            return VMInspection(sandbox_id, status, pid=vm.pid if running else 0,
                                memory=status is VMStatus.SAVED and vm.memory_kept)

    def sandbox_ids(self) -> set[str]:
        with self._lock:
            return set(self.vms)

    def stray(self, sandbox_id: str | None = None) -> list[Leftover]:
        with self._lock:
            ids = [sandbox_id] if sandbox_id is not None else sorted(self.vms)
            found = [Leftover(STRAY_PROCESS, sid, sandbox_id=sid) for sid in ids
                     if sid in self.vms and self.vms[sid].stray_process]
            if sandbox_id is None:
                found += [Leftover(FORK_CAPTURE, c) for c, children in sorted(self.captures.items()) if not children]
            return found

    def remove_leftover(self, leftover: Leftover) -> bool:
        with self._lock:
            if leftover.kind == STRAY_PROCESS:
                vm = self.vms.get(leftover.sandbox_id)
                if vm is None or not vm.stray_process:
                    return False
                vm.stray_process = False
                return True
            if leftover.kind == FORK_CAPTURE and not self.captures.get(leftover.name, {"x"}):
                del self.captures[leftover.name]
                return True
            return False

    def files_in_use(self, sandbox_id: str | None = None) -> set[str]:
        with self._lock:
            return {path for sid, vm in self.vms.items() if sandbox_id in (None, sid) for path in vm.uses}

    def disk_errors(self, sandbox_id: str) -> int:
        with self._lock:
            vm = self.vms.get(sandbox_id)
            return vm.disk_errors if vm is not None and not vm.crashed else 0

    # -- lifecycle --------------------------------------------------------------------------

    def pause(self, sandbox_id: str) -> dict[str, float]:
        with self._lock:
            vm = self._vm(sandbox_id)
            if vm.status.offline:
                raise VMError(f"sandbox {sandbox_id} is paused to disk")
            vm.move(VmLifecycle.PAUSED)
            return {"pause_ms": 0.0}

    def pause_to_disk(self, sandbox_id: str, memory: bool = True) -> dict[str, float]:
        with self._lock:
            vm = self._vm(sandbox_id)
            if vm.status.offline:
                if vm.memory_kept == memory:
                    return {}
                raise VMError(f"sandbox {sandbox_id} is already paused to disk "
                              f"({'with' if vm.memory_kept else 'without'} its memory); resume it first")
            if not memory:
                vm.guest.memory = {}
            vm.move(VmLifecycle.PAUSED_DISK if memory else VmLifecycle.PAUSED_FS)
            return {"total_ms": 0.0}

    def resume(self, sandbox_id: str, memory: bool = True) -> VMInfo:
        with self._lock:
            vm = self._vm(sandbox_id)
            cold = vm.status is VmLifecycle.PAUSED_FS
            if not memory and vm.status is not VmLifecycle.RUNNING:
                cold = True
            if cold:
                vm.guest.memory = {}
                vm.pid = next(self._pids)
            elif vm.status.offline:
                vm.pid = next(self._pids)  # a new process, same id and port
            vm.move(VmLifecycle.RUNNING)
            return self._info(vm, {"total_ms": 0.0, **({"cold_boot": 1} if cold else {})})

    # -- snapshots --------------------------------------------------------------------------

    def snapshot(self, sandbox_id: str, dest_dir: Path, memory: bool = True,
                 with_base: bool = False) -> SnapshotManifest:
        """A fake snapshot's one layer is the whole disk: it is always its own base."""
        dest = Path(dest_dir).absolute()
        dest.mkdir(parents=True, exist_ok=True)
        if any(dest.iterdir()):
            raise VMError(f"snapshot dir {dest} is not empty")
        with self._lock:
            vm = self._vm(sandbox_id)
            if vm.status.offline:
                raise VMError(f"sandbox {sandbox_id} is paused to disk; resume it before a snapshot")
            disk = dest / "layer-0.json"
            disk.write_text(json.dumps(vm.guest.disk))
            vm.sealable = False
            files = {"memory_file": "", "device_state_file": ""}
            if memory:
                (dest / "memory.json").write_text(json.dumps(vm.guest.memory))
                (dest / "device.json").write_text("{}")
                files = {"memory_file": str(dest / "memory.json"), "device_state_file": str(dest / "device.json")}
            manifest = SnapshotManifest(
                dir=dest, layers=[str(disk)], cpu_count=vm.spec.cpu_count, memory_mb=vm.spec.memory_mb,
                disk_size_mb=vm.spec.disk_size_mb, machine={"image": vm.spec.image, "accel": self.accel},
                source_sandbox_id=sandbox_id, created_at=time.time(), timings={"pause_ms": 0.0, "total_ms": 0.0},
                fingerprint=self.fingerprint(), **files)
            manifest.save()
            return manifest

    def seal_layer(self, sandbox_id: str, dest: Path) -> SealedLayer:
        """A layer here is the whole guest disk as JSON (a boot reads the last layer's)."""
        dest = Path(dest).absolute()
        if dest.exists():
            raise VMError(f"layer {dest} already exists")
        with self._lock:
            vm = self._vm(sandbox_id)
            if vm.status.offline:
                raise VMError(f"sandbox {sandbox_id} is paused to disk; resume it before sealing a layer")
            if not vm.sealable:
                raise VMError(f"sandbox {sandbox_id}: its disk chain changed since it booted (a snapshot); "
                              "it cannot be sealed as a layer")
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(json.dumps(vm.guest.disk))
            vm.sealed = [*(vm.sealed or list(vm.spec.layers or [])), str(dest)]
            return SealedLayer(path=str(dest), layers=list(vm.sealed), size_bytes=dest.stat().st_size,
                               timings={"pause_ms": 0.0, "total_ms": 0.0})

    def export_saved(self, sandbox_id: str, dest_dir: Path) -> SnapshotManifest:
        with self._lock:
            vm = self._vm(sandbox_id)
            if vm.status is not VmLifecycle.PAUSED_DISK:
                raise VMError(f"sandbox {sandbox_id} is not paused to disk with its memory")
            dest = Path(dest_dir).absolute()
            dest.mkdir(parents=True, exist_ok=True)
            if any(dest.iterdir()):
                raise VMError(f"snapshot dir {dest} is not empty")
            (dest / "layer-0.json").write_text(json.dumps(vm.guest.disk))
            (dest / "memory.json").write_text(json.dumps(vm.guest.memory))
            (dest / "device.json").write_text("{}")
            manifest = SnapshotManifest(
                dir=dest, layers=[str(dest / "layer-0.json")], memory_file=str(dest / "memory.json"),
                device_state_file=str(dest / "device.json"), cpu_count=vm.spec.cpu_count,
                memory_mb=vm.spec.memory_mb, disk_size_mb=vm.spec.disk_size_mb,
                machine={"image": vm.spec.image, "accel": self.accel}, source_sandbox_id=sandbox_id,
                created_at=time.time(), fingerprint=self.fingerprint())
            manifest.save()
            return manifest

    def restore(self, manifest: SnapshotManifest, spec: BootSpec, template: bool = False,
                source_stays: bool = False) -> VMInfo:
        self.check_snapshot(manifest)
        self.net.check(spec.network)
        files = [*manifest.layers, manifest.memory_file, manifest.device_state_file]
        missing = [f for f in files if not f or not Path(f).is_file()]
        if missing:
            raise SnapshotUnusable(f"snapshot {manifest.dir} is missing {', '.join(missing) or 'its memory'}")
        guest = FakeGuest(memory=json.loads(Path(manifest.memory_file).read_text()),
                          disk=json.loads(Path(manifest.layers[-1]).read_text()))
        shape = BootSpec(spec.sandbox_id, image=manifest.machine.get("image", "base"), cpu_count=manifest.cpu_count,
                         memory_mb=manifest.memory_mb, disk_size_mb=manifest.disk_size_mb, network=spec.network)
        return self._start(shape, guest, uses=tuple(files),
                           timings={"total_ms": 0.0, **({"ram_copy_ms": 0.0} if template else {})})

    def fork(self, sandbox_id: str, count: int, child_ids: list[str] | None = None) -> list[VMInfo | Exception]:
        if count < 1:
            raise VMError("fork count must be >= 1")
        with self._lock:
            vm = self._vm(sandbox_id)
            if vm.status.offline:
                raise VMError(f"sandbox {sandbox_id} is paused to disk; resume it before a fork")
            tag = f"{sandbox_id}-{next(self._pids)}"
            ids = child_ids or [f"{sandbox_id[:48]}-f{tag[-6:]}-{i}" for i in range(count)]
            if len(ids) != count or len(set(ids)) != count:
                raise VMError("child_ids must be `count` distinct ids")
            captured = copy.deepcopy(vm.guest)
            vm.sealable = False
            self.captures[tag] = set()
            results: list[VMInfo | Exception] = []
            for cid in ids:
                try:
                    shape = BootSpec(cid, image=vm.spec.image, cpu_count=vm.spec.cpu_count,
                                     memory_mb=vm.spec.memory_mb, disk_size_mb=vm.spec.disk_size_mb,
                                     network=vm.spec.network)  # children inherit the policy
                    results.append(self._start(shape, copy.deepcopy(captured), capture=tag,
                                               timings={"total_ms": 0.0}))
                    self.captures[tag].add(cid)
                except VMError as exc:
                    results.append(exc)
            if not self.captures[tag]:
                del self.captures[tag]  # gone at once if every child failed
            return results

    def update_network(self, sandbox_id: str, network: NetworkSpec) -> None:
        with self._lock:
            vm = self._vm(sandbox_id, live=False)
            self.net.apply_egress(vm.network, network)  # checks first: nothing changes if refused
            vm.spec = replace(vm.spec, network=network)

    def adopt_snapshot(self, dir: Path) -> SnapshotManifest:
        manifest = SnapshotManifest.load(Path(dir))
        self.check_snapshot(manifest)
        return manifest
