"""Assembles the QEMU microvm command line (pure function, unit-tested).

Why in one place: pause/snapshot/fork restore must reuse the exact device set, so the command
line is derived only from the recorded state (qemu-feasibility §4, §9-9). RAM is a shared file on
/dev/shm (the memory snapshot for x-ignore-shared), the balloon reports free pages, and the root
disk is a qcow2 top over the template's read-only base.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from vmm.hostinfo import lpj

if TYPE_CHECKING:
    from vmm.net.backend import Attachment

QEMU = "qemu-system-x86_64"


@dataclass(frozen=True)
class VMPaths:
    """Where one VM's files live (all recorded in vm.json)."""

    state_dir: Path
    top: Path
    qmp: Path
    console: Path
    pidfile: Path
    ram: Path

    @classmethod
    def for_sandbox(cls, state_dir: Path, sandbox_id: str, shm_dir: Path = Path("/dev/shm")) -> "VMPaths":
        return cls(state_dir=state_dir, top=state_dir / "top.qcow2", qmp=state_dir / "qmp.sock",
                   console=state_dir / "console.log", pidfile=state_dir / "qemu.pid",
                   ram=shm_dir / f"aenv-{sandbox_id}.ram")


# Fewer wakeups of an idle guest (issue 26; bench/idle.py, docs/benchmarks.md "Idle guests"): under
# TCG every guest timer interrupt costs the host emulated kernel code. Proactive compaction
# (kcompactd every 0.5 s), the soft/hard lockup watchdogs (a timer per vCPU every 4 s, and false
# "soft lockup" reports when the host is busy), pressure-stall averaging (every 2 s) and the
# per-CPU vmstat fold (1 s -> 10 s) are off or slowed; on-demand compaction still runs.
IDLE_KERNEL_ARGS = ("sysctl.vm.compaction_proactiveness=0", "nowatchdog", "psi=0", "sysctl.vm.stat_interval=10")


def kernel_cmdline(tsc_khz: int, resize: bool = False, net_mode: str = "slirp") -> str:
    """Guest kernel arguments; the TSC pair prevents the microvm calibration hang, and
    tsc=reliable keeps the TSC as clocksource with several vCPUs (under TCG the boot-time sync
    check fails, the kernel falls back to jiffies and the guest clock then loses time when the
    host is busy). ``aenv.net=`` tells the guest init which addresses its network has (the
    Debian kernel has no CONFIG_IP_PNP, so ``ip=`` would do nothing). ``IDLE_KERNEL_ARGS``
    quieten an idle guest; they act at boot, so a template snapshot or pause image keeps the
    settings of the boot it was taken from."""
    args = ["console=ttyS0", "panic=-1", "quiet", "net.ifnames=0", "8250.nr_uarts=1",
            f"tsc_early_khz={tsc_khz}", f"lpj={lpj(tsc_khz)}", "tsc=reliable", f"aenv.net={net_mode}",
            *IDLE_KERNEL_ARGS]
    if resize:
        args.append("aenv.resize=1")
    return " ".join(args)


def accel_args(accel: str) -> list[str]:
    if accel == "kvm":
        return ["-accel", "kvm", "-cpu", "host"]
    if accel == "tcg":
        return ["-accel", "tcg,tb-size=64", "-cpu", "max"]
    raise ValueError(f"unknown accel {accel!r}")


# The guest's MAC, the same in every slot (a snapshot's ABI; see vmm.net.slots).
GUEST_MAC = "02:fc:00:00:00:05"


def netdev(network: "Attachment") -> str:
    """QEMU's network backend for a vmm.net Attachment. netns: ``tap0`` of the slot QEMU is
    started in (no vhost: this kernel has no vhost-net; no script: the slot made the tap).
    slirp: user-mode networking with ``restrict=on`` (the guest reaches neither the host nor
    anything beyond it) and a hostfwd per forwarded guest port, which still works."""
    if network.backend == "netns":
        return "tap,id=net0,ifname=tap0,script=no,downscript=no"
    if network.backend != "slirp":
        raise ValueError(f"no QEMU network device for the {network.backend!r} network backend")
    forwards = ",".join(f"hostfwd=tcp:{network.host_address}:{host}-:{guest}"
                        for guest, host in sorted(network.forwards.items()))
    return f"user,id=net0,restrict=on,{forwards}"


def qemu_command(*, paths: VMPaths, kernel: Path, initrd: Path, tools: Path, accel: str, cpu_count: int,
                 memory_mb: int, network: "Attachment", tsc_khz: int, resize: bool = False,
                 qemu: str = QEMU, ram_share: bool = True, incoming: bool = False) -> list[str]:
    """argv that boots a daemonized microvm on `network` (its forwarded guest ports, envd's included).

    A restore/resume destination uses the same arguments except `ram_share` (False: MAP_PRIVATE
    copy-on-write over a snapshot's RAM file), the top in `paths`, the forwards' host ports and `incoming`
    (adds `-S -incoming defer`; the device state then comes from QMP migrate-incoming).
    """
    if cpu_count < 1 or memory_mb < 64:
        raise ValueError("cpu_count must be >= 1 and memory_mb >= 64")
    share = "on" if ram_share else "off"
    argv = [
        qemu, "-name", f"aenv-{paths.state_dir.name}",
        "-M", "microvm,memory-backend=ram0", *accel_args(accel),
        "-m", f"{memory_mb}M", "-smp", str(cpu_count),
        "-object", f"memory-backend-file,id=ram0,size={memory_mb}M,mem-path={paths.ram},share={share}",
        "-nodefaults", "-no-user-config", "-no-reboot", "-display", "none",
        "-serial", f"file:{paths.console}",
        "-qmp", f"unix:{paths.qmp},server=on,wait=off",
        "-daemonize", "-pidfile", str(paths.pidfile),
        "-kernel", str(kernel), "-initrd", str(initrd), "-append", kernel_cmdline(tsc_khz, resize, network.backend),
        "-blockdev", f"driver=file,node-name=rootfile,filename={paths.top}",
        "-blockdev", "driver=qcow2,node-name=root,file=rootfile",
        "-device", "virtio-blk-device,drive=root,id=vblk0",
        "-blockdev", f"driver=file,node-name=toolsfile,filename={tools},read-only=on",
        "-blockdev", "driver=raw,node-name=tools,file=toolsfile,read-only=on",
        "-device", "virtio-blk-device,drive=tools,id=vblk1",
        "-netdev", netdev(network),
        "-device", f"virtio-net-device,netdev=net0,id=vnet0,mac={GUEST_MAC}",
        "-device", "virtio-balloon-device,free-page-reporting=on,id=balloon0",
    ]
    if incoming:  # -S: stays stopped after loading, so the driver decides when it runs
        argv += ["-S", "-incoming", "defer"]
    return argv
