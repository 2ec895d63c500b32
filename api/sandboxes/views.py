"""E2B-compatible REST views. Thin on purpose: a serializer checks the input, a
function of ``lifecycle.sandboxes`` does the work, a serializer renders the answer;
domain errors become HTTP in ``api.errors``.

The views are async (adrf) so a create that waits tens of seconds for a VM does
not hold one of the server's few sync threads."""
from api.loop_views import APIView
from asgiref.sync import sync_to_async
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import status
from rest_framework.permissions import AllowAny
from rest_framework.response import Response

from api.errors import NO_RETRY, ApiError
from api.requests import actor_of, body_of, server_timing, team_of, valid
from lifecycle.sandboxes import create, kill, network, pause, queries, ttl
from lifecycle.volumes import mounts
from api.sandboxes.serializers import (
    ConnectV2Serializer,
    ListedSandboxSerializer,
    ListQuerySerializer,
    NetworkUpdateSerializer,
    NewSandboxSerializer,
    NewSandboxV2Serializer,
    PauseSerializer,
    RefreshSerializer,
    ResumeSerializer,
    SandboxDetailSerializer,
    SandboxSerializer,
    TimeoutSerializer,
)
from api.fields import ErrorSerializer

ERRORS = {code: OpenApiResponse(ErrorSerializer) for code in (400, 401, 404, 409, 500, 503, 504)}
NO_CONTENT = {204: OpenApiResponse(description="done"), **ERRORS}


class HealthView(APIView):
    """Liveness of the API server; no authentication. 204 with no body, as E2B's API
    spec and AgentENV answer (health checkers look at the status only)."""

    authentication_classes: list = []
    permission_classes = [AllowAny]

    @extend_schema(responses={204: None}, auth=[])
    async def get(self, request):
        return Response(status=204)


class _CreateMixin:
    create_serializer = NewSandboxSerializer

    async def _create(self, request):
        body = valid(self.create_serializer, request.data)
        key = request.headers.get("Idempotency-Key")
        if key is not None and not 1 <= len(key) <= 255:
            raise ApiError(400, "Idempotency-Key must be 1 to 255 characters", headers=NO_RETRY)
        template_ref, timeout, options = body.to_create()
        result = await create.create_sandbox(team_of(request), template_ref, options, timeout=timeout,
                                             idempotency_key=key or None, actor=actor_of(request),
                                             volume_mounts=body.validated_data.get("volumeMounts"))
        return Response(SandboxSerializer(result.sandbox).data, status=status.HTTP_201_CREATED,
                        headers=server_timing(result))


async def _mounts_of(sandboxes) -> dict:
    """Serializer context: E2B's ``volumeMounts`` of each sandbox, read in one query."""
    return {"volume_mounts": await sync_to_async(mounts.wire_of)([s.id for s in sandboxes])}


IDEMPOTENCY = OpenApiParameter("Idempotency-Key", OpenApiTypes.STR, OpenApiParameter.HEADER, required=False)
METADATA = OpenApiParameter("metadata", OpenApiTypes.STR, description="triple-encoded key=value&… filter")


class SandboxesView(_CreateMixin, APIView):
    """``/sandboxes``: v1 create (SDK ≤2.50) and v1 list (running sandboxes only)."""

    @extend_schema(operation_id="sandboxes_list_v1", parameters=[METADATA],
                   responses={200: ListedSandboxSerializer(many=True), **ERRORS})
    async def get(self, request):
        metadata = queries.decode_metadata_filter(request.query_params.get("metadata"))
        sandboxes = await queries.list_running(team_of(request), metadata)
        return Response(ListedSandboxSerializer(sandboxes, many=True, context=await _mounts_of(sandboxes)).data)

    @extend_schema(operation_id="sandboxes_create_v1", request=NewSandboxSerializer,
                   responses={201: SandboxSerializer, **ERRORS})
    async def post(self, request):
        return await self._create(request)


class SandboxesV2View(_CreateMixin, APIView):
    """``/v2/sandboxes``: v2 create (SDK ≥2.51, Idempotency-Key) and paginated list."""

    create_serializer = NewSandboxV2Serializer

    @extend_schema(operation_id="sandboxes_list_v2", parameters=[ListQuerySerializer],
                   responses={200: ListedSandboxSerializer(many=True), **ERRORS})
    async def get(self, request):
        q = valid(ListQuerySerializer, request.query_params).validated_data
        page = await queries.list_sandboxes(
            team_of(request),
            states=q.get("state") or None,
            metadata=queries.decode_metadata_filter(q.get("metadata")),
            order=q["order"],
            started_after=q.get("startedAfter"),
            template=q.get("template") or None,
            limit=q["limit"],
            next_token=q.get("nextToken") or None,
        )
        response = Response(ListedSandboxSerializer(page.items, many=True, context=await _mounts_of(page.items)).data)
        if page.next_token:
            response["X-Next-Token"] = page.next_token
        response["Access-Control-Expose-Headers"] = "X-Next-Token"
        return response

    @extend_schema(operation_id="sandboxes_create_v2", request=NewSandboxV2Serializer,
                   parameters=[IDEMPOTENCY], responses={201: SandboxSerializer, **ERRORS})
    async def post(self, request):
        return await self._create(request)


