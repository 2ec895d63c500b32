"""The VM driver interface every hypervisor backend implements (QEMU microvm now, Firecracker later).

Why: node workers call these verbs without knowing which hypervisor runs; state lives in per-VM
state dirs so a restarted worker can list() and reattach to VMs that outlived it.
"""

from __future__ import annotations

import abc
import enum
import importlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vmm.errors import (BootTimeout, HostDiskFull, HostMemoryFull,  # noqa: F401 - re-exported: callers import them here
                        MemoryLost, SnapshotUnusable, StateLoadTimeout, UnsupportedNetworkPolicy, VMError, VMNotFound)
from vmm.images import ImageNotFound  # re-exported: part of the driver contract
from vmm.net.spec import NetworkSpec

__all__ = ["BootSpec", "SealedLayer", "VMInfo", "VMStatus", "VMInspection", "Leftover", "SnapshotManifest", "VMDriver", "VMError",
           "VMNotFound", "ImageNotFound", "BootTimeout", "SnapshotUnusable", "StateLoadTimeout",
           "UnsupportedNetworkPolicy", "HostMemoryFull", "HostDiskFull",
           "NetworkSpec", "get_driver", "register_driver", "driver_names", "valid_sandbox_id"]


SANDBOX_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def valid_sandbox_id(sandbox_id: str) -> bool:
    """Ids become path parts and file names: no slashes, no dot-dot."""
    return bool(SANDBOX_ID.match(sandbox_id)) and ".." not in sandbox_id


class VMStatus(enum.StrEnum):
    """What a driver knows of one VM (inspect(); VMInfo.status is one of the first three)."""

    RUNNING = "running"  # the guest runs
    PAUSED = "paused"  # vCPUs stopped in memory: the hypervisor process stays (pause())
    SAVED = "saved"  # paused to disk (pause_to_disk, with its memory or filesystem-only): no process
    STOPPED = "stopped"  # something is left but cannot run or resume: its process died, a boot cut off
    UNKNOWN = "unknown"  # nothing of this id on the host


@dataclass(frozen=True)
class VMInspection:
    sandbox_id: str
    status: VMStatus
    pid: int = 0  # the hypervisor process while RUNNING / PAUSED
    memory: bool = False  # SAVED with its memory (a resume continues its processes), else disk only


@dataclass(frozen=True)
class Leftover:
    """Something a driver left on the host that no VM needs (found by stray(), removed by gc()):
    e.g. a hypervisor process of a VM recorded as saved to disk (a worker killed between the
    save and the process's exit), or a fork capture no child uses any more."""

    kind: str  # "process", "fork capture", ... (the driver's words)
    name: str  # what it is: a sandbox id, a capture's name
    sandbox_id: str = ""  # the VM it belongs to, if any


@dataclass(frozen=True)
class BootSpec:
    sandbox_id: str
    image: str = "base"
    cpu_count: int = 2
    memory_mb: int = 512
    disk_size_mb: int = 2048
    # Read-only qcow2 disk layers, base first (a filesystem-only snapshot): the VM cold-boots
    # `image`'s kernel on a new writable top over layers[-1] instead of over the image's rootfs.
    layers: list[str] | None = None
    # What the VM's network must be (forwarded guest ports, egress policy): the driver's network
    # backend attaches it, or refuses with UnsupportedNetworkPolicy what it cannot enforce.
    network: NetworkSpec = field(default_factory=NetworkSpec)


@dataclass
class VMInfo:
    sandbox_id: str
    pid: int
    envd_host: str
    envd_port: int
    accel: str
    state_dir: Path
    timings: dict[str, float] = field(default_factory=dict)
    status: VMStatus = VMStatus.RUNNING  # RUNNING | PAUSED (in memory) | SAVED (to disk: pid is 0)
    # Where any guest TCP port is reachable from the node (the netns backend: the slot
    # address); "" when only envd's port is forwarded (restricted slirp).
    guest_host: str = ""

    @property
    def envd_url(self) -> str:
        return f"http://{self.envd_host}:{self.envd_port}"

    def to_json(self) -> dict:
        d = asdict(self)
        d["state_dir"] = str(self.state_dir)
        return d


