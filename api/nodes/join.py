"""Joining nodes over the API (``nodes.join`` decides everything):

- operators (``X-Admin-Token``; a team's key gets 403): ``POST /nodes/join-tokens`` (the
  token in the answer, once), ``GET /nodes/join-tokens``, ``DELETE
  /nodes/join-tokens/{prefix}``, ``POST /nodes/{id}/revoke``;
- nodes (``Authorization: Bearer``): ``POST /nodes/join`` with a join token -> the node's
  id and its credential (once); ``POST /nodes/check-in`` with that credential at each start.
  Unknown secret: 401; revoked, used or expired token, revoked node, token for another id: 403.
- Kubernetes DaemonSet pods: ``POST /nodes/join`` with ``{"kubernetesToken": <the pod's
  projected service-account token>}`` and no Authorization header (AENV_NODE_JOIN_KUBERNETES):
  401/403 as above, 503 when the cluster's TokenReview cannot be asked."""
from adrf.views import APIView
from asgiref.sync import sync_to_async
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import exceptions, serializers
from rest_framework.response import Response

from api.auth import (AdminTokenAuthentication, ApiKeyAuthentication, IsOperator, NodeBearerAuthentication,
                      NodeSecret, OptionalNodeBearerAuthentication)
from api.errors import ApiError
from api.fields import ErrorSerializer
from api.requests import body_of, valid

from nodes import db_roles, join
from nodes.models import JOIN_TOKEN_STATES, NodeJoinToken


def _errors(*codes):
    return {code: OpenApiResponse(ErrorSerializer) for code in codes}


class JoinTokenSerializer(serializers.Serializer):
    prefix = serializers.CharField()
    nodeId = serializers.CharField(source="node_id", help_text="the only node id it admits; empty: any new one")
    # A string, not an enum: the schema's "state" enum is the sandboxes' (drf-spectacular names by field).
    state = serializers.CharField(source="state_now", help_text=" | ".join(JOIN_TOKEN_STATES))
    createdBy = serializers.CharField(source="created_by")
    createdAt = serializers.DateTimeField(source="created_at")
    expiresAt = serializers.DateTimeField(source="expires_at")
    usedAt = serializers.DateTimeField(source="used_at", allow_null=True)
    usedBy = serializers.CharField(source="used_by")
    revokedAt = serializers.DateTimeField(source="revoked_at", allow_null=True)


class NewJoinTokenSerializer(JoinTokenSerializer):
    token = serializers.CharField(help_text="the join token itself: shown only in this answer")


class JoinTokenRequest(serializers.Serializer):
    nodeId = serializers.CharField(required=False, allow_blank=True, default="", max_length=64)
    ttl = serializers.CharField(required=False, allow_blank=True, default="",
                                help_text="seconds, or 30m, 24h, 7d (default AENV_NODE_JOIN_TOKEN_TTL)")


class JoinRequest(serializers.Serializer):
    nodeId = serializers.CharField(required=False, allow_blank=True, default="", max_length=64,
                                   help_text="the joining node's id (default: the one the token is for)")


class KubernetesJoinRequest(JoinRequest):
    kubernetesToken = serializers.CharField(
        required=False, allow_blank=True, default="", max_length=16384,
        help_text="instead of a join token (Authorization: Bearer): a Kubernetes DaemonSet pod's projected "
                  "service-account token (AENV_NODE_JOIN_KUBERNETES); the node id is its pod's node name")


class JoinedSerializer(serializers.Serializer):
    nodeId = serializers.CharField()
    credential = serializers.CharField(required=False, help_text="the node's own secret: shown only at its join")
    databaseUrl = serializers.CharField(required=False, help_text="the node's own database role "
                                        "(AENV_NODE_DATABASE_ROLES): shown only at its join")


class RevokedNodeSerializer(serializers.Serializer):
    nodeId = serializers.CharField(source="pk")
    revokedAt = serializers.DateTimeField(source="revoked_at")


