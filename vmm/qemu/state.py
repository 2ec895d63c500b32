"""Per-VM state record (`<state_dir>/vm.json`) and process liveness checks.

Why: QEMU outlives the worker that started it; vm.json holds everything needed to reattach,
kill or (later) snapshot the VM, and liveness checks guard against PID reuse.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vmm.driver import valid_sandbox_id  # noqa: F401 - ids become path parts here
from vmm.net import ENVD_PORT, Attachment
from vmm.vm_status import MovesByTable, VmLifecycle


@dataclass
class VMState(MovesByTable):
    sandbox_id: str
    pid: int
    accel: str
    host_address: str
    host_port: int
    state_dir: str
    top: str
    qmp: str
    console: str
    pidfile: str
    ram: str
    image: str
    image_dir: str
    kernel: str
    initrd: str
    rootfs: str
    tools: str
    cpu_count: int
    memory_mb: int
    disk_size_mb: int
    argv: list[str]
    created_at: float
    timings: dict[str, float] = field(default_factory=dict)
    # Lifecycle (older records lack these and get the defaults).
    # vmm.vm_status: changes only through move() (its table); on disk the same strings as ever
    status: VmLifecycle = VmLifecycle.RUNNING
    tsc_khz: int = 0  # the guest's tsc_early_khz: must be identical on every destination
    resize: bool = False  # kernel cmdline flag of the first boot (kept for identical restores)
    qemu: str = "qemu-system-x86_64"
    ram_share: bool = True  # False: MAP_PRIVATE over a snapshot's RAM file (restored sandboxes)
    ram_owned: bool = True  # kill() deletes `ram` only if the sandbox owns it
    device_state: str = ""  # saved device state of a pause_to_disk (in state_dir)
    device_state_full_ram: bool = False  # that device state carries the RAM (x-ignore-shared off)
    device_state_qemu: str = ""  # the --version line of the QEMU that saved it (loads only in its release)
    chain: list[str] = field(default_factory=list)  # read-only disk layers under `top`, base first
    top_node: str = "root"  # QMP node name of the current top in the running QEMU
    generation: int = 0  # counts sealed layers, names the next top
    capture_ref: str = ""  # fork capture dir this sandbox was restored from (driver-owned)
    # seal_layer(): the chain that boots the last sealed state (base first, ending with the
    # caller's file) and the state-dir layer that file is a copy of ([] / "" before any seal).
    seal_chain: list[str] = field(default_factory=list)
    seal_source: str = ""
    forwards: dict[str, int] = field(default_factory=dict)  # guest port -> host port, besides envd's host_port
    # The VM's network: the backend it was attached by ("slirp" | "netns"), its slot while it
    # has one (netns; 0 = none: paused to disk or slirp) and its egress policy (NetworkSpec
    # JSON), re-applied whenever it gets a slot again.
    net_mode: str = "slirp"
    net_slot: int = 0
    network: dict = field(default_factory=dict)

    def __post_init__(self):
        # vm.json holds the plain string (older records too); an unknown one is not a record
        object.__setattr__(self, "status", VmLifecycle(self.status))

    def save(self) -> None:
        path = Path(self.state_dir) / "vm.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        os.replace(tmp, path)

    @classmethod
    def load(cls, state_dir: Path) -> "VMState | None":
        try:
            data = json.loads((Path(state_dir) / "vm.json").read_text())
            return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})
        except (OSError, ValueError, TypeError):
            return None


def read_pidfile(path: Path) -> int | None:
    try:
        return int(Path(path).read_text().strip())
    except (OSError, ValueError):
        return None


def process_alive(pid: int, marker: str) -> bool:
    """True if pid runs, is not a zombie, and its command line contains marker (no PID reuse)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().decode(errors="replace")
    except OSError:
        return False
    if stat.rsplit(")", 1)[-1].split()[0] in ("Z", "X"):
        reap(pid)
        return False
    return marker in cmdline


def reap(pid: int) -> None:
    """Collects a dead VM process if it happens to be our child; otherwise init reaps it."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def other_forwards(network: Attachment) -> dict[str, int]:
    """vm.json's record of a VM's forwards besides envd's (host_port): guest port (a string:
    JSON keys) -> host port."""
    return {str(guest): host for guest, host in network.forwards.items() if guest != ENVD_PORT}