@dataclass
class SnapshotManifest:
    """Everything needed to restore a snapshot, written as `<dir>/manifest.json`.

    Ownership: the snapshot dir (`dir`, holding the sealed layer copies, memory file and device
    state) belongs to whoever asked for the snapshot. It must outlive every sandbox restored from
    it (they map its RAM file copy-on-write and read its layers); kill() of those sandboxes never
    deletes it. `layers[0]` is the template base (immutable, owned by the image cache).
    """

    dir: Path
    layers: list[str]  # read-only disk layers, base first; a restore stacks a new top on the last
    memory_file: str  # guest RAM image (sparse); restores map it share=off (MAP_PRIVATE)
    device_state_file: str  # device state (x-ignore-shared migration stream)
    cpu_count: int
    memory_mb: int
    disk_size_mb: int
    machine: dict  # the exact QEMU config a destination must reuse (kernel, initrd, tools, accel, tsc...)
    source_sandbox_id: str = ""
    created_at: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)
    fingerprint: dict = field(default_factory=dict)  # the driver's fingerprint() when it was taken

    def to_json(self) -> dict:
        d = asdict(self)
        d["dir"] = str(self.dir)
        return d

    def save(self) -> Path:
        path = Path(self.dir) / "manifest.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2))
        os.replace(tmp, path)
        return path

    @classmethod
    def from_json(cls, data: dict) -> "SnapshotManifest":
        data = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        data["dir"] = Path(data["dir"])
        return cls(**data)

    @classmethod
    def load(cls, dir: Path) -> "SnapshotManifest":
        return cls.from_json(json.loads((Path(dir) / "manifest.json").read_text()))


@dataclass(frozen=True)
class SealedLayer:
    """What seal_layer() made: the layer file, the whole chain to boot that disk state from
    (base first, ending with ``path``), its allocated size and the timings (ms)."""

    path: str
    layers: list[str]
    size_bytes: int
    timings: dict[str, float] = field(default_factory=dict)


