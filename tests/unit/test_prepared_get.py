"""sandboxes.prepared.PreparedGet: the same instance as the ORM's get() (every field, the
select_related template cached on it, converters applied), missing rows raise DoesNotExist,
the SQL compiled once; and transition_row_sync answers with it."""
from __future__ import annotations

import pytest
from django.db import connection, models
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from sandboxes.models import Sandbox, SandboxEvent
from sandboxes.prepared import PreparedGet
from sandboxes.states import S
from sandboxes.transitions import sandbox_with_template, transition_row_sync


def fields(obj) -> dict:
    return {f.attname: getattr(obj, f.attname) for f in obj._meta.concrete_fields}


@pytest.fixture
def sandbox(team, base_template):
    return Sandbox.objects.create(team=team, template=base_template, state=S.RUNNING, envd_port=49983, end_at=timezone.now(),
                                  metadata={"k": "v", "n": [1, 2]}, env_vars={"A": "1"})


@pytest.mark.django_db
def test_the_same_row_and_template_as_the_orm(sandbox):
    prepared = PreparedGet(lambda: Sandbox.objects.select_related("template"))
    orm = Sandbox.objects.select_related("template").get(pk=sandbox.pk)
    for _ in range(2):  # compiled, then from the cache
        got = prepared(sandbox.pk)
        assert type(got) is Sandbox and fields(got) == fields(orm)
        assert Sandbox.template.is_cached(got) and fields(got.template) == fields(orm.template)
        assert got._state.adding is False and got._state.db == "default"
    assert got.created_at.tzinfo is not None and got.metadata == {"k": "v", "n": [1, 2]}
    with CaptureQueriesContext(connection) as queries:
        assert prepared(sandbox.pk).template.id == orm.template.id
    assert len(queries) == 1
    with pytest.raises(Sandbox.DoesNotExist):
        prepared("no-such-sandbox")


@pytest.mark.django_db
def test_transition_row_answers_with_the_written_row(sandbox):
    row = transition_row_sync(sandbox.pk, [S.RUNNING], S.PAUSING, SandboxEvent(sandbox_id=sandbox.pk, operation="pause", outcome="ok", from_state=S.RUNNING))
    assert row.state == S.PAUSING and fields(row) == fields(Sandbox.objects.get(pk=sandbox.pk))
    assert fields(row.template) == fields(sandbox.template)
    assert transition_row_sync(sandbox.pk, [S.RUNNING], S.PAUSING, SandboxEvent(sandbox_id=sandbox.pk, operation="pause", outcome="ok", from_state=S.RUNNING)) is None
    assert fields(sandbox_with_template(sandbox.pk)) == fields(row)


@pytest.mark.django_db
def test_prepared_query_rows_as_the_orm(team, other_team, base_template):
    """Model rows (with select_related), values_list and flat rows, several parameters of
    different types (a key, a team's UUID, a time), each call with its own values."""
    from datetime import timedelta  # noqa: PLC0415

    from sandboxes.models import Team  # noqa: PLC0415
    from sandboxes.prepared import PreparedQuery  # noqa: PLC0415

    now = timezone.now()
    mine = [Sandbox.objects.create(team=team, template=base_template, state=S.RUNNING, end_at=now + timedelta(minutes=i))
            for i in range(3)]
    theirs = Sandbox.objects.create(team=other_team, template=base_template, state=S.RUNNING, end_at=now)
    field = Sandbox._meta.get_field
    make = {
        "models": lambda team, after: Sandbox.objects.select_related("template").filter(team=team, end_at__gt=after)
        .order_by("end_at", "id"),
        "tuples": lambda team, after: Sandbox.objects.filter(team=team, end_at__gt=after).order_by("end_at", "id")
        .values_list("id", "state", "end_at"),
        "flat": lambda team, after: Sandbox.objects.filter(team=team, end_at__gt=after).order_by("end_at", "id")
        .values_list("id", flat=True),
    }
    for kind, fn in make.items():
        prepared = PreparedQuery(fn, team=Team._meta.pk, after=field("end_at"))
        for t, after in [(team, now - timedelta(hours=1)), (team, now + timedelta(seconds=30)),
                         (other_team, now - timedelta(hours=1)), (other_team, now + timedelta(hours=1))]:
            orm = list(fn(t.pk, after))
            got = prepared.rows(team=t.pk, after=after)
            if kind == "models":
                assert [fields(g) for g in got] == [fields(o) for o in orm]
                assert all(Sandbox.template.is_cached(g) for g in got)
            else:
                assert got == orm
            assert len(got) == {team.pk: 3 if after < now else 2, other_team.pk: 1 if after < now else 0}[t.pk]
    assert {s.pk for s in mine} | {theirs.pk} == set(Sandbox.objects.values_list("pk", flat=True))


