"""E2B snapshot and fork endpoints (spec §2.6): a serializer checks the input, a
function of ``lifecycle.snapshots`` does the work, a serializer renders the answer."""
from api.loop_views import APIView
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import status
from rest_framework.response import Response

from api.sandboxes.serializers import SandboxSerializer
from api.fields import ErrorSerializer
from api.errors import status_of
from api.requests import actor_of, body_of, server_timing, team_of, valid

from lifecycle.snapshots import delete, fork, queries, snapshot
from api.snapshots.serializers import (
    ForkRequestSerializer,
    ForkResultSerializer,
    SnapshotDetailSerializer,
    SnapshotInfoSerializer,
    SnapshotListQuerySerializer,
    SnapshotRequestSerializer,
)

ERRORS = {code: OpenApiResponse(ErrorSerializer) for code in (400, 401, 404, 409, 500, 503, 504, 507)}


class SandboxSnapshotsView(APIView):
    """``POST /sandboxes/{id}/snapshots``: 201 SnapshotInfo; the sandbox keeps running."""

    @extend_schema(operation_id="sandbox_snapshot_create", request=SnapshotRequestSerializer,
                   responses={201: SnapshotInfoSerializer, **ERRORS})
    async def post(self, request, sandbox_id: str):
        body = valid(SnapshotRequestSerializer, body_of(request)).validated_data
        taken = await snapshot.create_snapshot(team_of(request), sandbox_id, name=body.get("name"),
                                               memory=body.get("memory"), actor=actor_of(request))
        return Response(SnapshotInfoSerializer(taken.snapshot).data, status=status.HTTP_201_CREATED,
                        headers=server_timing(taken))


class SnapshotsView(APIView):
    """``GET /snapshots``: the team's snapshots, newest first, ``X-Next-Token`` paginated."""

    @extend_schema(operation_id="snapshots_list", parameters=[SnapshotListQuerySerializer],
                   responses={200: SnapshotInfoSerializer(many=True), **ERRORS})
    async def get(self, request):
        q = valid(SnapshotListQuerySerializer, request.query_params).validated_data
        page = await queries.list_snapshots(team_of(request), sandbox_id=q.get("sandboxID") or None,
                                            name=q.get("name") or None, limit=q["limit"],
                                            next_token=q.get("nextToken") or None)
        response = Response(SnapshotInfoSerializer(page.items, many=True).data)
        if page.next_token:
            response["X-Next-Token"] = page.next_token
        response["Access-Control-Expose-Headers"] = "X-Next-Token"
        return response


class SnapshotView(APIView):
    """``/snapshots/{snapshotID}`` (AgentENV's): the team's ready snapshot by id or name
    (GET, 200 ``SnapshotInfo`` with its shape and times), or its delete (DELETE, 204; 409
    while live sandboxes restored from it, or a running template build on it, still read its
    files). Another team's, a template's, or none: 404."""

    @extend_schema(operation_id="snapshot_get", responses={200: SnapshotDetailSerializer, **ERRORS})
    async def get(self, request, snapshot_id: str):
        found = await queries.get_snapshot(team_of(request), snapshot_id)
        return Response(SnapshotDetailSerializer(found).data)

    @extend_schema(operation_id="snapshot_delete", responses={204: OpenApiResponse(description="deleted"), **ERRORS})
    async def delete(self, request, snapshot_id: str):
        await delete.delete_snapshot(team_of(request), snapshot_id, actor=actor_of(request))
        return Response(status=status.HTTP_204_NO_CONTENT)


class SandboxForkView(APIView):
    """``POST /sandboxes/{id}/fork``: 201 with one ``{"sandbox"}`` or ``{"error"}`` per child."""

    @extend_schema(operation_id="sandbox_fork", request=ForkRequestSerializer,
                   responses={201: ForkResultSerializer(many=True), **ERRORS})
    async def post(self, request, sandbox_id: str):
        body = valid(ForkRequestSerializer, body_of(request)).validated_data
        results = await fork.fork_sandbox(team_of(request), sandbox_id, count=body.get("count"),
                                          timeout=body.get("timeout"), actor=actor_of(request))
        data = [{"sandbox": SandboxSerializer(r.sandbox).data} if not isinstance(r, Exception)
                else {"error": {"code": status_of(r), "message": r.message}} for r in results]
        first = next((r for r in results if not isinstance(r, Exception)), None)
        return Response(data, status=status.HTTP_201_CREATED, headers=server_timing(first) if first else None)
