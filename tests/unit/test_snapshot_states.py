"""The snapshot state machine: one table (snapshots.states) says which operation may move
a snapshot from which state, and the one writer (snapshots.transitions) refuses the rest.
Tries every (state, operation) pair against a real row, races writers from the same
state, and checks that no other code writes a snapshot's state."""
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from asgiref.sync import sync_to_async
from django.db import connection

from snapshots import states
from snapshots.models import Snapshot, SnapshotEvent
from snapshots.states import TRANSITIONS, SnapshotState
from snapshots.transitions import IllegalTransition, transition, transition_sync
from tests.unit.state_writes import writers

ALL = [s.value for s in SnapshotState]
PAIRS = [(state, op) for op in sorted(TRANSITIONS) for state in ALL]


@pytest.fixture
def make_row(team, base_template):
    def make(state):
        return Snapshot.objects.create(team=team, template=base_template, state=state, error_reason="before")

    return make


def _unchanged(row, state):
    row.refresh_from_db()
    assert row.state == state and row.error_reason == "before"
    assert not SnapshotEvent.objects.filter(snapshot=row).exists()


@pytest.mark.parametrize("state,operation", PAIRS)
def test_every_state_and_operation(make_row, state, operation):
    start, to = TRANSITIONS[operation]
    row = make_row(state)
    if state in start:
        assert transition_sync(row.pk, operation, actor="me", message="why", error_reason="after") is True
        row.refresh_from_db()
        assert (row.state, row.error_reason) == (to, "after")
        ev = SnapshotEvent.objects.get(snapshot=row)
        assert (ev.operation, ev.from_state, ev.to_state, ev.actor, ev.message) == (operation, state, to, "me", "why")
    else:
        # the row is not in a state the operation starts from: refused, nothing written
        assert transition_sync(row.pk, operation, error_reason="after") is False
        _unchanged(row, state)
        # and naming that state as the expected one is a caller's bug
        with pytest.raises(IllegalTransition):
            transition_sync(row.pk, operation, from_states=[state], error_reason="after")
        _unchanged(row, state)


def test_the_table_covers_every_illegal_pair():
    illegal = [(s, op) for s, op in PAIRS if s not in TRANSITIONS[op][0]]
    assert len(illegal) == len(PAIRS) - sum(len(start) for start, _ in TRANSITIONS.values()) > 0


def test_unknown_operation_and_empty_from_are_refused(make_row):
    row = make_row("ready")
    with pytest.raises(IllegalTransition):
        transition_sync(row.pk, "teleport")
    with pytest.raises(IllegalTransition):
        transition_sync(row.pk, "delete", from_states=[])
    _unchanged(row, "ready")


def test_the_expected_state_narrows_the_write(make_row):
    row = make_row("error")  # deletable, but the caller read it ready
    assert transition_sync(row.pk, "delete", from_states=["ready"]) is False
    _unchanged(row, "error")
    assert transition_sync(row.pk, "delete", from_states=["error"]) is True
    assert SnapshotEvent.objects.get(snapshot=row).from_state == "error"


def test_where_narrows_the_write(make_row):
    row = make_row("creating")
    assert transition_sync(row.pk, "reconcile", where={"updated_at": row.updated_at.replace(year=2000)}) is False
    _unchanged(row, "creating")
    assert transition_sync(row.pk, "reconcile", where={"updated_at": row.updated_at}) is True


def test_a_gone_snapshot_is_refused(db):
    assert transition_sync("s-not-there", "complete") is False


@pytest.mark.django_db(transaction=True)
async def test_the_async_writer(make_row):
    row = await sync_to_async(make_row)("creating")
    assert await transition(row.pk, "fail", error_reason="x") is True
    assert (await Snapshot.objects.aget(pk=row.pk)).state == "error"


def test_derived_sets():
    assert states.NEW == {"creating", "ready"}
    assert states.DELETABLE == {"ready", "error"}
    assert states.IN_FLIGHT == {"creating", "deleting"}
    assert states.RESTORABLE == {"ready"} and states.LIVE == {"creating", "ready"}
    assert states.SETTLED == {"ready", "error"} and not states.SETTLED & states.IN_FLIGHT
    assert states.KEEP == {"ready": "keep", "error": "keep_error"}
    assert all(TRANSITIONS[op][0] == {"deleting"} and TRANSITIONS[op][1] == to for to, op in states.KEEP.items())
    # every state a snapshot can be in is reachable from a new row, and nothing leads back to creating
    reached, frontier = set(states.NEW), list(states.NEW)
    while frontier:
        here = frontier.pop()
        for start, to in TRANSITIONS.values():
            if here in start and to not in reached:
                reached.add(to)
                frontier.append(to)
    assert reached == set(ALL)
    assert all(to != "creating" for _, to in TRANSITIONS.values())
    assert states.is_legal("delete", "ready") and not states.is_legal("delete", "creating")
    assert not states.is_legal("nope", "ready")


def _race(row_pk, operations):
    """Runs each operation on its own thread (its own connection), all released at once."""
    barrier = threading.Barrier(len(operations))

    def write(operation):
        try:
            barrier.wait()
            return transition_sync(row_pk, operation, error_reason=operation)
        finally:
            connection.close()

    with ThreadPoolExecutor(len(operations)) as pool:
        return list(pool.map(write, operations))


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("state,operations", [
    ("creating", ["complete"] * 6),
    ("creating", ["complete", "fail", "reconcile", "complete", "fail", "reconcile"]),
    ("ready", ["delete"] * 6),
    ("deleting", ["keep", "keep_error"] * 3),
])
def test_concurrent_writers_from_the_same_state_one_wins(make_row, state, operations):
    row = make_row(state)
    won = _race(row.pk, operations)
    assert won.count(True) == 1, won
    winner = operations[won.index(True)]
    row.refresh_from_db()
    assert (row.state, row.error_reason) == (TRANSITIONS[winner][1], winner)
    ev = SnapshotEvent.objects.get(snapshot=row)
    assert (ev.operation, ev.from_state) == (winner, state)


def test_no_other_module_writes_a_snapshot_state():
    outside, own = writers("state", receivers=("Snapshot", "snapshots"), names=("snap",),
                           writer="snapshots/transitions.py")
    assert own, "the scan no longer sees the writer's own write"
    assert outside == [], f"snapshot state written outside snapshots/transitions.py: {outside}"
