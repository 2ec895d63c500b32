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

Modules: driver (QemuDriver: construction, fingerprint, boot, kill, queries), lifecycle (pause /
resume, to disk and back), ram_moves (a saved VM's RAM to disk in the background; its disk
copy deleted on resume), snapshots (snapshot / restore / fork, fork captures), live_capture
(a snapshot's or fork's memory captured while the guest runs: pre-copy or background-snapshot
into a vessel QEMU; uffd probes the kernel's userfaultfd), host (inspect,
leftovers, files in use, adopting a downloaded snapshot for reconcile and the stores), process
(spawn and health plumbing), cmdline (the pure command-line builder), qmp, state (vm.json; its
status moves by vmm.vm_status's table), ramfile, accel (KVM probe). Only this package knows
QEMU's files and tools; the rest of aenv uses the VMDriver verbs.
"""

from vmm.qemu.driver import QemuDriver
from vmm.qemu.process import DEFAULT_BOOT_TIMEOUT, cmdline_digest, console_tail, envd_healthy, qemu_version

__all__ = ["QemuDriver", "DEFAULT_BOOT_TIMEOUT", "cmdline_digest", "console_tail", "envd_healthy", "qemu_version"]
