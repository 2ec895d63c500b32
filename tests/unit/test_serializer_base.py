"""api.serializer_base: each serializer instance gets fields of its own, answers as DRF's
deep-copying base would, and never binds the declared prototypes."""
from datetime import datetime, timezone

import pytest
from rest_framework import serializers

from api.sandboxes.serializers import NewSandboxSerializer, SandboxDetailSerializer, SandboxSerializer
from api.serializer_base import Serializer
from sandboxes.models import Sandbox


class Body(Serializer):
    name = serializers.CharField(max_length=5)
    tags = serializers.DictField(child=serializers.CharField())
    count = serializers.IntegerField(min_value=1)


def test_each_instance_has_fields_of_its_own_bound_to_it():
    a, b = Body(data={}), Body(data={})
    for name in ("name", "tags", "count"):
        assert a.fields[name] is not b.fields[name]
        assert a.fields[name].parent is a and b.fields[name].parent is b
        assert Body._declared_fields[name] is not a.fields[name]
        assert getattr(Body._declared_fields[name], "parent", None) is None  # the prototype stays unbound


def test_a_field_with_a_child_is_deep_copied():
    a, b = Body(data={}), Body(data={})
    assert a.fields["tags"].child is not b.fields["tags"].child
    assert a.fields["tags"].child.parent is a.fields["tags"]


@pytest.mark.parametrize("data", [
    {"name": "abc", "tags": {"k": "v"}, "count": 2},
    {"name": "abcdef", "tags": {"k": 1}, "count": 0},
    {"name": None, "tags": "x", "count": "two"},
    {},
])
def test_validation_answers_as_drf_deep_copies(data):
    class Deep(serializers.Serializer):
        name = serializers.CharField(max_length=5)
        tags = serializers.DictField(child=serializers.CharField())
        count = serializers.IntegerField(min_value=1)

    ours, drf = Body(data=data), Deep(data=data)
    assert ours.is_valid() == drf.is_valid()
    assert ours.errors == drf.errors
    assert dict(ours.validated_data) == dict(drf.validated_data)


def test_a_validation_error_of_one_request_does_not_reach_the_next():
    assert not NewSandboxSerializer(data={"templateID": 5}).is_valid()
    ok = NewSandboxSerializer(data={"templateID": "base", "metadata": {"a": "b"}})
    assert ok.is_valid(), ok.errors
    assert ok.validated_data["metadata"] == {"a": "b"}


def test_answers_render_as_with_drf_own_copies():
    sandbox = Sandbox(id="s1", template_id="base", client_id="c", envd_version="0.2", envd_access_token="t",
                      alias="base", secure=True, started_at=datetime(2026, 1, 1, tzinfo=timezone.utc),
                      end_at=datetime(2026, 1, 2, tzinfo=timezone.utc), cpu_count=1, memory_mb=256,
                      disk_size_mb=1024, metadata={"k": "v"}, state="running", auto_pause=True)
    for cls, context in ((SandboxSerializer, {}), (SandboxDetailSerializer, {"volume_mounts": {}})):
        ours = cls(sandbox, context=context)
        deep = cls(sandbox, context=context)
        deep.get_fields = lambda d=deep: serializers.Serializer.get_fields(d)  # DRF's deep copies
        assert ours.data == deep.data
    detail = SandboxDetailSerializer(sandbox, context={"volume_mounts": {}}).data
    assert detail["lifecycle"] == {"autoResume": False, "onTimeout": "pause"}
    assert detail["metadata"] == {"k": "v"} and detail["volumeMounts"] == []
