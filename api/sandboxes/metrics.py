"""E2B's sandbox metrics endpoints, as the SDK's ``get_metrics`` reads them:

- ``GET /sandboxes/{id}/metrics?start=&end=`` → ``[SandboxMetric]`` (oldest first; an
  empty list for a window with no samples);
- ``GET /sandboxes/metrics?sandbox_ids=a,b`` → ``{"sandboxes": {id: SandboxMetric}}``,
  each sandbox's newest sample (ids not the caller's, or without samples, are left out).

``SandboxMetric``: ``timestamp``, ``timestampUnix``, ``cpuCount``, ``cpuUsedPct``,
``memUsed``, ``memTotal``, ``memCache``, ``diskUsed``, ``diskTotal`` (bytes), all required
by the SDK's model. The samples come from the node (``agent.metrics``)."""
from adrf.views import APIView
from drf_spectacular.utils import OpenApiResponse, extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.response import Response

from lifecycle.sandboxes import metrics
from api.errors import ApiError
from api.fields import MAX_UNIX_S, ErrorSerializer

ERRORS = {code: OpenApiResponse(ErrorSerializer) for code in (400, 401, 404)}
MAX_SANDBOX_IDS = 100


class SandboxMetricSerializer(serializers.Serializer):
    timestamp = serializers.DateTimeField()
    timestampUnix = serializers.SerializerMethodField()
    cpuCount = serializers.IntegerField(source="cpu_count")
    cpuUsedPct = serializers.FloatField(source="cpu_used_pct")
    memUsed = serializers.IntegerField(source="mem_used")
    memTotal = serializers.IntegerField(source="mem_total")
    memCache = serializers.IntegerField(source="mem_cache")
    diskUsed = serializers.IntegerField(source="disk_used")
    diskTotal = serializers.IntegerField(source="disk_total")

    def get_timestampUnix(self, m) -> int:
        return int(m.timestamp.timestamp())


class MetricsWindowSerializer(serializers.Serializer):
    """``start`` / ``end``: unix seconds, optional, start not after end."""

    start = serializers.IntegerField(required=False, min_value=0, max_value=MAX_UNIX_S)
    end = serializers.IntegerField(required=False, min_value=0, max_value=MAX_UNIX_S)

    def validate(self, attrs):
        if "start" in attrs and "end" in attrs and attrs["start"] > attrs["end"]:
            raise serializers.ValidationError("start must not be after end")
        return attrs


def _sandbox_ids(raw: str | None) -> list[str]:
    """The SDK's ``sandbox_ids`` (comma-joined), 1 to 100 distinct ids."""
    ids = list(dict.fromkeys(part.strip() for part in (raw or "").split(",") if part.strip()))
    if not ids:
        raise ApiError(400, "sandbox_ids is required: a comma-separated list of sandbox ids")
    if len(ids) > MAX_SANDBOX_IDS:
        raise ApiError(400, f"sandbox_ids: at most {MAX_SANDBOX_IDS} sandbox ids, not {len(ids)}")
    return ids


class SandboxMetricsView(APIView):
    """``/sandboxes/{id}/metrics``: the sandbox's samples in the window; 404 unknown."""

    @extend_schema(operation_id="sandbox_metrics", parameters=[MetricsWindowSerializer],
                   responses={200: SandboxMetricSerializer(many=True), **ERRORS})
    async def get(self, request, sandbox_id: str):
        window = MetricsWindowSerializer(data=request.query_params)
        window.is_valid(raise_exception=True)
        found = await metrics.sandbox_metrics(request.user.team, sandbox_id, window.validated_data.get("start"),
                                              window.validated_data.get("end"))
        return Response(SandboxMetricSerializer(found, many=True).data)


class SandboxesMetricsView(APIView):
    """``/sandboxes/metrics?sandbox_ids=…``: the newest sample of each sandbox."""

    @extend_schema(operation_id="sandboxes_metrics",
                   responses={200: inline_serializer("SandboxesWithMetrics", {
                       "sandboxes": serializers.DictField(child=SandboxMetricSerializer())}), **ERRORS})
    async def get(self, request):
        ids = _sandbox_ids(request.query_params.get("sandbox_ids"))
        newest = await metrics.latest_metrics(request.user.team, ids)
        return Response({"sandboxes": {sid: SandboxMetricSerializer(m).data for sid, m in newest.items()}})
