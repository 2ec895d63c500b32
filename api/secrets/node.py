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


def node_schema(operation_id: str, request, answer):
    """The OpenAPI schema of a node-only resolve route: ``request`` in, ``answer`` out, or an error."""
    return extend_schema(operation_id=operation_id, request=request,
                         responses={200: answer, **{c: OpenApiResponse(ErrorSerializer) for c in (400, 401, 403, 404)}})


async def node_answer(request, serializer, answer) -> Response:
    """A node's ask: its body validated with ``serializer``, the node authenticated (its bearer
    and the id it claims, ``nodes.node_auth``), then ``answer(node, body)`` (in a thread: the ORM);
    the reply is never cached."""
    body = valid(serializer, body_of(request)).validated_data
    claimed = node_auth.claimed_id(request.META)

    def run(bearer: str) -> dict:
        return answer(node_auth.authenticate(bearer, claimed), body)

    return Response(await sync_to_async(run)(request.user.secret), headers={"Cache-Control": "no-store"})


def _resolve(node, body: dict) -> dict:
    found = resolve.resolve(node.pk, body["sandboxID"], body["name"], body["host"])
    return {"value": found.value, "version": found.version, "secretID": found.secret_id,
            "ttl": settings.AENV_EGRESS_SECRET_CACHE_TTL}


class ResolveView(APIView):
    authentication_classes = [NodeBearerAuthentication]

    @node_schema("node_secret_resolve", ResolveRequestSerializer, ResolvedSerializer)
    async def post(self, request):
        return await node_answer(request, ResolveRequestSerializer, _resolve)
