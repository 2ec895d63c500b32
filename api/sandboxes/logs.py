"""E2B's sandbox log endpoints, as the E2B CLI's ``sandbox logs`` and the SDKs' generated
clients read them (spec: E2B's OpenAPI, ``SandboxLogs`` / ``SandboxLogsV2Response``):

- ``GET /sandboxes/{id}/logs?start=&limit=`` → ``{"logs": [{timestamp, line}],
  "logEntries": [{timestamp, level, message, fields}]}``, oldest first from ``start`` (ms);
- ``GET /v2/sandboxes/{id}/logs?cursor=&limit=&direction=&level=&search=&pageCursor=`` →
  ``{"logs": [{id, timestamp, level, message, fields}], "nextCursor"?}``.

``fields`` says where a line came from: ``source`` (``console``: the guest kernel, aenv's
guest init or anything else on the console; ``envd``: the guest agent) and ``logger``.
The lines come from the node (``agent.console_logs``)."""
from adrf.views import APIView
from drf_spectacular.utils import OpenApiResponse, extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.response import Response

from lifecycle.sandboxes import logs
from api.fields import MAX_UNIX_MS, ErrorSerializer

ERRORS = {code: OpenApiResponse(ErrorSerializer) for code in (400, 401, 404)}
MAX_V1_LIMIT = 10000  # E2B sets none; a sandbox keeps at most AENV_SANDBOX_LOG_MAX_LINES anyway
MAX_V2_LIMIT = 1000


class LogEntrySerializer(serializers.Serializer):
    """E2B's ``SandboxLogEntry`` (v2 adds the optional ``id``)."""

    id = serializers.CharField(source="pk")
    timestamp = serializers.DateTimeField()
    level = serializers.CharField()
    message = serializers.CharField()
    fields = serializers.SerializerMethodField(method_name="fields_of")  # (get_fields is DRF's own)

    def fields_of(self, line) -> dict[str, str]:
        return {"source": line.source, "logger": line.logger}


class LogLineSerializer(serializers.Serializer):
    """E2B's ``SandboxLog``: the raw line."""

    timestamp = serializers.DateTimeField()
    line = serializers.CharField()


class LogsV1QuerySerializer(serializers.Serializer):
    start = serializers.IntegerField(required=False, min_value=0, max_value=MAX_UNIX_MS,
                                     help_text="ms since the epoch, inclusive")
    limit = serializers.IntegerField(required=False, min_value=0, max_value=MAX_V1_LIMIT, default=1000)


class LogsV2QuerySerializer(serializers.Serializer):
    cursor = serializers.IntegerField(required=False, min_value=0, max_value=MAX_UNIX_MS,
                                      help_text="ms since the epoch, inclusive")
    limit = serializers.IntegerField(required=False, min_value=0, max_value=MAX_V2_LIMIT, default=1000)
    direction = serializers.ChoiceField(choices=[logs.FORWARD, logs.BACKWARD], required=False, default=logs.FORWARD)
    level = serializers.ChoiceField(choices=list(logs.LEVELS), required=False)
    search = serializers.CharField(required=False, max_length=256, allow_blank=True, trim_whitespace=False)
    pageCursor = serializers.CharField(required=False, max_length=512)


def _query(serializer_class, request) -> dict:
    query = serializer_class(data=request.query_params)
    query.is_valid(raise_exception=True)
    return query.validated_data


class SandboxLogsView(APIView):
    """``/sandboxes/{id}/logs``: v1, from ``start`` oldest first; 404 unknown."""

    @extend_schema(operation_id="sandbox_logs", parameters=[LogsV1QuerySerializer],
                   responses={200: inline_serializer("SandboxLogs", {
                       "logs": LogLineSerializer(many=True), "logEntries": LogEntrySerializer(many=True)}), **ERRORS})
    async def get(self, request, sandbox_id: str):
        q = _query(LogsV1QuerySerializer, request)
        lines = await logs.logs_from(request.user.team, sandbox_id, q.get("start"), q["limit"])
        entries = LogEntrySerializer(lines, many=True).data
        for entry in entries:
            entry.pop("id")  # v1's SandboxLogEntry has none
        return Response({"logs": LogLineSerializer(lines, many=True).data, "logEntries": entries})


class SandboxLogsV2View(APIView):
    """``/v2/sandboxes/{id}/logs``: v2, from ``cursor`` forward or backward, filtered;
    ``nextCursor`` when the page is full; 400 bad parameters; 404 unknown."""

    @extend_schema(operation_id="sandbox_logs_v2", parameters=[LogsV2QuerySerializer],
                   responses={200: inline_serializer("SandboxLogsV2Response", {
                       "logs": LogEntrySerializer(many=True), "nextCursor": serializers.CharField(required=False)}),
                       **ERRORS})
    async def get(self, request, sandbox_id: str):
        q = _query(LogsV2QuerySerializer, request)
        page = await logs.logs_page(request.user.team, sandbox_id, cursor=q.get("cursor"), limit=q["limit"],
                                    direction=q["direction"], level=q.get("level"), search=q.get("search") or None,
                                    page_cursor=q.get("pageCursor"))
        body = {"logs": LogEntrySerializer(page.lines, many=True).data}
        if page.next_cursor:
            body["nextCursor"] = page.next_cursor
        return Response(body)