def _created(token: NodeJoinToken, raw: str) -> dict:
    token.state_now, token.token = token.state(), raw
    return NewJoinTokenSerializer(token).data


class _OperatorView(APIView):
    authentication_classes = [AdminTokenAuthentication, ApiKeyAuthentication]
    permission_classes = [IsOperator]


class JoinTokensView(_OperatorView):
    @extend_schema(operation_id="node_join_tokens_list", responses={200: JoinTokenSerializer(many=True),
                                                                     **_errors(401, 403)})
    async def get(self, request):
        tokens = await sync_to_async(join.listed_tokens)()
        return Response([JoinTokenSerializer(t).data for t in tokens])

    @extend_schema(operation_id="node_join_tokens_create", request=JoinTokenRequest,
                   responses={201: NewJoinTokenSerializer, **_errors(400, 401, 403)})
    async def post(self, request):
        body = valid(JoinTokenRequest, body_of(request)).validated_data
        token, raw = await sync_to_async(join.create_token)(node_id=body["nodeId"], ttl=body["ttl"] or None,
                                                            created_by="api:operator")
        return Response(_created(token, raw), status=201, headers={"Cache-Control": "no-store"})


class JoinTokenView(_OperatorView):
    @extend_schema(operation_id="node_join_tokens_revoke", responses={204: None, **_errors(401, 403, 404)})
    async def delete(self, request, prefix: str):
        await sync_to_async(join.revoke_token)(prefix)
        return Response(status=204)


class NodeRevokeView(_OperatorView):
    @extend_schema(operation_id="node_revoke", request=None,
                   responses={200: RevokedNodeSerializer, **_errors(401, 403, 404)})
    async def post(self, request, node_id: str):
        node = await sync_to_async(join.revoke_node)(node_id)
        return Response(RevokedNodeSerializer(node).data)


class _NodeView(APIView):
    authentication_classes = [NodeBearerAuthentication]


class JoinView(_NodeView):
    authentication_classes = [OptionalNodeBearerAuthentication]
    permission_classes = []  # a join token (Bearer) or a Kubernetes token (body): the view asks for one

    @extend_schema(operation_id="node_join", request=KubernetesJoinRequest,
                   responses={200: JoinedSerializer, **_errors(400, 401, 403, 503)})
    async def post(self, request):
        body = valid(KubernetesJoinRequest, body_of(request)).validated_data
        bearer = request.user.secret if isinstance(request.user, NodeSecret) else None
        if body["kubernetesToken"]:
            if bearer is not None:
                raise ApiError(400, "a join token (Authorization: Bearer) or a kubernetesToken, not both",
                               "join_two_secrets")
            # The review waits on the cluster (up to AENV_KUBERNETES_TIMEOUT): off the database thread.
            node_id = await sync_to_async(join.kubernetes_identity, thread_sensitive=False)(
                body["kubernetesToken"], body["nodeId"])
            node, credential = await sync_to_async(join.join_kubernetes)(node_id)
        elif bearer is None:
            raise exceptions.NotAuthenticated("missing Authorization: Bearer header (a join token), "
                                              "or kubernetesToken in the body")
        else:
            node, credential = await sync_to_async(join.join)(bearer, body["nodeId"])
        answer = {"nodeId": node.pk, "credential": credential}
        if node.database_url:
            answer["databaseUrl"] = node.database_url
        return Response(answer, headers={"Cache-Control": "no-store"})


class CheckInView(_NodeView):
    @extend_schema(operation_id="node_check_in", request=JoinRequest,
                   responses={200: JoinedSerializer, **_errors(401, 403)})
    async def post(self, request):
        body = valid(JoinRequest, body_of(request)).validated_data
        node = await sync_to_async(join.authenticate)(request.user.secret)
        if body["nodeId"] and body["nodeId"] != node.pk:
            raise ApiError(403, f"this credential is node {node.pk}'s, not {body['nodeId']}'s", "node_other_id")
        await sync_to_async(db_roles.refresh)(node.pk)
        return Response({"nodeId": node.pk})
