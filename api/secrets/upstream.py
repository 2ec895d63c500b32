"""``POST /nodes/egress-proxy/resolve``: a node's egress proxy asks for the password of a
sandbox's upstream proxy (``network.egressProxy``) when it dials it
(``lifecycle.sandboxes.egress_proxy.resolve`` decides: the sandbox must be live on the asking
node and its proxy still have that credential). Nodes only (``nodes.node_auth``); the
password is in this answer's body and nowhere else, never logged; ``Cache-Control: no-store``."""
from adrf.views import APIView
from asgiref.sync import sync_to_async
from django.conf import settings
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import serializers
from rest_framework.response import Response

from api.auth import NodeBearerAuthentication
from api.fields import ErrorSerializer
from api.requests import body_of, valid
from lifecycle.sandboxes import egress_proxy
from nodes import node_auth


class UpstreamRequestSerializer(serializers.Serializer):
    sandboxID = serializers.CharField(max_length=64)
    credential = serializers.CharField(max_length=64, help_text="the credential id the node's network spec names")


class UpstreamPasswordSerializer(serializers.Serializer):
    password = serializers.CharField()
    ttl = serializers.IntegerField(help_text="seconds the node may keep it in memory")


def _resolve(bearer: str, claimed_id: str, sandbox_id: str, credential: str) -> dict:
    node = node_auth.authenticate(bearer, claimed_id)
    return {"password": egress_proxy.resolve(node.pk, sandbox_id, credential),
            "ttl": settings.AENV_EGRESS_SECRET_CACHE_TTL}


class UpstreamPasswordView(APIView):
    authentication_classes = [NodeBearerAuthentication]

    @extend_schema(operation_id="node_egress_proxy_resolve", request=UpstreamRequestSerializer,
                   responses={200: UpstreamPasswordSerializer,
                              **{c: OpenApiResponse(ErrorSerializer) for c in (400, 401, 403, 404)}})
    async def post(self, request):
        body = valid(UpstreamRequestSerializer, body_of(request)).validated_data
        claimed = node_auth.claimed_id(request.META)
        answer = await sync_to_async(_resolve)(request.user.secret, claimed, body["sandboxID"], body["credential"])
        return Response(answer, headers={"Cache-Control": "no-store"})
