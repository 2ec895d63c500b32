"""E2B's lifecycle events and webhooks API (E2B's OpenAPI: ``SandboxEvent``,
``WebhookCreate`` / ``WebhookConfiguration`` / ``WebhookDetail``, ``WebhookDeliveriesListPayload``):

- ``GET /events/sandboxes`` and ``GET /events/sandboxes/{sandboxID}``: ``offset``, ``limit``
  (1–100, default 10), ``orderAsc`` (default newest first), ``types`` (repeated or comma
  separated) → a JSON array; another team's sandbox is 404 like an unknown one;
- ``/events/webhooks`` (GET list, POST 201) and ``/events/webhooks/{webhookID}`` (GET, PATCH,
  DELETE 200); the signature secret is never returned, except once in the 201 when aenv made it;
- ``GET /events/webhooks/{webhookID}/deliveries``: the delivery history, paged by ``cursor``;
- ``GET /events/webhooks/{webhookID}/stats``: attempts, failures and durations over ``start``–``end``.
Bad parameters: 400 ``{code, message}``."""
from datetime import timedelta

from adrf.views import APIView
from asgiref.sync import sync_to_async
from django.utils import timezone
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import serializers
from rest_framework.response import Response

from api.fields import ErrorSerializer
from api.requests import body_of, team_of
from events import catalog, queries, webhooks

ERRORS = {code: OpenApiResponse(ErrorSerializer) for code in (400, 401, 404)}


def _listed(request, name: str) -> list[str]:
    """A list query parameter as E2B's clients send it (``a=x&a=y``), commas also splitting."""
    return [part for value in request.query_params.getlist(name) for part in value.split(",") if part]


class EventsQuerySerializer(serializers.Serializer):
    offset = serializers.IntegerField(required=False, min_value=0, max_value=2**31 - 1, default=0)
    limit = serializers.IntegerField(required=False, min_value=1, max_value=100, default=10)
    orderAsc = serializers.BooleanField(required=False, default=False)

    def validate(self, attrs):
        types = _listed(self.context["request"], "types")
        unknown = [t for t in types if t not in catalog.TYPES]
        if unknown:
            raise serializers.ValidationError(
                {"types": f"unknown event type(s) {', '.join(unknown)}; known: {', '.join(catalog.TYPES)}"})
        return {**attrs, "types": types}


class DeliveriesQuerySerializer(serializers.Serializer):
    cursor = serializers.CharField(required=False, max_length=200)
    limit = serializers.IntegerField(required=False, min_value=1, max_value=100, default=25)
    orderAsc = serializers.BooleanField(required=False, default=False)
    start = serializers.DateTimeField(required=False)
    end = serializers.DateTimeField(required=False)

    def validate(self, attrs):
        request = self.context["request"]
        statuses = _listed(request, "deliveryStatus")
        if any(s not in ("pending", "success", "failed") for s in statuses):
            raise serializers.ValidationError({"deliveryStatus": "each must be pending, success or failed"})
        types = _listed(request, "eventType")
        if any(t not in catalog.TYPES for t in types):
            raise serializers.ValidationError({"eventType": f"known types: {', '.join(catalog.TYPES)}"})
        return {**attrs, "statuses": statuses, "event_types": types}


class StatsQuerySerializer(serializers.Serializer):
    start = serializers.DateTimeField(required=False, help_text="inclusive; default 24 hours ago")
    end = serializers.DateTimeField(required=False, help_text="exclusive; default now")


def _query(serializer_class, request) -> dict:
    query = serializer_class(data=request.query_params, context={"request": request})
    query.is_valid(raise_exception=True)
    return query.validated_data


def _events(request, sandbox_id=None) -> list[dict]:
    q = _query(EventsQuerySerializer, request)
    return queries.events(team_of(request), sandbox_id=sandbox_id, offset=q["offset"], limit=q["limit"],
                          order_asc=q["orderAsc"], types=q["types"])


