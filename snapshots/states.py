"""The snapshot state machine: every state, the one table of legal transitions, and the
named sets derived from it.

Why one table (like ``sandboxes.states``): a snapshot is written by the API's capture
and delete, by the node worker's reconcile after a restart and read by restores, the
template delete and the dashboard. Spelled once here, ``snapshots.transitions`` refuses
any write the table does not allow and a test walks it whole. Inserting a row is not a
transition: a capture inserts it ``creating``, a template build its finished result
``ready`` (``NEW``). Pure: no models, no I/O.
"""
from __future__ import annotations

from django.db import models


class SnapshotState(models.TextChoices):
    CREATING = "creating"
    READY = "ready"
    ERROR = "error"
    DELETING = "deleting"


SS = SnapshotState

# operation → (the states it may start from, the state it sets)
TRANSITIONS: dict[str, tuple[frozenset[str], str]] = {
    # the node answered the capture: the files are complete
    "complete": (frozenset({SS.CREATING}), SS.READY),
    # the capture failed, or the node restarted while the API waited for it
    "fail": (frozenset({SS.CREATING}), SS.ERROR),
    # a restarted node worker found its capture abandoned and removed the partial files
    # (agent.reconcile_snapshots)
    "reconcile": (frozenset({SS.CREATING}), SS.ERROR),
    # a delete begins: the files go next, then the row
    "delete": (frozenset({SS.READY, SS.ERROR}), SS.DELETING),
    # a delete that cannot go through (live sandboxes restored from it still read its
    # files, or its node could not remove them): back to what it was
    "keep": (frozenset({SS.DELETING}), SS.READY),
    "keep_error": (frozenset({SS.DELETING}), SS.ERROR),
}
# The operation that puts a snapshot back in the state a refused delete found it in.
KEEP: dict[str, str] = {to: op for op, (start, to) in TRANSITIONS.items() if start == {SS.DELETING}}

# Derived from the table above.
# The states a row may be inserted in (not transitions).
NEW = frozenset({SS.CREATING, SS.READY})
# A delete may begin from these; "creating" is refused (still being taken), "deleting" is
# already on its way out.
DELETABLE = TRANSITIONS["delete"][0]
# Moving by themselves: the operation that holds them settles them (every start state but
# a delete's).
IN_FLIGHT = frozenset().union(*(start for op, (start, _) in TRANSITIONS.items() if op != "delete"))
# Sandboxes may start from these (listed, restorable).
RESTORABLE = frozenset({TRANSITIONS["complete"][1]})
# Are or will be restorable: the template they grew from cannot be deleted under them.
LIVE = RESTORABLE | TRANSITIONS["complete"][0]
# Where only a delete leads out.
SETTLED = frozenset(SS) - IN_FLIGHT


def is_legal(operation: str, from_state: str) -> bool:
    """Whether ``operation`` may move a snapshot that is in ``from_state``."""
    start, _ = TRANSITIONS.get(operation, (frozenset(), ""))
    return from_state in start