@pytest.mark.django_db
def test_prepared_query_refuses_a_parameter_it_cannot_place(team):
    from sandboxes.models import Team  # noqa: PLC0415
    from sandboxes.prepared import PreparedQuery  # noqa: PLC0415

    unused = PreparedQuery(lambda key, team: Sandbox.objects.filter(pk=key), key=Sandbox._meta.pk, team=Team._meta.pk)
    with pytest.raises(ValueError, match="team"):
        unused.rows(key="x", team=team.pk)


@pytest.mark.django_db(transaction=True)
async def test_visible_is_team_scoped_and_state_filtered(team, other_team, base_template, node):
    """core.visible (prepared SQL): the team's own sandbox with its node; another team's, an
    unknown id or a state outside the asked ones is NotFound."""
    from asgiref.sync import sync_to_async  # noqa: PLC0415

    from lifecycle.sandboxes import core  # noqa: PLC0415
    from sandboxes.errors import NotFound  # noqa: PLC0415

    mine = await sync_to_async(Sandbox.objects.create)(team=team, template=base_template, node=node, state=S.RUNNING,
                                                      end_at=timezone.now())
    gone = await sync_to_async(Sandbox.objects.create)(team=team, template=base_template, state=S.KILLED,
                                                      end_at=timezone.now())
    got = await core.visible(team, mine.pk)
    assert got.pk == mine.pk and Sandbox.node.is_cached(got) and got.node.pk == node.pk
    orm = await Sandbox.objects.select_related("node").aget(pk=mine.pk)
    assert fields(got) == fields(orm) and fields(got.node) == fields(orm.node)
    for who, sid, states in [(other_team, mine.pk, None), (team, "no-such-id", None), (team, gone.pk, None),
                             (team, mine.pk, [S.PAUSED])]:
        with pytest.raises(NotFound):
            await core.visible(who, sid, states)
    assert (await core.visible(team, gone.pk, [S.KILLED])).node is None


