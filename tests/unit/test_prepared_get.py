"""sandboxes.prepared.PreparedGet: the same instance as the ORM's get() (every field, the
select_related template cached on it, converters applied), missing rows raise DoesNotExist,
the SQL compiled once; and transition_row_sync answers with it."""
from __future__ import annotations

import pytest
from django.db import connection
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
