"""The template build state machine: one table (template_builds.transitions.TRANSITIONS)
says which operation may move a build from which status, and its writer refuses the
rest. Tries every (status, operation) pair against a real row, races writers from the
same status, and checks that no other code writes a build's status and that every
status change the code makes comes with its log entry (the change's record)."""
import ast
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connection

from sandboxes.models import Template
from template_builds.models import BuildLogEntry, BuildStatus, TemplateBuild
from template_builds.transitions import (ACTIVE, FINISHED, TRANSITIONS, IllegalTransition, Log, is_legal,
                                         transition_sync)
from tests.unit.state_writes import ROOT, _sources, writers

ALL = [s.value for s in BuildStatus]
WRITERS = ("transition", "transition_sync")
PAIRS = [(status, op) for op in sorted(TRANSITIONS) for status in ALL]


@pytest.fixture
def make_row(team):
    template = Template.objects.create(id="tstates", team=team, alias="states", public=False)

    def make(status):
        return TemplateBuild.objects.create(template=template, status=status, reason_message="before")

    return make


def _unchanged(row, status):
    row.refresh_from_db()
    assert (row.status, row.reason_message, row.log_count) == (status, "before", 0)
    assert not BuildLogEntry.objects.filter(build=row).exists()


@pytest.mark.parametrize("status,operation", PAIRS)
def test_every_status_and_operation(make_row, status, operation):
    start, to = TRANSITIONS[operation]
    row = make_row(status)
    logs = [Log("info", f"{operation} from {status}", "base")]
    if status in start:
        assert transition_sync(row.pk, operation, logs=logs, reason_message="after") is True
        row.refresh_from_db()
        assert (row.status, row.reason_message, row.log_count) == (to, "after", 1)
        entry = BuildLogEntry.objects.get(build=row)
        assert (entry.index, entry.message) == (0, f"{operation} from {status}")
    else:
        assert transition_sync(row.pk, operation, logs=logs, reason_message="after") is False
        _unchanged(row, status)
    assert is_legal(operation, status) == (status in start)


def test_the_table_covers_every_illegal_pair():
    illegal = [(s, op) for s, op in PAIRS if not is_legal(op, s)]
    assert len(illegal) == len(PAIRS) - sum(len(start) for start, _ in TRANSITIONS.values()) > 0


def test_unknown_operation_is_refused(make_row):
    row = make_row("building")
    with pytest.raises(IllegalTransition):
        transition_sync(row.pk, "resurrect", logs=[Log("info", "x")])
    _unchanged(row, "building")
    assert not is_legal("resurrect", "building")


def test_where_narrows_the_write(make_row):
    row = make_row("waiting")
    assert transition_sync(row.pk, "fail", where={"status": "building"}, logs=[Log("error", "x")]) is False
    _unchanged(row, "waiting")


def test_derived_sets():
    assert ACTIVE == {"waiting", "building"} and FINISHED == {"ready", "error"}
    assert all(to != "waiting" or start <= ACTIVE for start, to in TRANSITIONS.values())
    # nothing leaves a finished build
    assert not any(start & FINISHED for start, _ in TRANSITIONS.values())


def _race(row_pk, operations, where):
    barrier = threading.Barrier(len(operations))

    def write(operation):
        try:
            barrier.wait()
            return transition_sync(row_pk, operation, where=where, logs=[Log("info", operation)],
                                   reason_message=operation)
        finally:
            connection.close()

    with ThreadPoolExecutor(len(operations)) as pool:
        return list(pool.map(write, operations))


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("status,operations,as_read", [
    ("waiting", ["start"] * 6, False),
    ("building", ["succeed"] * 6, False),
    ("building", ["fail"] * 6, False),
    # different operations may chain (start, then fail the building build), so these
    # writers expect the status they read, as the callers that race this way do
    ("waiting", ["start", "fail"] * 3, True),
    ("building", ["succeed", "fail", "requeue"] * 2, True),
])
def test_concurrent_writers_from_the_same_status_one_wins(make_row, status, operations, as_read):
    row = make_row(status)
    won = _race(row.pk, operations, {"status": status} if as_read else None)
    assert won.count(True) == 1, won
    winner = operations[won.index(True)]
    row.refresh_from_db()
    assert (row.status, row.reason_message, row.log_count) == (TRANSITIONS[winner][1], winner, 1)
    assert list(BuildLogEntry.objects.filter(build=row).values_list("message", flat=True)) == [winner]


def test_no_other_module_writes_a_build_status():
    outside, own = writers("status", receivers=("TemplateBuild", "builds"), names=("build",),
                           writer="template_builds/transitions.py")
    assert own, "the scan no longer sees the writer's own write"
    assert outside == [], f"build status written outside template_builds/transitions.py: {outside}"


def _writer_calls():
    """Every call of the build writer outside it: (where, the call)."""
    for path in _sources():
        rel = path.relative_to(ROOT)
        if str(rel) == "template_builds/transitions.py":
            continue
        tree = ast.parse(path.read_text())
        names, modules = set(), set()  # the writer imported by name, the module imported as
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "template_builds.transitions":
                names |= {a.asname or a.name for a in node.names if a.name in WRITERS}
            elif isinstance(node, ast.ImportFrom) and node.module == "template_builds":
                modules |= {a.asname or a.name for a in node.names if a.name == "transitions"}
            elif isinstance(node, ast.Import):
                modules |= {a.asname or a.name for a in node.names if a.name == "template_builds.transitions"}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and (
                    (isinstance(node.func, ast.Name) and node.func.id in names)
                    or (isinstance(node.func, ast.Attribute) and node.func.attr in WRITERS
                        and ast.unparse(node.func.value) in modules)):
                yield f"{rel}:{node.lineno}", node


def test_every_status_change_comes_with_its_log_entry():
    calls = list(_writer_calls())
    assert len(calls) >= 6, calls  # start, requeue, succeed and the fails: the scan still sees them
    silent = [where for where, call in calls
              if not any(k.arg == "logs" and not (isinstance(k.value, (ast.List, ast.Tuple)) and not k.value.elts)
                         for k in call.keywords)]
    assert silent == [], f"a build status change without a log entry: {silent}"
