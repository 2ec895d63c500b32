"""``POST /nodes/egress-proxy/resolve``: a node's egress proxy asks for the password of a
sandbox's upstream proxy (``network.egressProxy``) when it dials it
(``lifecycle.sandboxes.egress_proxy.resolve`` decides: the sandbox must be live on the asking
node and its proxy still have that credential). Nodes only (``nodes.node_auth``); the
password is in this answer's body and nowhere else, never logged; ``Cache-Control: no-store``."""
from adrf.views import APIView
from django.conf import settings
from rest_framework import serializers

from api.auth import NodeBearerAuthentication
from api.secrets.node import node_answer, node_schema
from lifecycle.sandboxes import egress_proxy


class UpstreamRequestSerializer(serializers.Serializer):
    sandboxID = serializers.CharField(max_length=64)
    credential = serializers.CharField(max_length=64, help_text="the credential id the node's network spec names")


class UpstreamPasswordSerializer(serializers.Serializer):
    password = serializers.CharField()
    ttl = serializers.IntegerField(help_text="seconds the node may keep it in memory")


def _resolve(node, body: dict) -> dict:
    return {"password": egress_proxy.resolve(node.pk, body["sandboxID"], body["credential"]),
            "ttl": settings.AENV_EGRESS_SECRET_CACHE_TTL}


class UpstreamPasswordView(APIView):
    authentication_classes = [NodeBearerAuthentication]

    @node_schema("node_egress_proxy_resolve", UpstreamRequestSerializer, UpstreamPasswordSerializer)
    async def post(self, request):
        return await node_answer(request, UpstreamRequestSerializer, _resolve)