@pytest.mark.django_db
def test_transition_update_writes_what_the_orm_writes(team, other_team, base_template, node):
    """A transition's conditional UPDATE (its SQL built once per shape) leaves the row as the
    ORM's update() would: a foreign key given as a row or None, times, booleans, None, a new
    route bumping vm_generation; a start state it is not in, or another sandbox, is not touched."""
    from datetime import timedelta  # noqa: PLC0415

    from sandboxes.transitions import transition_sync  # noqa: PLC0415

    def ev(sid, op="resume"):
        return SandboxEvent(sandbox_id=sid, operation=op, outcome="ok")

    now = timezone.now()
    rows = [Sandbox.objects.create(team=t, template=base_template, state=S.PAUSED, end_at=now, envd_port=1,
                                   created_at=now, started_at=now,
                                   envd_unresponsive_at_pause=True, pause_image_at=now)
            for t in (team, team, other_team)]
    a, b, bystander = rows
    writes = [
        (S.PAUSED, S.RESUMING, dict(node=node, reserved_vcpus=None, reserved_memory_mb=None)),
        (S.RESUMING, S.RUNNING, dict(envd_host="10.0.0.2", envd_port=40123, guest_host="", pause_image_at=None,
                                     end_at=now + timedelta(hours=1), envd_unresponsive_at_pause=False)),
        (S.RUNNING, S.PAUSING, {}),
        (S.PAUSING, S.ERROR, dict(error_reason="boom", node=None)),
    ]
    ops = {S.RESUMING: "resume", S.RUNNING: "resume", S.PAUSING: "pause", S.ERROR: "reconcile"}
    for source, target, values in writes:
        assert transition_sync(a.pk, [source], target, ev(a.pk, ops[target]), **values)
        # the same write by the ORM on b, as the transitions wrote it before their SQL was prepared
        from sandboxes.transitions import with_route_generation  # noqa: PLC0415

        assert Sandbox.objects.filter(pk=b.pk, state__in=[source]).update(
            state=target, updated_at=timezone.now(), **with_route_generation(values)) == 1
        got, want = fields(Sandbox.objects.get(pk=a.pk)), fields(Sandbox.objects.get(pk=b.pk))
        for name in ("id", "updated_at"):
            got.pop(name), want.pop(name)
        assert got == want, (source, target)
    final = Sandbox.objects.get(pk=a.pk)
    assert final.vm_generation == 1 and final.node_id is None and final.envd_port == 40123
    assert final.end_at == now + timedelta(hours=1) and final.pause_image_at is None
    assert not transition_sync(a.pk, [S.RUNNING], S.PAUSING, ev(a.pk, "pause"))  # it is in error
    assert fields(Sandbox.objects.get(pk=bystander.pk))["state"] == S.PAUSED
    assert SandboxEvent.objects.filter(sandbox_id=a.pk).count() == 4


@pytest.mark.django_db
def test_mounts_of_a_sandbox_and_a_snapshot(team, base_template):
    """lifecycle.volumes.mounts.of_sandbox / of_snapshot (their SQL compiled once): this
    sandbox's or snapshot's mounts only, with their volumes, in path order as the ORM reads them."""
    from lifecycle.volumes import mounts  # noqa: PLC0415
    from snapshots.models import Snapshot  # noqa: PLC0415
    from volumes.models import SandboxVolume, SnapshotVolume, Volume  # noqa: PLC0415

    a, b = (Sandbox.objects.create(team=team, template=base_template, end_at=timezone.now()) for _ in range(2))
    snap, other_snap = (Snapshot.objects.create(team=team, template=base_template) for _ in range(2))
    v1, v2 = Volume.objects.create(team=team, name="one", export_id=7), Volume.objects.create(team=team, name="two")
    SandboxVolume.objects.create(sandbox=a, volume=v2, path="/z")
    SandboxVolume.objects.create(sandbox=a, volume=v1, path="/a")
    SandboxVolume.objects.create(sandbox=b, volume=v1, path="/b")
    SnapshotVolume.objects.create(snapshot=snap, volume=v1, path="/s")
    for _ in range(2):
        assert mounts.of_sandbox(a.pk) == [mounts.Mount.of(r.volume, r.path) for r in
                                           SandboxVolume.objects.filter(sandbox_id=a.pk).select_related("volume")]
        assert [(m.path, m.name, m.export_id, m.team_id) for m in mounts.of_sandbox(a.pk)] == [
            ("/a", "one", 7, str(team.pk)), ("/z", "two", v2.export_id, str(team.pk))]
        assert [m.path for m in mounts.of_sandbox(b.pk)] == ["/b"] and mounts.of_sandbox("none") == []
        assert [(m.path, m.volume_id) for m in mounts.of_snapshot(snap.pk)] == [("/s", v1.pk)]
        assert mounts.of_snapshot(other_snap.pk) == []


