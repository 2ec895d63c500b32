"""The only writer of a sandbox's state.

Why: a state change must be legal (``sandboxes.states``), must win against concurrent
requests (a conditional ``UPDATE … WHERE state IN expected``) and must be on disk with
its ``SandboxEvent`` before anyone is answered. Doing all three in one primitive keeps
the lifecycle code, fork, snapshot and the node's reconcile from each growing their
own slightly different write. Each committed write nudges this host's data planes
(``sandboxes.route_nudge``): a sandbox leaving ``running`` loses its hot-path route at once.
"""
from __future__ import annotations

from asgiref.sync import sync_to_async
from django.db import models, transaction
from django.utils import timezone

from sandboxes import route_nudge
from sandboxes.prepared import PreparedGet
from sandboxes.models import Sandbox, SandboxEvent
from sandboxes.states import S, is_legal


class IllegalTransition(Exception):
    """A state write the transition table does not allow: a bug in the caller."""


def with_route_generation(fields: dict) -> dict:
    """The update ``fields`` of a state write; one that sets a new route to the VM (envd's, or
    the guest's for every other port) also bumps ``vm_generation``, so the data plane never
    reuses anything of the previous VM process."""
    if "envd_port" in fields or "envd_host" in fields or "guest_host" in fields:
        return {**fields, "vm_generation": models.F("vm_generation") + 1}
    return fields


def check(operation: str, from_states, to_state: str) -> None:
    illegal = [f for f in from_states if not is_legal(operation, f, to_state)]
    if illegal or not from_states:
        raise IllegalTransition(f"{operation}: {', '.join(map(str, illegal or ['(nothing)']))} → {to_state} "
                                "is not in sandboxes.states")


def transition_sync(sandbox_id: str, from_states, to_state: str, event: SandboxEvent, *,
                    where: dict | None = None, **fields) -> bool:
    """Moves a sandbox to ``to_state`` only if it is in one of ``from_states`` (and matches
    the extra lookups in ``where``, e.g. "still expired", "unchanged since read"), and
    records ``event`` (whose ``operation`` names the transition) in the same transaction.
    Returns False if another request won. Raises IllegalTransition for a write the table
    does not allow."""
    with transaction.atomic():
        return _write(sandbox_id, from_states, to_state, event, where, fields)


def _write(sandbox_id: str, from_states, to_state: str, event: SandboxEvent, where: dict | None,
           fields: dict) -> bool:
    """The update and its event; the caller holds the transaction."""
    from_states = list(from_states)
    check(event.operation, from_states, to_state)
    updated = Sandbox.objects.filter(pk=sandbox_id, state__in=from_states, **(where or {})).update(
        state=to_state, updated_at=timezone.now(), **with_route_generation(fields))
    if updated:
        event.to_state = to_state
        event.save()
        # the data planes of this host read the routes again once this is committed
        transaction.on_commit(lambda: route_nudge.nudge(sandbox_id))
    return bool(updated)


transition = sync_to_async(transition_sync)


def transition_row_sync(sandbox_id: str, from_states, to_state: str, event: SandboxEvent, *,
                        where: dict | None = None, **fields) -> Sandbox | None:
    """``transition_sync`` that hands back the row as the write left it (with its template),
    read in the same transaction, or None if another request won: the caller answers with it
    without a second round (issue 26: a reload was a query and a thread hop per operation)."""
    with transaction.atomic():
        if not _write(sandbox_id, from_states, to_state, event, where, fields):
            return None
        return sandbox_with_template(sandbox_id)


transition_row = sync_to_async(transition_row_sync)

# The row and its template by the sandbox's id, the SQL compiled once (sandboxes.prepared):
# compiling this select of two models' columns cost more than running it.
sandbox_with_template = PreparedGet(lambda: Sandbox.objects.select_related("template"))


def insert_creating(event: SandboxEvent, **fields) -> Sandbox:
    """Inserts a new sandbox row in ``creating`` with its ``create`` event (one
    transaction; the caller may hold an outer one)."""
    check("create", [""], S.CREATING)
    with transaction.atomic():
        sandbox = Sandbox.objects.create(state=S.CREATING, **fields)
        event.sandbox_id, event.to_state = sandbox.id, S.CREATING
        event.save()
    return sandbox
