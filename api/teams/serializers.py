"""Wire models of E2B's team, API key, access token and team metric endpoints (E2B's names:
``TeamAPIKey``, ``CreatedTeamAPIKey``, ``CreatedAccessToken``, ``IdentifierMaskingDetails``,
``TeamUser``, ``Team``, ``TeamMetric``, ``MaxTeamMetric``)."""
import uuid

from rest_framework import serializers

from api.fields import StrictCharField
from lifecycle.sandboxes.team_metrics import METRICS
from sandboxes.api_keys import mask_of

MAX_UNIX = 253402300799  # 9999-12-31T23:59:59Z: the last second a date can say


class NameSerializer(serializers.Serializer):
    """Body of ``POST /api-keys``, ``PATCH /api-keys/{id}`` and ``POST /access-tokens``."""

    name = StrictCharField(max_length=128, allow_blank=False, trim_whitespace=True)


class MaskSerializer(serializers.Serializer):
    prefix = serializers.CharField()
    valueLength = serializers.IntegerField(source="value_length")
    maskedValuePrefix = serializers.CharField(source="masked_value_prefix")
    maskedValueSuffix = serializers.CharField(source="masked_value_suffix")


def team_user(user) -> dict | None:
    """E2B's ``TeamUser``: its ``id`` is a UUID there; aenv's user ids are integers, given as
    the UUID of that integer (user 42: ``00000000-0000-0000-0000-00000000002a``)."""
    if user is None:
        return None
    return {"id": str(uuid.UUID(int=user.pk)), "email": user.email or ""}


class TeamAPIKeySerializer(serializers.Serializer):
    """``TeamAPIKey``: never the key, only its mask."""

    id = serializers.UUIDField(source="uid")
    name = serializers.CharField()
    mask = serializers.SerializerMethodField()
    createdAt = serializers.DateTimeField(source="created_at")
    createdBy = serializers.SerializerMethodField()
    lastUsed = serializers.DateTimeField(source="last_used_at", allow_null=True)

    def get_mask(self, key) -> dict:
        return MaskSerializer(mask_of(key)).data

    def get_createdBy(self, key) -> dict | None:  # noqa: N802 - wire name
        return team_user(key.created_by)


class CreatedTeamAPIKeySerializer(TeamAPIKeySerializer):
    """``CreatedTeamAPIKey``: the one answer with the key itself; ``instance`` is ``(key, raw)``."""

    key = serializers.SerializerMethodField()

    def to_representation(self, instance):
        key, raw = instance
        data = super().to_representation(key)
        data["key"] = raw
        return data

    def get_key(self, instance) -> str:
        return ""  # filled by to_representation


class CreatedAccessTokenSerializer(serializers.Serializer):
    """``CreatedAccessToken``; ``instance`` is ``(token, raw)``."""

    def to_representation(self, instance):
        token, raw = instance
        return {"id": str(token.pk), "name": token.name, "token": raw, "mask": MaskSerializer(mask_of(token)).data,
                "createdAt": serializers.DateTimeField().to_representation(token.created_at)}


class TeamSerializer(serializers.Serializer):
    """``Team`` of ``GET /teams``; ``instance`` is a ``sandboxes.memberships.Membership``."""

    teamID = serializers.UUIDField(source="team.pk")
    name = serializers.CharField(source="team.name")
    apiKey = serializers.CharField(source="api_key")
    isDefault = serializers.BooleanField(source="is_default")


class MetricsQuerySerializer(serializers.Serializer):
    """``start`` / ``end`` of the team metrics: unix seconds, start not after end."""

    start = serializers.IntegerField(required=False, min_value=0, max_value=MAX_UNIX)
    end = serializers.IntegerField(required=False, min_value=0, max_value=MAX_UNIX)

    def validate(self, attrs):
        if "start" in attrs and "end" in attrs and attrs["start"] > attrs["end"]:
            raise serializers.ValidationError("start must not be after end")
        return attrs


class MaxMetricQuerySerializer(MetricsQuerySerializer):
    metric = serializers.ChoiceField(choices=METRICS)


def unix(ts) -> int:
    return int(ts.timestamp())


class TeamMetricSerializer(serializers.Serializer):
    timestamp = serializers.DateTimeField()
    timestampUnix = serializers.SerializerMethodField()
    concurrentSandboxes = serializers.IntegerField(source="concurrent_sandboxes")
    sandboxStartRate = serializers.FloatField(source="sandbox_start_rate")

    def get_timestampUnix(self, point) -> int:  # noqa: N802
        return unix(point.timestamp)


class MaxTeamMetricSerializer(serializers.Serializer):
    timestamp = serializers.DateTimeField()
    timestampUnix = serializers.SerializerMethodField()
    value = serializers.FloatField()

    def get_timestampUnix(self, point) -> int:  # noqa: N802
        return unix(point.timestamp)
