"""The VM driver interface every hypervisor backend implements (QEMU microvm now, Firecracker later).

Why: node workers call these verbs without knowing which hypervisor runs; state lives in per-VM
state dirs so a restarted worker can list() and reattach to VMs that outlived it.
"""

from __future__ import annotations

import abc
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vmm.images import ImageNotFound  # re-exported: part of the driver contract

__all__ = ["BootSpec", "VMInfo", "VMDriver", "VMError", "ImageNotFound", "BootTimeout", "get_driver"]


class VMError(Exception):
    """A VM operation failed (QEMU refused to start, bad spec, host not capable...)."""


class BootTimeout(VMError):
    """envd did not answer /health before the deadline, even after one retry."""

    def __init__(self, message: str, console_tail: str = ""):
        super().__init__(message + (f"\n--- console tail ---\n{console_tail}" if console_tail else ""))
        self.console_tail = console_tail


@dataclass(frozen=True)
class BootSpec:
    sandbox_id: str
    image: str = "base"
    cpu_count: int = 2
    memory_mb: int = 512
    disk_size_mb: int = 2048


@dataclass
class VMInfo:
    sandbox_id: str
    pid: int
    envd_host: str
    envd_port: int
    accel: str
    state_dir: Path
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def envd_url(self) -> str:
        return f"http://{self.envd_host}:{self.envd_port}"

    def to_json(self) -> dict:
        d = asdict(self)
        d["state_dir"] = str(self.state_dir)
        return d


class VMDriver(abc.ABC):
    """One hypervisor backend. Implementations must be safe to use from several threads."""

    accel: str

    @abc.abstractmethod
    def boot(self, spec: BootSpec) -> VMInfo:
        """Cold-boots a VM and returns once envd answers GET /health with 204."""

    @abc.abstractmethod
    def kill(self, sandbox_id: str) -> bool:
        """Stops the VM and removes everything it left on the host; False if it did not exist."""

    @abc.abstractmethod
    def info(self, sandbox_id: str) -> VMInfo | None:
        """The running VM's info, or None if it is unknown or dead."""

    @abc.abstractmethod
    def list(self) -> list[VMInfo]:
        """All VMs found in state dirs whose process is alive (reattach after a worker restart)."""

    @abc.abstractmethod
    def capacity(self) -> dict:
        """Host resources for placement: {"vcpus": int, "memory_mb": int}."""


def get_driver(name: str, home: Path, images_dir: Path, host_address: str = "127.0.0.1", **options) -> VMDriver:
    """Driver factory; `name` is AENV_DRIVER ("qemu" | "firecracker"); `options` are
    driver-specific keyword arguments (e.g. QEMU's `boot_timeout`)."""
    if name == "qemu":
        from vmm.qemu import QemuDriver

        return QemuDriver(home=Path(home), images_dir=Path(images_dir), host_address=host_address, **options)
    if name == "firecracker":
        from vmm.firecracker import FirecrackerDriver

        return FirecrackerDriver(home=Path(home), images_dir=Path(images_dir), host_address=host_address)
    raise VMError(f"unknown VM driver {name!r} (expected 'qemu' or 'firecracker')")
