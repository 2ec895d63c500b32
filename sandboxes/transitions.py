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
from django.db import models, router, transaction
from django.utils import timezone

from sandboxes import route_nudge
from sandboxes.prepared import PreparedGet, PreparedUpdate, insert
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
    values = {"state": to_state, "updated_at": timezone.now(), **with_route_generation(fields)}
    if where:
        updated = Sandbox.objects.filter(pk=sandbox_id, state__in=from_states, **where).update(**values)
    else:
        updated = _update(sandbox_id, from_states, values)
    if updated:
        event.to_state = to_state
        insert(event)
        # the data planes of this host read the routes again once this is committed
        transaction.on_commit(lambda: route_nudge.nudge(sandbox_id))
    return bool(updated)


transition = sync_to_async(transition_sync)

# The conditional UPDATE per shape (issue 26: Django compiling it cost more than running it,
# twice per operation): number of start states, fields written, which of them are None, bump.
_UPDATES: dict[tuple, tuple[PreparedUpdate, tuple]] = {}
_GENERATION = "vm_generation"


def _update(sandbox_id: str, from_states: list, values: dict) -> int:
    """``Sandbox.objects.filter(pk=sandbox_id, state__in=from_states).update(**values)``, the
    same statement compiled once per shape (``PreparedUpdate``); ``vm_generation`` only as
    ``F("vm_generation") + 1``. Anything else, e.g. another expression: the ORM."""
    bump = values.get(_GENERATION)
    if bump is not None and not _is_generation_bump(bump):
        return Sandbox.objects.filter(pk=sandbox_id, state__in=from_states).update(**values)
    names, nulls, given = [], [], {"where_pk": sandbox_id}
    for name, value in values.items():
        if name == _GENERATION:
            continue
        if hasattr(value, "resolve_expression"):
            return Sandbox.objects.filter(pk=sandbox_id, state__in=from_states).update(**values)
        names.append(name)
        if value is None:
            nulls.append(name)
        else:
            given[name] = value
    key = (len(from_states), tuple(names), tuple(nulls), bump is not None)
    prepared, starts = _UPDATES.get(key) or _UPDATES.setdefault(key, _prepared_update(*key))
    given.update(zip(starts, from_states))
    return prepared(router.db_for_write(Sandbox), **given)


def _prepared_update(count: int, names: tuple, nulls: tuple, bump: bool) -> tuple[PreparedUpdate, tuple]:
    """One shape's update and its start states' parameter names: its values' parameters named
    by their fields, None ones written as ``= NULL`` as the ORM writes them."""
    field = Sandbox._meta.get_field
    starts = tuple(f"from_{i}" for i in range(count))

    def make(where_pk, **given):
        values = {name: given.get(name) for name in names}
        if bump:
            values[_GENERATION] = models.F(_GENERATION) + 1
        return Sandbox.objects.filter(pk=where_pk, state__in=[given[s] for s in starts]), values

    params = {name: field(name) for name in names if name not in nulls}
    return PreparedUpdate(make, where_pk=Sandbox._meta.pk, **dict.fromkeys(starts, field("state")), **params), starts


def _is_generation_bump(value) -> bool:
    """``F("vm_generation") + 1``, as ``with_route_generation`` writes it."""
    return (isinstance(value, models.expressions.CombinedExpression) and value.connector == "+"
            and isinstance(value.lhs, models.F) and value.lhs.name == _GENERATION
            and isinstance(value.rhs, models.Value) and value.rhs.value == 1)


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
    transaction; the caller may hold an outer one, e.g. the placement's: then no savepoint,
    a failure here fails that transaction)."""
    check("create", [""], S.CREATING)
    with transaction.atomic(savepoint=False):
        sandbox = Sandbox(state=S.CREATING, **fields)
        insert(sandbox)  # Sandbox.objects.create(), its INSERT built once (sandboxes.prepared)
        event.sandbox_id, event.to_state = sandbox.id, S.CREATING
        insert(event)
    return sandbox
