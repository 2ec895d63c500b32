"""The sandbox state machine: every state, the one table of legal transitions, and the
named sets derived from it.

Why one table: the lifecycle code, the node's reconcile, the data plane, placement and
the dashboard each need to know which state may follow which and what a state means
(routable? reserving capacity? shown as "running" or "paused" by the E2B API?). Spelled
once here, ``sandboxes.transitions.transition()`` refuses any write the table does not
allow, the dashboard asks it which actions a state allows, and a test walks it whole.
Pure: no models, no I/O, so every layer (``nodes`` included) may import it.
"""
from __future__ import annotations

from dataclasses import dataclass

from django.db import models


class SandboxState(models.TextChoices):
    CREATING = "creating"
    RUNNING = "running"
    PAUSING = "pausing"
    PAUSED = "paused"
    RESUMING = "resuming"
    SNAPSHOTTING = "snapshotting"
    FORKING = "forking"
    KILLING = "killing"
    KILLED = "killed"
    ERROR = "error"


S = SandboxState


@dataclass(frozen=True)
class Operation:
    """One lifecycle operation: it may start from ``start`` (into ``in_flight``, or
    straight to its outcome when there is no in-flight state), then ends in
    ``success`` or one of ``failure``."""

    name: str
    start: frozenset[str]
    in_flight: str | None
    success: str
    failure: frozenset[str] = frozenset()

    @property
    def edges(self) -> frozenset[tuple[str, str]]:
        first = self.in_flight or self.success
        steps = {(s, first) for s in self.start}
        if self.in_flight:
            steps |= {(self.in_flight, end) for end in {self.success, *self.failure}}
        return frozenset(steps)


# States the E2B API still shows, and how: everything else (killed, error) is gone.
E2B_VIEW: dict[str, str] = {
    S.CREATING: "running", S.RUNNING: "running", S.SNAPSHOTTING: "running", S.FORKING: "running",
    S.RESUMING: "running", S.KILLING: "running", S.PAUSING: "paused", S.PAUSED: "paused",
}
LIVE = frozenset(E2B_VIEW)
DEAD = frozenset({S.KILLED, S.ERROR})

_new = frozenset({""})  # a row being inserted has no state yet

TRANSITIONS: dict[str, Operation] = {op.name: op for op in (
    # create (also a restore from a snapshot, and each child of a fork)
    Operation("create", start=_new, in_flight=S.CREATING, success=S.RUNNING, failure=frozenset({S.ERROR})),
    # a kill may start from any live state but its own; the node's answer only
    # changes whether the kill is recorded confirmed
    Operation("kill", start=LIVE - {S.KILLING}, in_flight=S.KILLING, success=S.KILLED),
    # the node answered a failed pause: its driver continued the VM
    Operation("pause", start=frozenset({S.RUNNING}), in_flight=S.PAUSING, success=S.PAUSED,
              failure=frozenset({S.RUNNING})),
    # resume, connect and auto-resume; a failed resume leaves the memory snapshot paused
    Operation("resume", start=frozenset({S.PAUSED}), in_flight=S.RESUMING, success=S.RUNNING,
              failure=frozenset({S.PAUSED})),
    # a failed capture continues the VM (running), or nobody knows what it is (error)
    Operation("snapshot", start=frozenset({S.RUNNING}), in_flight=S.SNAPSHOTTING, success=S.RUNNING,
              failure=frozenset({S.RUNNING, S.ERROR})),
    Operation("fork", start=frozenset({S.RUNNING}), in_flight=S.FORKING, success=S.RUNNING,
              failure=frozenset({S.RUNNING, S.ERROR})),
)}

# A node worker that restarts settles each row to what its VM really is (agent.reconcile,
# agent.reconcile_snapshots): the only writes that do not follow an operation's own path.
RECONCILE: dict[str, frozenset[str]] = {
    S.CREATING: frozenset({S.ERROR}),
    S.KILLING: frozenset({S.KILLED}),
    S.PAUSING: frozenset({S.PAUSED, S.RUNNING, S.ERROR}),
    S.RESUMING: frozenset({S.PAUSED, S.ERROR}),
    S.RUNNING: frozenset({S.PAUSED, S.ERROR}),
    S.PAUSED: frozenset({S.ERROR}),
    S.SNAPSHOTTING: frozenset({S.RUNNING, S.ERROR}),
    S.FORKING: frozenset({S.RUNNING, S.ERROR}),
}
# A node declared dead (no heartbeat for AENV_NODE_LOST_AFTER, lifecycle.lost): what ran
# or was on its way there is lost; a kill is as done as it will get; paused ones stay paused.
LOST: dict[str, frozenset[str]] = {
    **{state: frozenset({S.ERROR}) for state in (S.CREATING, S.RUNNING, S.PAUSING, S.RESUMING, S.SNAPSHOTTING,
                                                 S.FORKING)},
    S.KILLING: frozenset({S.KILLED}),
}
OPERATION_EDGES: dict[str, frozenset[tuple[str, str]]] = {
    **{name: op.edges for name, op in TRANSITIONS.items()},
    "reconcile": frozenset((src, dst) for src, dsts in RECONCILE.items() for dst in dsts),
    "lost": frozenset((src, dst) for src, dsts in LOST.items() for dst in dsts),
}


def is_legal(operation: str, from_state: str, to_state: str) -> bool:
    return (from_state, to_state) in OPERATION_EDGES.get(operation, frozenset())


def can_start(operation: str, state: str) -> bool:
    """Whether ``operation`` may begin on a sandbox in ``state`` (the dashboard's buttons)."""
    op = TRANSITIONS.get(operation)
    return op is not None and state in op.start


# Named sets, derived from the table above.
IN_FLIGHT = frozenset(op.in_flight for op in TRANSITIONS.values() if op.in_flight)
# On their own way somewhere: connect, resume and a second pause wait for these to settle.
SETTLING = IN_FLIGHT - {S.KILLING}
# The VM runs and its envd takes traffic. Not "killing": a stream broken by a kill must
# probe as "was not found".
ROUTABLE = frozenset({S.RUNNING, S.SNAPSHOTTING, S.FORKING})
# Traffic to these may auto-resume the sandbox (a pause in progress is waited for).
RESUMABLE = frozenset({S.PAUSING, S.PAUSED, S.RESUMING})
# The VM holds (or is about to hold) CPU and memory on its node: placement counts these.
RESERVING = LIVE - {S.PAUSED}
# Whose TTL the sweeper enforces, and which paused ones retention deletes.
E2B_RUNNING = frozenset(s for s, shown in E2B_VIEW.items() if shown == "running")
E2B_PAUSED = frozenset(s for s, shown in E2B_VIEW.items() if shown == "paused")
# A kill may start from these ("killing" is not one: a second kill loses the race).
KILLABLE = TRANSITIONS["kill"].start
