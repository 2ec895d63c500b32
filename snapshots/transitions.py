"""The only writer of a snapshot's state.

Why one place (like ``sandboxes.transitions``): a state change must be legal (the table
in ``snapshots.states``), must win against concurrent writers (a conditional ``UPDATE …
WHERE state = expected``: a capture answered after the restarted node abandoned it, or
two deletes at once, lose) and must be on disk with its ``SnapshotEvent`` before anyone
is answered. The capture, the delete and the node's reconcile all write through here.
Inserting a row (``NEW``) is not a transition and does not come here.
"""
from __future__ import annotations

from asgiref.sync import sync_to_async
from django.db import transaction
from django.utils import timezone

from sandboxes.prepared import insert
from snapshots.models import Snapshot, SnapshotEvent
from snapshots.states import TRANSITIONS


class IllegalTransition(Exception):
    """A write the transition table does not allow: a bug in the caller."""


def check(operation: str, from_states=None) -> tuple[list[str], str]:
    """The states ``operation`` may start from (all of the table's, or the caller's
    ``from_states``, which must be among them) and the state it sets."""
    if operation not in TRANSITIONS:
        raise IllegalTransition(f"unknown snapshot operation {operation!r}")
    start, to = TRANSITIONS[operation]
    froms = sorted(start) if from_states is None else [str(s) for s in from_states]
    illegal = [s for s in froms if s not in start]
    if illegal or not froms:
        raise IllegalTransition(f"{operation}: {', '.join(illegal or ['(nothing)'])} → {to} "
                                "is not in snapshots.states")
    return froms, to


def transition_sync(snapshot_id: str, operation: str, *, from_states=None, where: dict | None = None,
                    actor: str = "", message: str = "", details: dict | None = None, **fields) -> bool:
    """Moves the snapshot along ``operation`` if it is in one of the states the operation
    starts from (narrowed by ``from_states``, e.g. "as read"; and matching the extra
    lookups in ``where``), setting ``fields`` and recording the change as a
    ``SnapshotEvent`` in the same transaction. False if another writer won, the snapshot
    is in a state the operation may not start from, or it is gone. Raises
    IllegalTransition for an operation or a ``from_states`` the table does not allow."""
    froms, to = check(operation, from_states)
    with transaction.atomic():
        for src in froms:  # one conditional write per start state: the event names the one it left
            if Snapshot.objects.filter(pk=snapshot_id, state=src, **(where or {})).update(
                    state=to, updated_at=timezone.now(), **fields):
                # SnapshotEvent.objects.create(), its INSERT built once (sandboxes.prepared)
                insert(SnapshotEvent(snapshot_id=snapshot_id, operation=operation, from_state=src, to_state=to,
                                     actor=actor, message=message, details=details or {}))
                return True
    return False


transition = sync_to_async(transition_sync)