@pytest.mark.django_db
def test_prepared_insert_writes_what_save_writes(team, base_template, node):
    """sandboxes.prepared.insert: the row save() would write (every field: defaults, JSON,
    times, foreign keys given as rows), the generated key read back onto the instance, the
    instance no longer 'adding'; a unique clash raises IntegrityError and, inside an atomic
    block, marks it for rollback as save() does."""
    from django.db import IntegrityError, transaction  # noqa: PLC0415

    from sandboxes.prepared import insert  # noqa: PLC0415

    now = timezone.now()
    kw = dict(team=team, template=base_template, node=node, state=S.CREATING, end_at=now, created_at=now,
              started_at=now, metadata={"k": ["v", 1]}, env_vars={"A": "1"}, idempotency_key="")
    mine, orm = Sandbox(**kw), Sandbox(**kw)
    insert(mine)
    orm.save(force_insert=True)
    assert mine._state.adding is False and mine._state.db == "default"
    got, want = fields(Sandbox.objects.get(pk=mine.pk)), fields(Sandbox.objects.get(pk=orm.pk))
    assert got["updated_at"] is not None and got["updated_at"] >= now  # auto_now, by pre_save
    for name in ("id", "envd_access_token", "traffic_access_token", "updated_at"):
        got.pop(name, None), want.pop(name, None)
    assert got == want
    events = []
    for write in (insert, lambda e: e.save()):
        ev = SandboxEvent(sandbox_id=mine.pk, operation="create", outcome="started", to_state=S.CREATING,
                          started_at=now, duration_ms=1.5, details={"template": "base", "n": [1, None]}, actor="me")
        assert ev.pk is None
        write(ev)
        assert isinstance(ev.pk, int) and ev._state.adding is False
        events.append(ev.pk)
    a, b = (fields(SandboxEvent.objects.get(pk=pk)) for pk in events)
    assert a.pop("id") != b.pop("id") and a == b
    keyed = dict(kw, idempotency_key="same")
    insert(Sandbox(**keyed))
    with transaction.atomic():
        with pytest.raises(IntegrityError):
            insert(Sandbox(**keyed))
        assert transaction.get_connection().needs_rollback


def _statements(run) -> list:
    """The (sql, params) ``run()`` sends to the database."""
    sent = []

    def keep(execute, sql, params, many, context):
        sent.append((sql, list(params or ())))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(keep):
        run()
    return sent


def _same_params(got: list, want: list) -> bool:
    from sandboxes.prepared import _same  # noqa: PLC0415

    return len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want))


@pytest.mark.django_db
def test_each_transition_shape_runs_the_orms_update(team, base_template, node):
    """sandboxes.transitions._update (a PreparedUpdate per shape) sends the statement and
    parameters the ORM's filter(pk=…, state__in=…).update(**values) sends, for each shape the
    lifecycle writes (foreign key as a row, integers, booleans either way, None as NULL, times,
    text, the vm_generation bump, several start states), and changes the same rows."""
    from datetime import timedelta  # noqa: PLC0415

    from sandboxes.states import KILLABLE  # noqa: PLC0415
    from sandboxes.transitions import _update, with_route_generation  # noqa: PLC0415

    now = timezone.now()
    route = dict(envd_host="10.0.0.2", envd_port=40123, guest_host="")
    shapes = [  # (start states, target, fields) as pause, resume, create, fork, snapshot, kill write them
        ([S.RUNNING], S.PAUSING, {}),
        ([S.PAUSING], S.PAUSED, dict(envd_unresponsive_at_pause=True)),
        ([S.PAUSING], S.PAUSED, dict(envd_unresponsive_at_pause=False)),
        ([S.PAUSED], S.RESUMING, dict(node=node, reserved_vcpus=None, reserved_memory_mb=None)),
        ([S.RESUMING], S.PAUSED, dict(node=node)),
        ([S.RESUMING], S.RUNNING, dict(**route, end_at=now + timedelta(hours=1), pause_image_at=None,
                                       envd_unresponsive_at_pause=False)),
        ([S.CREATING], S.RUNNING, dict(node=node, **route, started_at=now, end_at=now + timedelta(hours=1))),
        ([S.CREATING], S.ERROR, dict(error_reason="boom")),
        ([S.PAUSED], S.RESUMING, dict(node=node, reserved_vcpus=2, reserved_memory_mb=512)),
        (list(KILLABLE), S.KILLING, {}),
        ([S.KILLING], S.KILLED, dict(killed_at=now, error_reason="kill not confirmed")),
    ]
    for starts, target, written in shapes:
        rows = [Sandbox.objects.create(team=team, template=base_template, state=starts[-1], end_at=now, created_at=now,
                                       started_at=now, envd_port=1, pause_image_at=now) for _ in range(2)]
        values = {"state": target, "updated_at": now, **with_route_generation(written)}
        for _ in range(2):  # compiled, then from the cache
            Sandbox.objects.filter(pk__in=[r.pk for r in rows]).update(state=starts[-1])
            [(sql, params)] = _statements(lambda: _update(rows[0].pk, starts, values))
            [(orm_sql, orm_params)] = _statements(
                lambda: Sandbox.objects.filter(pk=rows[1].pk, state__in=starts).update(**values))
            assert sql == orm_sql, (starts, target)
            assert _same_params([rows[1].pk if p == rows[0].pk else p for p in params], orm_params), (starts, target)
            a, b = (fields(Sandbox.objects.get(pk=r.pk)) for r in rows)
            assert a.pop("id") != b.pop("id") and a == b and a["state"] == target
        assert _update(rows[0].pk, [S.SNAPSHOTTING], values) == 0  # not in a start state: untouched
    assert Sandbox.objects.get(pk=rows[0].pk).state == S.KILLED


