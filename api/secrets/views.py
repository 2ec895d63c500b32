"""E2B's secrets API (SDK ``Secret``): ``GET/POST /secrets``, ``GET/POST/DELETE /secrets/{id}``,
and aenv's ``GET /secrets/{id}/versions``. ``{id}`` is a secret's id or its name. Team-scoped:
another team's secret is a 404 like a missing one. Values go in and never come out
(``team_secrets.store``); ``Cache-Control: no-store`` on every answer."""
from adrf.views import APIView
from asgiref.sync import sync_to_async
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import status
from rest_framework.response import Response

from api.errors import ApiError
from api.fields import ErrorSerializer
from api.requests import body_of, team_of, valid
from api.secrets.serializers import (NewSecretSerializer, SecretListQuerySerializer, SecretSerializer,
                                     SecretUpdateSerializer, SecretVersionSerializer)

from team_secrets import store

ERRORS = {code: OpenApiResponse(ErrorSerializer) for code in (400, 401, 404, 409)}
NO_STORE = {"Cache-Control": "no-store"}


def _object(request) -> dict:
    body = body_of(request)
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body


class SecretsView(APIView):
    @extend_schema(operation_id="secrets_list", parameters=[SecretListQuerySerializer],
                   responses={200: SecretSerializer(many=True), **ERRORS})
    async def get(self, request):
        q = valid(SecretListQuerySerializer, request.query_params).validated_data
        page = await sync_to_async(store.listed)(team_of(request), q["limit"], q.get("nextToken") or None)
        response = Response(SecretSerializer(page.items, many=True).data, headers=NO_STORE)
        if page.next_token:
            response["X-Next-Token"] = page.next_token
        response["Access-Control-Expose-Headers"] = "X-Next-Token"
        return response

    @extend_schema(operation_id="secrets_create", request=NewSecretSerializer,
                   responses={201: SecretSerializer, **ERRORS})
    async def post(self, request):
        body = _object(request)
        secret = await sync_to_async(store.create)(team_of(request), body.get("name"), body.get("value"),
                                                   body.get("metadata"))
        return Response(SecretSerializer(secret).data, status=status.HTTP_201_CREATED, headers=NO_STORE)


class SecretView(APIView):
    @extend_schema(operation_id="secret_get", responses={200: SecretSerializer, **ERRORS})
    async def get(self, request, secret_id: str):
        secret = await sync_to_async(store.find)(team_of(request), secret_id)
        return Response(SecretSerializer(secret).data, headers=NO_STORE)

    @extend_schema(operation_id="secret_update", request=SecretUpdateSerializer,
                   responses={200: SecretSerializer, **ERRORS})
    async def post(self, request, secret_id: str):
        body = _object(request)
        secret = await sync_to_async(store.update)(team_of(request), secret_id, body.get("value"),
                                                   body.get("metadata"))
        return Response(SecretSerializer(secret).data, headers=NO_STORE)

    @extend_schema(operation_id="secret_delete", responses={204: None, **ERRORS})
    async def delete(self, request, secret_id: str):
        await sync_to_async(store.destroy)(team_of(request), secret_id)
        return Response(status=status.HTTP_204_NO_CONTENT)


class SecretVersionsView(APIView):
    @extend_schema(operation_id="secret_versions", responses={200: SecretVersionSerializer(many=True), **ERRORS})
    async def get(self, request, secret_id: str):
        rows = await sync_to_async(store.versions)(team_of(request), secret_id)
        return Response(SecretVersionSerializer(rows, many=True).data, headers=NO_STORE)
