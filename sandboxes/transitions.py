"""The only writer of a sandbox's state.

Why: a state change must be legal (``sandboxes.states``), must win against concurrent
requests (a conditional ``UPDATE … WHERE state IN expected``) and must be on disk with
its ``SandboxEvent`` before anyone is answered. Doing all three in one primitive keeps
the lifecycle code, fork, snapshot and the node's reconcile from each growing their
own slightly different write.
"""
from __future__ import annotations

from asgiref.sync import sync_to_async
from django.db import models, transaction
from django.utils import timezone

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
    from_states = list(from_states)
    check(event.operation, from_states, to_state)
    with transaction.atomic():
        updated = Sandbox.objects.filter(pk=sandbox_id, state__in=from_states, **(where or {})).update(
            state=to_state, updated_at=timezone.now(), **with_route_generation(fields))
        if updated:
            event.to_state = to_state
            event.save()
    return bool(updated)


transition = sync_to_async(transition_sync)


def insert_creating(event: SandboxEvent, **fields) -> Sandbox:
    """Inserts a new sandbox row in ``creating`` with its ``create`` event (one
    transaction; the caller may hold an outer one)."""
    check("create", [""], S.CREATING)
    with transaction.atomic():
        sandbox = Sandbox.objects.create(state=S.CREATING, **fields)
        event.sandbox_id, event.to_state = sandbox.id, S.CREATING
        event.save()
    return sandbox
