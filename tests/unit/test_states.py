"""The sandbox state machine: one table says which state may follow which, and the one
writer (sandboxes.transitions) refuses everything else. Walks the whole table against
the database, and checks that no other code writes a sandbox's state."""
import ast
import itertools
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from sandboxes import states
from sandboxes.models import Sandbox, SandboxEvent, Team, Template
from sandboxes.states import OPERATION_EDGES, TRANSITIONS, SandboxState
from sandboxes.transitions import IllegalTransition, insert_creating, transition_sync

ROOT = Path(__file__).resolve().parents[2]
ALL = [s.value for s in SandboxState]


@pytest.fixture
def make_row(db):
    team = Team.objects.create(name="t", slug="t")
    tpl = Template.objects.create(id="base")

    def make(state):
        return Sandbox.objects.create(team=team, template=tpl, state=state,
                                      end_at=timezone.now() + timedelta(minutes=5))

    return make


def _event(sandbox_id, operation):
    return SandboxEvent(sandbox_id=sandbox_id, operation=operation, outcome="ok")


@pytest.mark.parametrize("operation", sorted(OPERATION_EDGES))
def test_every_edge_of_the_table_and_nothing_else(make_row, operation):
    legal = OPERATION_EDGES[operation]
    assert legal, operation
    for src, dst in itertools.product(ALL, ALL):
        row = make_row(src)
        before = SandboxEvent.objects.count()
        if (src, dst) in legal:
            assert transition_sync(row.pk, [src], dst, _event(row.pk, operation)) is True
            row.refresh_from_db()
            assert row.state == dst
            ev = SandboxEvent.objects.order_by("-id").first()
            assert (ev.operation, ev.to_state) == (operation, dst)
        else:
            with pytest.raises(IllegalTransition):
                transition_sync(row.pk, [src], dst, _event(row.pk, operation))
            row.refresh_from_db()
            assert row.state == src and SandboxEvent.objects.count() == before


def test_unknown_operation_and_empty_from_are_refused(make_row):
    row = make_row("running")
    with pytest.raises(IllegalTransition):
        transition_sync(row.pk, ["running"], "paused", _event(row.pk, "teleport"))
    with pytest.raises(IllegalTransition):
        transition_sync(row.pk, [], "paused", _event(row.pk, "pause"))


def test_the_losing_write_changes_nothing(make_row):
    row = make_row("paused")  # a pause's begin expects running
    assert transition_sync(row.pk, ["running"], "pausing", _event(row.pk, "pause")) is False
    row.refresh_from_db()
    assert row.state == "paused" and not SandboxEvent.objects.filter(sandbox=row).exists()


def test_insert_creating_records_the_create(make_row):
    team, tpl = Team.objects.get(slug="t"), Template.objects.get(pk="base")
    row = insert_creating(SandboxEvent(sandbox_id="", operation="create", outcome="started"), team=team,
                          template=tpl, end_at=timezone.now())
    assert row.state == "creating"
    ev = SandboxEvent.objects.get(sandbox=row)
    assert (ev.operation, ev.to_state) == ("create", "creating")


def test_operations_have_their_own_path():
    # every operation starts from somewhere, ends somewhere live, and fails only to legal states
    for op in TRANSITIONS.values():
        assert op.start and op.success in ALL
        assert all(s in ALL for s in op.failure)
    assert states.can_start("pause", "running") and not states.can_start("pause", "paused")
    assert states.can_start("kill", "paused") and not states.can_start("kill", "killing")
    assert not states.can_start("kill", "killed") and not states.can_start("nope", "running")


def test_derived_sets():
    assert states.LIVE == {"creating", "running", "pausing", "paused", "resuming", "snapshotting", "forking",
                           "killing"}
    assert states.SETTLING == {"creating", "pausing", "resuming", "snapshotting", "forking"}
    assert states.ROUTABLE == {"running", "snapshotting", "forking"}
    assert states.RESUMABLE == {"pausing", "paused", "resuming"}
    assert states.RESERVING == states.LIVE - {"paused"}
    assert states.E2B_RUNNING | states.E2B_PAUSED == states.LIVE
    assert not states.E2B_RUNNING & states.E2B_PAUSED
    assert states.KILLABLE == states.LIVE - {"killing"}
    assert not states.DEAD & states.LIVE and states.DEAD | states.LIVE == set(ALL)


def _state_writes(path: Path):
    """Calls like Sandbox.objects…update(state=…) / create(state=…) in a module, and a new row
    made with its state (``Sandbox(state=…)``: what ``save()`` or ``sandboxes.prepared.insert``
    then writes)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not any(k.arg == "state" for k in node.keywords):
            continue
        if (isinstance(node.func, ast.Attribute)
                and node.func.attr in ("update", "aupdate", "create", "acreate", "bulk_create")
                and "Sandbox.objects" in ast.unparse(node.func.value)):
            yield node.lineno
        elif ast.unparse(node.func) in ("Sandbox", "models.Sandbox", "sandboxes.models.Sandbox"):
            yield node.lineno


def test_no_other_module_writes_a_sandbox_state():
    writers = []
    packages = [d for d in ROOT.iterdir() if (d / "__init__.py").is_file() and d.name not in ("tests", "bench")]
    for path in sorted(p for package in packages for p in package.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if "migrations" in rel.parts:
            continue
        if rel == Path("sandboxes/transitions.py"):
            assert list(_state_writes(path)), "the scan no longer sees the writer's own writes"
            continue
        writers += [f"{rel}:{line}" for line in _state_writes(path)]
    assert writers == [], f"state written outside sandboxes/transitions.py: {writers}"