class SandboxView(APIView):
    """``/sandboxes/{id}``: details and kill."""

    @extend_schema(operation_id="sandbox_get", responses={200: SandboxDetailSerializer, **ERRORS})
    async def get(self, request, sandbox_id: str):
        sandbox = await queries.get_sandbox(team_of(request), sandbox_id)
        return Response(SandboxDetailSerializer(sandbox, context=await _mounts_of([sandbox])).data)

    @extend_schema(operation_id="sandbox_kill", responses=NO_CONTENT)
    async def delete(self, request, sandbox_id: str):
        await kill.kill_sandbox(team_of(request), sandbox_id, actor=actor_of(request))
        return Response(status=status.HTTP_204_NO_CONTENT)


class SandboxTimeoutView(APIView):
    """``/sandboxes/{id}/timeout``: set the TTL from now (may shorten)."""

    @extend_schema(operation_id="sandbox_set_timeout", request=TimeoutSerializer, responses=NO_CONTENT)
    async def post(self, request, sandbox_id: str):
        body = valid(TimeoutSerializer, request.data).validated_data
        await ttl.set_timeout(team_of(request), sandbox_id, body["timeout"], actor=actor_of(request))
        return Response(status=status.HTTP_204_NO_CONTENT)


class SandboxRefreshView(APIView):
    """``/sandboxes/{id}/refreshes``: keep-alive, extends the TTL only."""

    @extend_schema(operation_id="sandbox_refresh", request=RefreshSerializer, responses=NO_CONTENT)
    async def post(self, request, sandbox_id: str):
        body = valid(RefreshSerializer, request.data).validated_data
        await ttl.refresh(team_of(request), sandbox_id, body["duration"], actor=actor_of(request))
        return Response(status=status.HTTP_204_NO_CONTENT)


class SandboxNetworkView(APIView):
    """``/sandboxes/{id}/network``: replace a running sandbox's egress policy (omitted fields
    are cleared). 204 once it is stored and the node has it; 400 a policy aenv cannot
    enforce; 404 unknown; 409 not running (paused included)."""

    @extend_schema(operation_id="sandbox_update_network", request=NetworkUpdateSerializer, responses=NO_CONTENT)
    async def put(self, request, sandbox_id: str):
        update = valid(NetworkUpdateSerializer, body_of(request)).validated_data
        await network.update_network(team_of(request), sandbox_id, update, actor=actor_of(request))
        return Response(status=status.HTTP_204_NO_CONTENT)


class SandboxPauseView(APIView):
    """``/sandboxes/{id}/pause``: 204 paused; 409 not running (already paused); 404; 503
    not paused, still running (``requireHealthyGuest`` or a filesystem-only pause and the
    guest agent does not answer; no node)."""

    @extend_schema(operation_id="sandbox_pause", request=PauseSerializer, responses=NO_CONTENT)
    async def post(self, request, sandbox_id: str):
        body = valid(PauseSerializer, body_of(request)).validated_data
        result = await pause.pause_sandbox(team_of(request), sandbox_id, memory=body.get("memory"),
                                           actor=actor_of(request),
                                           require_healthy_guest=bool(body.get("requireHealthyGuest")))
        return Response(status=status.HTTP_204_NO_CONTENT, headers=server_timing(result))


class SandboxResumeView(APIView):
    """``/sandboxes/{id}/resume`` (legacy SDK ≤2.5): 201 resumed; 409 already running."""

    @extend_schema(operation_id="sandbox_resume", request=ResumeSerializer,
                   responses={201: SandboxSerializer, **ERRORS})
    async def post(self, request, sandbox_id: str):
        body = valid(ResumeSerializer, body_of(request)).validated_data
        result = await pause.resume_sandbox(team_of(request), sandbox_id, body.get("timeout"),
                                            actor=actor_of(request))
        return Response(SandboxSerializer(result.sandbox).data, status=status.HTTP_201_CREATED,
                        headers=server_timing(result))


class SandboxConnectView(APIView):
    """``/sandboxes/{id}/connect`` (v1) and ``/v2/sandboxes/{id}/connect``: 200 with the
    TTL extended if running, 201 if it was paused and has been resumed."""

    connect_serializer = ResumeSerializer

    @extend_schema(operation_id="sandbox_connect", request=ResumeSerializer,
                   responses={200: SandboxSerializer, 201: SandboxSerializer, **ERRORS})
    async def post(self, request, sandbox_id: str):
        body = valid(self.connect_serializer, body_of(request)).validated_data
        resumed, result = await pause.connect_sandbox(team_of(request), sandbox_id, body.get("timeout"),
                                                      actor=actor_of(request), memory=body.get("memory"))
        return Response(SandboxSerializer(result.sandbox).data,
                        status=status.HTTP_201_CREATED if resumed else status.HTTP_200_OK,
                        headers=server_timing(result))


class SandboxConnectV2View(SandboxConnectView):
    connect_serializer = ConnectV2Serializer

    @extend_schema(operation_id="sandbox_connect_v2", request=ConnectV2Serializer,
                   responses={200: SandboxSerializer, 201: SandboxSerializer, **ERRORS})
    async def post(self, request, sandbox_id: str):
        return await super().post(request, sandbox_id)


__all__ = ["ApiError", "HealthView", "SandboxesView", "SandboxesV2View", "SandboxView",
           "SandboxTimeoutView", "SandboxRefreshView", "SandboxNetworkView", "SandboxPauseView", "SandboxResumeView",
           "SandboxConnectView", "SandboxConnectV2View"]
