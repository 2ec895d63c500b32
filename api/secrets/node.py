"""``POST /nodes/secrets/resolve``: a node's egress proxy asks for the value of a secret it
must put into a request (``team_secrets.resolve`` decides; ``nodes.node_auth`` says which node
asks). Nodes only: a team's API key is 401 here. The value is in this answer's body and
nowhere else: not in the URL, not in a header, never logged; ``Cache-Control: no-store``."""
from adrf.views import APIView
from asgiref.sync import sync_to_async
from django.conf import settings
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework.response import Response

from api.auth import NodeBearerAuthentication
from api.fields import ErrorSerializer
from api.requests import body_of, valid
from api.secrets.serializers import ResolvedSerializer, ResolveRequestSerializer

from nodes import node_auth
from team_secrets import resolve


def _resolve(bearer: str, claimed_id: str, sandbox_id: str, name: str, host: str) -> dict:
    node = node_auth.authenticate(bearer, claimed_id)
    found = resolve.resolve(node.pk, sandbox_id, name, host)
    return {"value": found.value, "version": found.version, "secretID": found.secret_id,
            "ttl": settings.AENV_EGRESS_SECRET_CACHE_TTL}


class ResolveView(APIView):
    authentication_classes = [NodeBearerAuthentication]

    @extend_schema(operation_id="node_secret_resolve", request=ResolveRequestSerializer,
                   responses={200: ResolvedSerializer,
                              **{c: OpenApiResponse(ErrorSerializer) for c in (400, 401, 403, 404)}})
    async def post(self, request):
        body = valid(ResolveRequestSerializer, body_of(request)).validated_data
        claimed = node_auth.claimed_id(request.META)
        answer = await sync_to_async(_resolve)(request.user.secret, claimed, body["sandboxID"], body["name"],
                                               body["host"])
        return Response(answer, headers={"Cache-Control": "no-store"})
