"""``GET /nodes`` and ``GET /nodes/{id}`` (AgentENV's node API), read-only.

Who may see them: any valid API key. Nodes are shared infrastructure, and what these
answers hold is shared too — a node's status, reservations, counts of sandboxes and
creates and its host's figures — never which team's sandboxes they are; the one
per-team field, ``cachedBuilds``, names only the caller's team's builds."""
from adrf.views import APIView
from asgiref.sync import sync_to_async
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework.response import Response

from sandboxes.errors import ApiError
from sandboxes.serializers import ErrorSerializer

from . import summary
from .models import Node
from .serializers import NodeDetailSerializer, NodeSerializer

ERRORS = {code: OpenApiResponse(ErrorSerializer) for code in (401, 404)}


class NodesView(APIView):
    """``/nodes``: every registered node, dead ones too (``status`` says so)."""

    @extend_schema(operation_id="nodes_list", responses={200: NodeSerializer(many=True), **ERRORS})
    async def get(self, request):
        nodes = await sync_to_async(summary.summarize)(Node.objects.order_by("id"))
        return Response(NodeSerializer(nodes, many=True).data)


class NodeView(APIView):
    """``/nodes/{id}``: one node with ``cachedBuilds``; 404 if no such node registered."""

    @extend_schema(operation_id="node_get", responses={200: NodeDetailSerializer, **ERRORS})
    async def get(self, request, node_id: str):
        found = await sync_to_async(_detail)(node_id, request.user.team)
        if found is None:
            raise ApiError(404, f'node "{node_id}" not found')
        return Response(NodeDetailSerializer(found).data)


def _detail(node_id: str, team):
    found = summary.summary_of(node_id)
    if found is not None:
        found.cached_builds = summary.cached_builds(node_id, team)
    return found
