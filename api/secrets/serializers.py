"""E2B's secret shapes (SDK 2.63: ``Secret``, ``NewSecret``, ``SecretUpdate``). A value goes in;
none ever comes out: no serializer here has a field that could carry one."""
from rest_framework import serializers

from team_secrets.models import Secret, SecretVersion


class SecretSerializer(serializers.ModelSerializer):
    """Model ``Secret``: metadata only, never the value."""

    secretID = serializers.CharField(source="id")
    currentVersion = serializers.IntegerField(source="current_version")
    metadata = serializers.DictField(child=serializers.CharField())
    createdAt = serializers.DateTimeField(source="created_at")
    updatedAt = serializers.DateTimeField(source="updated_at")

    class Meta:
        model = Secret
        fields = ["secretID", "name", "currentVersion", "metadata", "createdAt", "updatedAt"]


class SecretVersionSerializer(serializers.ModelSerializer):
    """aenv's ``GET /secrets/{id}/versions`` entry: which versions exist and when each was made."""

    createdAt = serializers.DateTimeField(source="created_at")

    class Meta:
        model = SecretVersion
        fields = ["version", "createdAt"]


class NewSecretSerializer(serializers.Serializer):
    """Body of ``POST /secrets`` (documentation: ``team_secrets.store`` checks it)."""

    name = serializers.CharField(help_text="unique in the team; lower-cased; letters, digits, '.', '_', '-'")
    value = serializers.CharField(write_only=True, help_text="write-only; no CR, LF or NUL; at most 16384 bytes")
    metadata = serializers.DictField(child=serializers.CharField(), required=False)


class SecretUpdateSerializer(serializers.Serializer):
    """Body of ``POST /secrets/{id}``: a new version (documentation: ``team_secrets.store`` checks it)."""

    value = serializers.CharField(write_only=True)
    metadata = serializers.DictField(child=serializers.CharField(), required=False,
                                     help_text="when given, replaces the stored metadata")


class SecretListQuerySerializer(serializers.Serializer):
    limit = serializers.IntegerField(required=False, min_value=1, max_value=100, default=100)
    nextToken = serializers.CharField(required=False, allow_blank=True)


class ResolveRequestSerializer(serializers.Serializer):
    """Body of the node-only ``POST /nodes/secrets/resolve``."""

    sandboxID = serializers.CharField(max_length=64)
    name = serializers.CharField(max_length=128)
    host = serializers.CharField(max_length=255, help_text="the destination's name (TLS SNI or HTTP Host)")


class ResolvedSerializer(serializers.Serializer):
    value = serializers.CharField()
    version = serializers.IntegerField()
    secretID = serializers.CharField()
    ttl = serializers.IntegerField(help_text="seconds the node may keep it in memory")