class VMDriver(abc.ABC):
    """One hypervisor backend. Implementations must be safe to use from several threads.

    Errors: every verb raises VMError (or a subclass); a verb on an id the driver has no VM for
    raises VMNotFound, except kill() (False), info() (None) and inspect() (UNKNOWN). A verb the
    VM's state does not allow raises VMError: pause / snapshot / fork of a SAVED VM; pause_to_disk
    of a VM saved the other way (with / without its memory). Repeating a state is not an error: pause of a PAUSED
    VM, pause_to_disk of one already saved that way ({}), resume of a RUNNING VM.
    """

    name: str  # its registry name (AENV_DRIVER)
    accel: str

    @abc.abstractmethod
    def fingerprint(self) -> dict:
        """What a memory snapshot taken by this driver must match to be restored by it: a
        JSON-able dict, equal across instances and processes on one host setup, always with
        "driver" (the registry name). Template snapshots are cached under it (QEMU: driver,
        accelerator, QEMU version, the command-line builder's source)."""

    @abc.abstractmethod
    def check_snapshot(self, manifest: "SnapshotManifest") -> None:
        """Raises SnapshotUnusable unless this host has what a restore of ``manifest`` needs
        from outside the snapshot's own dir (the image build it was taken on, the same
        driver and accelerator). Cheap: looks at files, starts nothing."""

    @abc.abstractmethod
    def boot(self, spec: BootSpec) -> VMInfo:
        """Cold-boots a VM and returns once envd answers GET /health with 204."""

    @abc.abstractmethod
    def kill(self, sandbox_id: str) -> bool:
        """Stops the VM and removes everything it owns on the host: state dir (top, sealed
        layers, saved device state), its RAM file (not a snapshot's RAM file it was restored
        from) and, for the last child of a fork, the fork's capture. Caller-owned snapshot dirs
        are never touched. False if it did not exist."""

    @abc.abstractmethod
    def info(self, sandbox_id: str) -> VMInfo | None:
        """The VM's info (running, paused or saved), or None if it is unknown or dead."""

    @abc.abstractmethod
    def list(self) -> list[VMInfo]:
        """All VMs found in state dirs whose process is alive, plus VMs paused to disk
        (reattach after a worker restart)."""

    def console_path(self, sandbox_id: str) -> Path | None:
        """The file the VM's serial console is written to (the guest kernel, its init and
        envd log there), for the node's log collector; it begins anew with each VM process
        and goes with the VM. None: unknown VM, or a driver that keeps no console."""
        return None

    def trim_console(self, sandbox_id: str, keep_bytes: int) -> int:
        """Gives back the disk of the VM's console file but its newest ``keep_bytes`` (a guest
        may write its serial port without end); the bytes kept keep their offsets, and what
        was trimmed reads as a hole (skip it with ``SEEK_DATA``). Returns the bytes freed."""
        return 0

    # -- what reconcile and the snapshot stores need (no caller knows the driver's files) ----

    @abc.abstractmethod
    def inspect(self, sandbox_id: str) -> VMInspection:
        """The VM's real state on this host, never raising for an unknown id (UNKNOWN). Cheap:
        reads records and checks processes, sends nothing to the guest."""

    @abc.abstractmethod
    def sandbox_ids(self) -> set[str]:
        """Every id the driver holds anything of on this host (inspect() is not UNKNOWN),
        including VMs that cannot run any more (STOPPED: kill() removes what is left)."""

    @abc.abstractmethod
    def stray(self, sandbox_id: str | None = None) -> list[Leftover]:
        """What is left on the host that no VM needs (see Leftover): of one VM, or all of
        them plus the driver's own leftovers. Changes nothing."""

    @abc.abstractmethod
    def remove_leftover(self, leftover: Leftover) -> bool:
        """Removes one thing stray() found, if it is still stray; False if it was not."""

    def settle(self, timeout: float | None = None) -> bool:
        """Waits for work the driver still does after a verb has answered (QEMU: paused VMs'
        memory moving from tmpfs to disk). True once none is left, False on ``timeout``."""
        return True

    def gc(self, sandbox_id: str | None = None) -> list[Leftover]:
        """Removes what stray() finds; returns what was removed."""
        return [left for left in self.stray(sandbox_id) if self.remove_leftover(left)]

    @abc.abstractmethod
    def files_in_use(self, sandbox_id: str | None = None) -> set[str]:
        """Absolute paths of host files the driver's VMs use, their own and others' (the
        disk layers and memory files of the snapshots they were restored from): a snapshot
        cache must not delete those. ``sandbox_id``: that VM's only."""

    def disk_errors(self, sandbox_id: str) -> int:
        """How many of the VM's disk requests failed on the host since its process started:
        the guest got an I/O error for each (a lazily read disk whose store went away, a
        failing host disk). 0 when it has none, does not run, or does not answer now."""
        return 0

    @abc.abstractmethod
    def adopt_snapshot(self, dir: Path) -> SnapshotManifest:
        """Makes a snapshot copied to this host from another one restorable here. ``dir``
        holds its files and a manifest.json whose paths are already this host's
        (``manifest.dir`` is where the files will live; ``dir`` may be a staging dir renamed
        to it afterwards). Checks what the snapshot needs from this host (check_snapshot) and
        re-links its files among themselves (QEMU: each disk layer's backing file). Raises
        SnapshotUnusable; returns the manifest."""

    # -- lifecycle ----------------------------------------------------------------------------
    # Every verb returns or records timings in ms. Guest clocks stop while paused and children
    # inherit the parent's clock: the caller re-syncs it through envd /init afterwards.

    @abc.abstractmethod
    def pause(self, sandbox_id: str) -> dict[str, float]:
        """Freezes the vCPUs in memory (the QEMU process stays; TCP connections survive)."""

    @abc.abstractmethod
    def pause_to_disk(self, sandbox_id: str, memory: bool = True) -> dict[str, float]:
        """Stops the hypervisor process; info()/list() then report status SAVED with pid 0.
        memory=True: the device state is saved into the state dir and the RAM file stays as the
        memory snapshot (resume continues every process). memory=False: the guest's filesystems
        are synced first (if that fails, nothing changes and VMError is raised), then only the
        disk (top + chain) is kept and the RAM file is deleted; resume cold-boots the guest on
        that disk (files intact, processes gone)."""

    @abc.abstractmethod
    def resume(self, sandbox_id: str, memory: bool = True) -> VMInfo:
        """Continues a paused VM (any kind of pause); returns once envd answers /health.
        After a pause_to_disk the VM runs in a new process (same id, same envd port); after a
        filesystem-only one it is a cold boot (timings["cold_boot"] == 1). ``memory=False``
        discards a memory snapshot and cold-boots on the disk instead (E2B's "reboot"
        resume: processes are gone, writes the guest had not flushed may be lost)."""

    @abc.abstractmethod
    def snapshot(self, sandbox_id: str, dest_dir: Path, memory: bool = True,
                 with_base: bool = False) -> SnapshotManifest:
        """Captures disk, memory and device state into dest_dir (owned by the caller) during a
        brief pause; the VM then continues on a new empty disk top. timings["pause_ms"] is the
        window the guest was stopped. memory=False: the guest's filesystems are synced first and
        only the disk layers are captured (memory_file and device_state_file are ""); start
        sandboxes from it with boot(BootSpec(..., layers=manifest.layers)). ``with_base``: the
        base layer is one of the snapshot's own files too (hard-linked where it can be), so it
        needs nothing of this node's images but the kernel, initrd and tools drive (a built
        template, whose base is an image only this node pulled)."""

    @abc.abstractmethod
    def seal_layer(self, sandbox_id: str, dest: Path) -> "SealedLayer":
        """Freezes what the running VM wrote to its disk since it booted (or since its previous
        seal) as one read-only disk layer written to ``dest`` (owned by the caller, like the
        layers it stacks on, which must stay where they are). The guest's filesystems are synced
        first (a failure raises VMError and changes nothing); the VM stops only for the switch
        and then continues on a new empty top. ``boot(BootSpec(image=<same>,
        layers=sealed.layers))`` starts a VM on exactly that disk state: the template builder
        seals one layer per step this way. A VM whose disk chain was changed otherwise since
        (a snapshot) or whose previous seal failed is refused (VMError)."""

    @abc.abstractmethod
    def export_saved(self, sandbox_id: str, dest_dir: Path) -> SnapshotManifest:
        """A VM paused to disk with its memory, as a self-contained snapshot in ``dest_dir``
        (the caller's; every disk layer, the RAM and the device state are its own files), so
        ``restore(manifest, BootSpec(<the same id>), template=True)`` on another host continues
        it where it paused: how a paused sandbox moves when its node is gone. The VM is
        unchanged. Raises VMError for a VM that is not saved with its memory, or whose memory
        cannot move yet (the driver says why)."""

    @abc.abstractmethod
    def restore(self, manifest: SnapshotManifest, spec: BootSpec, template: bool = False,
                source_stays: bool = False) -> VMInfo:
        """A new sandbox `spec.sandbox_id` running from the snapshot (copy-on-write memory and
        disk); returns once envd answers /health. Only spec.sandbox_id is used: cpu, memory
        and image come from the manifest. ``template=True``: the snapshot is a booted
        template (vmm.templates) that many sandboxes start from and then live on
        independently; the driver may give the VM its own copy of the memory up front so
        its later pause / snapshot / fork stay as cheap as a booted VM's (QEMU copies the
        RAM file). ``source_stays``: the snapshot outlives the VM (a template's, not a moved
        sandbox's own pause image), so the VM may read its memory from it for good, e.g.
        while a copy is not there yet. Raises SnapshotUnusable for a snapshot of another
        driver or accelerator."""

    @abc.abstractmethod
    def fork(self, sandbox_id: str, count: int, child_ids: list[str] | None = None) -> list[VMInfo | Exception]:
        """One capture of the running VM, then `count` independent children restored in
        parallel. The parent keeps its id and port. A failed child is returned as its exception
        and does not affect its siblings. The capture is owned by the driver and deleted when
        the last child is killed."""

    @abc.abstractmethod
    def update_network(self, sandbox_id: str, network: NetworkSpec) -> None:
        """Replaces the VM's egress policy (E2B's PUT /sandboxes/{id}/network): applied at once
        to a VM that has a network now, recorded for one paused to disk (its resume applies
        it); kept by its snapshots and inherited by its fork children. Raises VMNotFound, or
        UnsupportedNetworkPolicy if the backend cannot enforce it (nothing changes then)."""

    @abc.abstractmethod
    def capacity(self) -> dict:
        """Host resources for placement: {"vcpus": int, "memory_mb": int}."""


