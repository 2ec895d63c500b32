"""Wire models of the snapshot and fork endpoints (E2B names, strict JSON types)."""
from rest_framework import serializers

from api.sandboxes.serializers import SandboxSerializer
from api.fields import StrictBooleanField, StrictCharField, StrictIntegerField, TimeoutField

from lifecycle.snapshots.fork import MAX_FORK_COUNT, fork_max_count, fork_max_per_node
from snapshots.models import NAME_RE, Snapshot


class SnapshotRequestSerializer(serializers.Serializer):
    """Body of ``POST /sandboxes/{id}/snapshots``: ``{}``, ``name`` and/or ``memory``."""

    name = StrictCharField(required=False, allow_null=True, allow_blank=True, max_length=128, default=None)
    memory = StrictBooleanField(required=False, allow_null=True, default=None)

    def validate_name(self, name):
        if name in (None, ""):
            return ""
        if not NAME_RE.match(name):
            raise serializers.ValidationError("name must be 1-128 characters: letters, digits, '_', '-' or '.', "
                                              "starting with a letter or digit")
        if name.startswith("s") and len(name) == 20 and name.isalnum() and name.islower():
            raise serializers.ValidationError("name must not look like a snapshot id")
        return name


class SnapshotInfoSerializer(serializers.ModelSerializer):
    """Model ``SnapshotInfo``: ``snapshotID`` (usable as ``templateID``) and ``names``."""

    snapshotID = serializers.CharField(source="id")
    names = serializers.ListField(child=serializers.CharField())

    class Meta:
        model = Snapshot
        fields = ["snapshotID", "names"]


class SnapshotDetailSerializer(SnapshotInfoSerializer):
    """AgentENV's fuller ``SnapshotInfo`` of ``GET /snapshots/{id}``: the shape a sandbox
    restored from it gets, and when it was taken."""

    cpuCount = serializers.IntegerField(source="cpu_count")
    memoryMB = serializers.IntegerField(source="memory_mb")
    diskSizeMB = serializers.IntegerField(source="disk_size_mb")
    createdAt = serializers.DateTimeField(source="created_at")
    updatedAt = serializers.DateTimeField(source="updated_at")

    class Meta(SnapshotInfoSerializer.Meta):
        fields = [*SnapshotInfoSerializer.Meta.fields, "cpuCount", "memoryMB", "diskSizeMB", "createdAt",
                  "updatedAt"]


class SnapshotListQuerySerializer(serializers.Serializer):
    """Query string of ``GET /snapshots``."""

    sandboxID = serializers.CharField(required=False, allow_blank=True)
    name = serializers.CharField(required=False, allow_blank=True)
    limit = serializers.IntegerField(required=False, min_value=1, max_value=100, default=100)
    nextToken = serializers.CharField(required=False, allow_blank=True)


class ForkRequestSerializer(serializers.Serializer):
    """Body of ``POST /sandboxes/{id}/fork``: ``count`` (1..100, default 1; without the S3
    store at most ``AENV_FORK_MAX_PER_NODE``, as every child then starts on the parent's node)
    and ``timeout`` (seconds for each child; default: the parent's timeout)."""

    count = StrictIntegerField(required=False, allow_null=True, default=None)

    def validate_count(self, count):
        count = 1 if count is None else count
        if not 1 <= count <= MAX_FORK_COUNT:
            raise serializers.ValidationError(f"count must be an integer between 1 and {MAX_FORK_COUNT}")
        if count > fork_max_count():  # without the S3 store: the per-node limit
            raise serializers.ValidationError(
                f"count {count} is over the per-node fork limit AENV_FORK_MAX_PER_NODE={fork_max_per_node()} "
                "(without the S3 snapshot store all children start on the parent's node)")
        return count
    timeout = TimeoutField(required=False, allow_null=True, default=None)


class ForkErrorSerializer(serializers.Serializer):
    code = serializers.IntegerField()
    message = serializers.CharField()


class ForkResultSerializer(serializers.Serializer):
    """Model ``SandboxForkResult``: exactly one of ``sandbox`` or ``error``."""

    sandbox = SandboxSerializer(required=False)
    error = ForkErrorSerializer(required=False)
