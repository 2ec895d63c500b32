"""E2B's team, API key and access token endpoints, and the team metrics:

- ``GET /teams``: the caller's teams (a person: access token or dashboard session);
- ``GET /teams/{teamID}/metrics``, ``/metrics/max``: a team's concurrency and start rate
  (its API key, or a member);
- ``/api-keys`` (list, create, rename, delete): the acting team's keys (its API key, or a
  member with ``X-Supabase-Team``);
- ``POST /access-tokens``, ``DELETE /access-tokens/{id}``: a person's own tokens.

A serializer checks the input, ``sandboxes`` / ``lifecycle`` do the work, a serializer
renders E2B's model; domain errors become ``{code, message}`` in ``api.errors``."""
from adrf.views import APIView
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import authentication, status
from rest_framework.response import Response

from api.auth import AccessTokenAuthentication, OptionalApiKeyAuthentication
from api.errors import ApiError
from api.fields import ErrorSerializer
from api.requests import body_of, valid
from api.teams.callers import person_of, team_of
from api.teams.serializers import (
    CreatedAccessTokenSerializer,
    CreatedTeamAPIKeySerializer,
    MaxMetricQuerySerializer,
    MaxTeamMetricSerializer,
    MetricsQuerySerializer,
    NameSerializer,
    TeamAPIKeySerializer,
    TeamMetricSerializer,
    TeamSerializer,
)
from lifecycle.sandboxes import team_metrics
from sandboxes import access_tokens, api_keys, memberships

ERRORS = {code: OpenApiResponse(ErrorSerializer) for code in (400, 401, 403, 404, 409, 500)}
# A person (E2B's AccessTokenAuth / its dashboard session); a team's key as well where E2B takes one.
PERSON = [AccessTokenAuthentication, authentication.SessionAuthentication]
TEAM_OR_PERSON = [OptionalApiKeyAuthentication, *PERSON]


class TeamsView(APIView):
    """``GET /teams``: the person's teams, each with a new API key (E2B's CLI login)."""

    authentication_classes = PERSON

    @extend_schema(operation_id="teams_list", responses={200: TeamSerializer(many=True), **ERRORS})
    async def get(self, request):
        return Response(TeamSerializer(await memberships.cli_memberships(request.user), many=True).data)


class TeamMetricsView(APIView):
    """``GET /teams/{teamID}/metrics?start=&end=`` → ``[TeamMetric]``, oldest first."""

    authentication_classes = TEAM_OR_PERSON

    @extend_schema(operation_id="team_metrics", parameters=[MetricsQuerySerializer],
                   responses={200: TeamMetricSerializer(many=True), **ERRORS})
    async def get(self, request, team_id: str):
        team = await team_of(request, team_id)
        q = valid(MetricsQuerySerializer, request.query_params).validated_data
        start, end = _checked_window(q)
        return Response(TeamMetricSerializer(await team_metrics.series(team, start, end), many=True).data)


class TeamMetricsMaxView(APIView):
    """``GET /teams/{teamID}/metrics/max?metric=&start=&end=`` → ``MaxTeamMetric``."""

    authentication_classes = TEAM_OR_PERSON

    @extend_schema(operation_id="team_metrics_max", parameters=[MaxMetricQuerySerializer],
                   responses={200: MaxTeamMetricSerializer, **ERRORS})
    async def get(self, request, team_id: str):
        team = await team_of(request, team_id)
        q = valid(MaxMetricQuerySerializer, request.query_params).validated_data
        start, end = _checked_window(q)
        return Response(MaxTeamMetricSerializer(await team_metrics.maximum(team, q["metric"], start, end)).data)


def _checked_window(q: dict):
    start, end = team_metrics.window(q.get("start"), q.get("end"))
    if start > end:
        raise ApiError(400, "start must not be after end")
    return start, end


class ApiKeysView(APIView):
    """``/api-keys``: the acting team's keys (GET, masks only), a new key (POST, 201, the key
    in this answer only)."""

    authentication_classes = TEAM_OR_PERSON

    @extend_schema(operation_id="api_keys_list", responses={200: TeamAPIKeySerializer(many=True), **ERRORS})
    async def get(self, request):
        team = await team_of(request)
        return Response(TeamAPIKeySerializer(await api_keys.list_keys(team), many=True).data)

    @extend_schema(operation_id="api_keys_create", request=NameSerializer,
                   responses={201: CreatedTeamAPIKeySerializer, **ERRORS})
    async def post(self, request):
        team = await team_of(request)
        body = valid(NameSerializer, body_of(request)).validated_data
        created = await api_keys.create_key(team, body["name"], person_of(request))
        return Response(CreatedTeamAPIKeySerializer(created).data, status=status.HTTP_201_CREATED)


class ApiKeyView(APIView):
    """``/api-keys/{apiKeyID}``: rename (PATCH, 200) or delete (DELETE, 204; 409 for the
    team's last key). Another team's key: 404."""

    authentication_classes = TEAM_OR_PERSON

    @extend_schema(operation_id="api_keys_update", request=NameSerializer,
                   responses={200: OpenApiResponse(description="renamed"), **ERRORS})
    async def patch(self, request, key_id: str):
        team = await team_of(request)
        body = valid(NameSerializer, body_of(request)).validated_data
        await api_keys.rename_key(team, key_id, body["name"])
        return Response(status=status.HTTP_200_OK)

    @extend_schema(operation_id="api_keys_delete", responses={204: OpenApiResponse(description="deleted"), **ERRORS})
    async def delete(self, request, key_id: str):
        team = await team_of(request)
        await api_keys.delete_key(team, key_id)
        return Response(status=status.HTTP_204_NO_CONTENT)


class AccessTokensView(APIView):
    """``POST /access-tokens``: a new token of the person (201, the token in this answer only)."""

    authentication_classes = PERSON

    @extend_schema(operation_id="access_tokens_create", request=NameSerializer,
                   responses={201: CreatedAccessTokenSerializer, **ERRORS})
    async def post(self, request):
        body = valid(NameSerializer, body_of(request)).validated_data
        created = await access_tokens.create_token(request.user, body["name"])
        return Response(CreatedAccessTokenSerializer(created).data, status=status.HTTP_201_CREATED)


class AccessTokenView(APIView):
    """``DELETE /access-tokens/{accessTokenID}``: 204; another person's token: 404."""

    authentication_classes = PERSON

    @extend_schema(operation_id="access_tokens_delete",
                   responses={204: OpenApiResponse(description="deleted"), **ERRORS})
    async def delete(self, request, token_id: str):
        await access_tokens.delete_token(request.user, token_id)
        return Response(status=status.HTTP_204_NO_CONTENT)