class TeamEventsView(APIView):
    """``GET /events/sandboxes``: the team's lifecycle events."""

    @extend_schema(operation_id="events_sandboxes", responses={200: OpenApiResponse(description="SandboxEvent[]"),
                                                               **ERRORS})
    async def get(self, request):
        return Response(await sync_to_async(_events)(request))


class SandboxEventsView(APIView):
    """``GET /events/sandboxes/{sandboxID}``: one sandbox's lifecycle events."""

    @extend_schema(operation_id="events_sandbox", responses={200: OpenApiResponse(description="SandboxEvent[]"),
                                                             **ERRORS})
    async def get(self, request, sandbox_id: str):
        return Response(await sync_to_async(_events)(request, sandbox_id))


class WebhooksView(APIView):
    """``/events/webhooks``: list (GET) and register (POST, 201)."""

    @extend_schema(operation_id="webhooks_list", responses={200: OpenApiResponse(description="WebhookDetail[]"),
                                                            **ERRORS})
    async def get(self, request):
        team = team_of(request)

        def listed():
            return [webhooks.detail(h) for h in team.webhooks.order_by("created_at", "id")]
        return Response(await sync_to_async(listed)())

    @extend_schema(operation_id="webhook_create", request=None,
                   responses={201: OpenApiResponse(description="WebhookCreation"), **ERRORS})
    async def post(self, request):
        hook, made = await sync_to_async(webhooks.create)(team_of(request), body_of(request))
        body = webhooks.detail(hook)
        if made is not None:
            body["signatureSecret"] = made  # shown this once
        return Response(body, status=201)


class WebhookView(APIView):
    """``/events/webhooks/{webhookID}``: GET, PATCH, DELETE."""

    @extend_schema(operation_id="webhook_get", responses={200: OpenApiResponse(description="WebhookDetail"),
                                                          **ERRORS})
    async def get(self, request, webhook_id: str):
        return Response(webhooks.detail(await sync_to_async(webhooks.get)(team_of(request), webhook_id)))

    @extend_schema(operation_id="webhook_update", request=None,
                   responses={200: OpenApiResponse(description="WebhookDetail"), **ERRORS})
    async def patch(self, request, webhook_id: str):
        hook = await sync_to_async(webhooks.update)(team_of(request), webhook_id, body_of(request))
        return Response(webhooks.detail(hook))

    @extend_schema(operation_id="webhook_delete", responses={200: None, **ERRORS})
    async def delete(self, request, webhook_id: str):
        await sync_to_async(webhooks.delete)(team_of(request), webhook_id)
        return Response(status=200)


class WebhookDeliveriesView(APIView):
    """``GET /events/webhooks/{webhookID}/deliveries``: ``{data: [{eventId, eventType,
    sandboxId, status, attempts: [...]}], nextCursor}``."""

    @extend_schema(operation_id="webhook_deliveries",
                   responses={200: OpenApiResponse(description="WebhookDeliveriesListPayload"), **ERRORS})
    async def get(self, request, webhook_id: str):
        team = team_of(request)

        def page():
            hook = webhooks.get(team, webhook_id)
            q = _query(DeliveriesQuerySerializer, request)
            found = queries.deliveries(hook, limit=q["limit"], cursor=q.get("cursor"), order_asc=q["orderAsc"],
                                       start=q.get("start"), end=q.get("end"), statuses=q["statuses"],
                                       event_types=q["event_types"])
            return {"data": found.data, "nextCursor": found.next_cursor}
        return Response(await sync_to_async(page)())


class WebhookStatsView(APIView):
    """``GET /events/webhooks/{webhookID}/stats``: E2B's ``WebhookDeliveryStats``."""

    @extend_schema(operation_id="webhook_stats", parameters=[StatsQuerySerializer],
                   responses={200: OpenApiResponse(description="WebhookDeliveryStats"), **ERRORS})
    async def get(self, request, webhook_id: str):
        team = team_of(request)

        def figures():
            hook = webhooks.get(team, webhook_id)
            q = _query(StatsQuerySerializer, request)
            end = q.get("end") or timezone.now()
            return queries.stats(hook, q.get("start") or end - timedelta(hours=24), end)
        return Response(await sync_to_async(figures)())
