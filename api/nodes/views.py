"""``GET /nodes`` and ``GET /nodes/{id}`` (AgentENV's node API), read-only.

Who sees what: an operator (E2B's ``X-Admin-Token``, ``AENV_ADMIN_TOKEN``) sees every
figure — addresses, metrics ports, the host's figures, every team's load and creates;
any team's API key sees each node's id and status and its own team's sandbox counts there
(``nodes.summary.for_team``). Why: the nodes are shared infrastructure; an address or a
metrics port is a target, and another team's load is that team's business. The one
per-team field, ``cachedBuilds``, names only the caller's team's builds (an operator has
no team: every team's)."""
from adrf.views import APIView
from asgiref.sync import sync_to_async
from drf_spectacular.utils import OpenApiResponse, PolymorphicProxySerializer, extend_schema
from rest_framework.response import Response

from api.auth import AdminTokenAuthentication, ApiKeyAuthentication
from api.errors import ApiError
from api.fields import ErrorSerializer

from nodes import summary
from nodes.models import Node
from api.nodes.serializers import NodeDetailSerializer, NodeSerializer, TenantNodeDetailSerializer, TenantNodeSerializer

ERRORS = {code: OpenApiResponse(ErrorSerializer) for code in (401, 404)}


def _either(name: str, operator, tenant, many: bool = False):
    """The schema's answer: the operator's shape or the tenant's (one of them, by the credential)."""
    return PolymorphicProxySerializer(component_name=name, serializers=[operator, tenant],
                                      resource_type_field_name=None, many=many)


class _NodesBase(APIView):
    # The operator's token first; without one, a team's key as everywhere else.
    authentication_classes = [AdminTokenAuthentication, ApiKeyAuthentication]


class NodesView(_NodesBase):
    """``/nodes``: every registered node, dead ones too (``status`` says so)."""

    @extend_schema(operation_id="nodes_list",
                   responses={200: _either("NodeOrTenantNode", NodeSerializer, TenantNodeSerializer, many=True),
                              **ERRORS})
    async def get(self, request):
        if request.user.is_operator:
            nodes = await sync_to_async(summary.summarize)(Node.objects.order_by("id"))
            return Response(NodeSerializer(nodes, many=True).data)
        nodes = await sync_to_async(summary.for_team)(request.user.team, Node.objects.order_by("id"))
        return Response(TenantNodeSerializer(nodes, many=True).data)


class NodeView(_NodesBase):
    """``/nodes/{id}``: one node with ``cachedBuilds``; 404 if no such node registered."""

    @extend_schema(operation_id="node_get",
                   responses={200: _either("NodeDetailOrTenantNodeDetail", NodeDetailSerializer,
                                           TenantNodeDetailSerializer),
                              **ERRORS})
    async def get(self, request, node_id: str):
        operator = request.user.is_operator
        found = await sync_to_async(_detail)(node_id, request.user.team, operator)
        if found is None:
            raise ApiError(404, f'node "{node_id}" not found')
        return Response((NodeDetailSerializer if operator else TenantNodeDetailSerializer)(found).data)


def _detail(node_id: str, team, operator: bool):
    if operator:
        found = summary.summary_of(node_id)
    else:
        found = next(iter(summary.for_team(team, Node.objects.filter(pk=node_id))), None)
    if found is not None:
        found.cached_builds = summary.cached_builds(node_id, team)
    return found