@pytest.mark.django_db
def test_prepared_update_of_every_field_type_a_transition_may_write(team, base_template, node):
    """PreparedUpdate's markers: JSON (a dict of its own, compared by what psycopg's wrapper
    holds), integers, two booleans (placed by difference), a foreign key by its key or its row,
    text and times; the ORM's statement and parameters, the same row written. A boolean filter
    (WHERE NOT flag: not a parameter) is refused."""
    from nodes.models import Node  # noqa: PLC0415
    from sandboxes.prepared import PreparedQuery, PreparedUpdate  # noqa: PLC0415

    field = Sandbox._meta.get_field
    names = ("metadata", "envd_port", "secure", "auto_pause", "node", "error_reason", "end_at")

    def make(key, **given):
        return Sandbox.objects.filter(pk=key), {**given, "vm_generation": models.F("vm_generation") + 1}

    prepared = PreparedUpdate(make, key=Sandbox._meta.pk, **{n: field(n) for n in names})
    other = Node.objects.create(id="n2", address="127.0.0.2", vcpu_capacity=8, memory_mb_capacity=8192)
    now = timezone.now()
    a, b = (Sandbox.objects.create(team=team, template=base_template, end_at=now, created_at=now, started_at=now)
            for _ in range(2))
    for values in [dict(metadata={"k": [1, "v"]}, envd_port=1, secure=True, auto_pause=False, node=node,
                        error_reason="x", end_at=now),
                   dict(metadata={}, envd_port=0, secure=False, auto_pause=True, node=other.pk, error_reason="",
                        end_at=now.replace(year=2030))]:
        [(sql, params)] = _statements(lambda: prepared(key=a.pk, **values))
        [(orm_sql, orm_params)] = _statements(lambda: Sandbox.objects.filter(pk=b.pk).update(
            **make(b.pk, **values)[1]))
        assert sql == orm_sql and _same_params([b.pk if p == a.pk else p for p in params], orm_params)
        got, want = fields(Sandbox.objects.get(pk=a.pk)), fields(Sandbox.objects.get(pk=b.pk))
        assert got.pop("id") != want.pop("id") and got.pop("updated_at") and want.pop("updated_at") and got == want
        assert (got["secure"], got["auto_pause"], got["node_id"]) == (values["secure"], values["auto_pause"],
                                                                      getattr(values["node"], "pk", values["node"]))
    assert fields(Sandbox.objects.get(pk=a.pk))["vm_generation"] == 2
    flagged = PreparedQuery(lambda flag: Sandbox.objects.filter(auto_pause=flag).values_list("id", flat=True),
                            flag=field("auto_pause"))
    with pytest.raises(TypeError, match="changes the SQL"):
        flagged.rows(flag=True)