# name -> factory(home=, images_dir=, host_address=, **options), or "module:attribute" of one,
# imported on first use: importing this module loads no backend (and no backend cycle).
_REGISTRY: dict[str, Callable[..., VMDriver] | str] = {
    "qemu": "vmm.qemu:QemuDriver",
    "firecracker": "vmm.firecracker:FirecrackerDriver",
    "fake": "vmm.fake:FakeDriver",  # in memory, no processes: tests and the driver contract
}


def register_driver(name: str, factory: Callable[..., VMDriver] | str) -> None:
    """Adds (or replaces) a driver: ``factory`` is called like ``get_driver`` calls it, or
    is a "module:attribute" path to such a callable."""
    _REGISTRY[name] = factory


def driver_names() -> list[str]:
    return sorted(_REGISTRY)


def get_driver(name: str, home: Path, images_dir: Path, host_address: str = "127.0.0.1", **options) -> VMDriver:
    """The driver registered as `name` (AENV_DRIVER: "qemu", "firecracker", ...); `options` are
    driver-specific keyword arguments (e.g. QEMU's `boot_timeout`)."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise VMError(f"unknown VM driver {name!r} (expected one of {', '.join(map(repr, driver_names()))})") from None
    if isinstance(factory, str):
        module, _, attribute = factory.partition(":")
        factory = getattr(importlib.import_module(module), attribute)
    return factory(home=Path(home), images_dir=Path(images_dir), host_address=host_address, **options)
