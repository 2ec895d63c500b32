"""The errors every VM driver raises (re-exported by vmm.driver, where callers import them).

Why a module of its own: the network backends (vmm.net) raise them too, and vmm.driver
imports vmm.net for BootSpec.network; errors that live apart keep that one-way.
"""

from __future__ import annotations


class VMError(Exception):
    """A VM operation failed (QEMU refused to start, bad spec, host not capable...)."""


class VMNotFound(VMError):
    """A verb named a sandbox id the driver has no VM for (kill() returns False instead,
    info() None and inspect() VMStatus.UNKNOWN)."""


class BootTimeout(VMError):
    """envd did not answer /health before the deadline, even after one retry."""

    def __init__(self, message: str, console_tail: str = ""):
        super().__init__(message + (f"\n--- console tail ---\n{console_tail}" if console_tail else ""))
        self.console_tail = console_tail


class StateLoadTimeout(VMError):
    """A saved state (a pause's or a snapshot's device state) did not finish loading before
    its deadline: a host too loaded to schedule the incoming QEMU. The guest never ran, so
    the saved state is intact and the new process was stopped: later, or on another node,
    the same start may work (503, like a full node)."""


class MemoryLost(VMError):
    """A resume failed after the guest had run on the only copy of its memory (envd silent,
    QEMU gone): loading the saved device state again would pair it with a memory the guest
    changed since, so the memory was given up and the disk kept. The VM is paused without its
    memory: its next resume cold-boots on its disk."""


class SnapshotUnusable(VMError):
    """A snapshot cannot be restored on this host: it was taken by another driver or under
    another accelerator, or something it needs (its files, the image build it was taken
    on) is not here. The message names what."""


class UnsupportedNetworkPolicy(VMError):
    """The VM's network backend cannot enforce what the NetworkSpec asks (e.g. an egress
    restriction under slirp, which cannot filter); refused rather than silently ignored."""


class HostMemoryFull(VMError):
    """The host cannot hold another guest's RAM without eating its own headroom (QEMU: the
    tmpfs guest RAM files live in has less free than the guest's memory plus the headroom):
    refused before anything starts, because a guest whose tmpfs fills up dies."""


class HostDiskFull(VMError):
    """The node's disk (its AENV_HOME) has no room for what the operation must write (e.g. a
    pause's device state): nothing changed, the VM runs on as it was; another node, or later,
    may do it (503, like HostMemoryFull)."""
