"""The lifecycle status a driver records for each of its VMs, and the one table of its legal moves.

Why: the QEMU driver's status used to be a free string set in five places and compared in
fourteen, so nothing stopped a verb from recording a move the VM cannot make (a VM saved
without its memory "paused" in memory again, say). As in Firecracker's `src/vmm`, the status is
an enum, every change goes through ``VmLifecycle.to`` (or ``MovesByTable.move`` on a record)
and a move missing from ``TRANSITIONS`` raises ``IllegalVmTransition``. The verbs still check
first and refuse with their own messages (what callers see); the table is the backstop that
makes a forgotten check fail loudly instead of corrupting a record.

The values are the ones ``vm.json`` has always held: VMs started by older code reattach.
``vmm.driver.VMStatus`` is something else: what a driver *reports* (it adds STOPPED and
UNKNOWN, which depend on the host, and folds both saved states into SAVED); ``reported``
maps one onto the other.
"""

from __future__ import annotations

import enum

from vmm.driver import VMStatus
from vmm.errors import VMError


class VmLifecycle(enum.StrEnum):
    RUNNING = "running"  # the guest runs (also: a boot or restore under way, its process not yet up)
    PAUSED = "paused"  # vCPUs stopped in memory; the hypervisor process stays
    PAUSED_DISK = "paused_disk"  # saved with its memory (device state + RAM file); no process
    PAUSED_FS = "paused_fs"  # saved as its disk only (guest synced, memory dropped); no process

    @property
    def offline(self) -> bool:
        """No hypervisor process belongs to the VM in this status (a saved VM)."""
        return self in OFFLINE

    @property
    def reported(self) -> VMStatus:
        """What info() / inspect() report for a VM whose process is as expected."""
        return _REPORTED[self]

    def can(self, new: VmLifecycle) -> bool:
        return new in TRANSITIONS[self]

    def to(self, new: VmLifecycle) -> VmLifecycle:
        """``new`` if the table allows the move, else IllegalVmTransition."""
        new = VmLifecycle(new)
        if not self.can(new):
            raise IllegalVmTransition(self, new)
        return new


_L = VmLifecycle

# The one table: status -> the statuses a verb may record next. Self-moves are listed where a
# verb really makes them (pause of a paused VM, resume of a running one: not errors).
TRANSITIONS: dict[VmLifecycle, frozenset[VmLifecycle]] = {
    # pause, pause_to_disk (with memory / filesystem-only), resume (a no-op cont)
    _L.RUNNING: frozenset({_L.RUNNING, _L.PAUSED, _L.PAUSED_DISK, _L.PAUSED_FS}),
    # resume (cont), pause again, pause_to_disk (with memory / filesystem-only),
    # resume(memory=False) dropping the memory first (QEMU: PAUSED -> PAUSED_FS -> RUNNING)
    _L.PAUSED: frozenset({_L.RUNNING, _L.PAUSED, _L.PAUSED_DISK, _L.PAUSED_FS}),
    # resume (incoming migration), resume(memory=False) dropping the saved memory first
    _L.PAUSED_DISK: frozenset({_L.RUNNING, _L.PAUSED_FS}),
    # resume (a cold boot on the kept disk)
    _L.PAUSED_FS: frozenset({_L.RUNNING}),
}

OFFLINE = frozenset({_L.PAUSED_DISK, _L.PAUSED_FS})

_REPORTED = {_L.RUNNING: VMStatus.RUNNING, _L.PAUSED: VMStatus.PAUSED,
             _L.PAUSED_DISK: VMStatus.SAVED, _L.PAUSED_FS: VMStatus.SAVED}


class IllegalVmTransition(VMError):
    """A verb tried to record a status the VM cannot move to from its current one (a bug in
    the verb's own checks: callers see it as the VMError it is)."""

    def __init__(self, current: VmLifecycle, new: VmLifecycle):
        super().__init__(f"illegal VM status move {current.value} -> {new.value}")
        self.current, self.new = current, new


class MovesByTable:
    """For a record with a ``status: VmLifecycle`` attribute: it is set once (construction)
    and changes only through ``move()``, which asks the table. A plain assignment raises
    AttributeError, so no code path records a status the table has not seen."""

    def __setattr__(self, name, value):
        if name == "status" and "status" in self.__dict__:
            raise AttributeError(f"{type(self).__name__}.status changes only through move()")
        super().__setattr__(name, value)

    def move(self, new: VmLifecycle) -> None:
        object.__setattr__(self, "status", VmLifecycle(self.status).to(new))
