"""E2B's template endpoints (spec e2b-templates.md §1–§5): a serializer checks the input,
a function of ``lifecycle.templates`` does the work, a serializer renders the
answer; domain errors become E2B's ``{code, message}`` in ``api.errors``.

The COPY upload (``PUT /template-files/{hash}?token=…``) is a plain Django view: the SDK
sends it without an API key (the signed token is its authorisation) and its body is an
archive, streamed to a file rather than parsed."""
from adrf.views import APIView
from asgiref.sync import sync_to_async
from channels.db import database_sync_to_async
from django.http import HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import status
from rest_framework.response import Response

from api.errors import status_of
from sandboxes.errors import LifecycleError
from api.fields import ErrorSerializer
from api.requests import actor_of, body_of, team_of, valid

from lifecycle.templates import manage, queries, register, start, tags, uploads
from api.templates.serializers import (
    AssignedTemplateTagsSerializer,
    AssignTagsSerializer,
    BuildLogsQuerySerializer,
    BuildRequestV3Serializer,
    BuildStartSerializer,
    BuildStatusQuerySerializer,
    DeleteTagsSerializer,
    TemplateAliasResponseSerializer,
    TemplateBuildFileUploadSerializer,
    TemplateBuildInfoSerializer,
    TemplateBuildLogsResponseSerializer,
    TemplateBuildSerializer,
    TemplateDetailQuerySerializer,
    TemplateListQuerySerializer,
    TemplatePageQuerySerializer,
    TemplateRequestResponseV3Serializer,
    TemplateSerializer,
    TemplateTagSerializer,
    TemplateUpdateResponseSerializer,
    TemplateUpdateSerializer,
    TemplateWithBuildsSerializer,
)

ERRORS = {code: OpenApiResponse(ErrorSerializer) for code in (400, 401, 403, 404, 409, 429, 500, 503)}
TEMPLATE_ID = OpenApiParameter("template_id", OpenApiTypes.STR, OpenApiParameter.PATH,
                               description="template id or name (percent-encoded; may hold one '/')")
BUILD_ID = OpenApiParameter("build_id", OpenApiTypes.STR, OpenApiParameter.PATH, description="build UUID")
FILES_HASH = OpenApiParameter("files_hash", OpenApiTypes.STR, OpenApiParameter.PATH,
                              description="SHA-256 hex of the COPY step's files (the SDK's cache key)")
ALIAS = OpenApiParameter("alias", OpenApiTypes.STR, OpenApiParameter.PATH,
                         description="name as [namespace/]alias[:tag], percent-encoded")


class TemplatesV3View(APIView):
    """``POST /v3/templates``: register a build of the named template (a new template, or
    the team's existing alias rebuilt in place). 202 ``TemplateRequestResponseV3``."""

    @extend_schema(operation_id="template_build_request_v3", request=BuildRequestV3Serializer,
                   responses={202: TemplateRequestResponseV3Serializer, **ERRORS})
    async def post(self, request):
        d = valid(BuildRequestV3Serializer, body_of(request)).validated_data
        registered = await register.request_build(team_of(request), d["name"], tags=d.get("tags"),
                                                  cpu_count=d.get("cpuCount"), memory_mb=d.get("memoryMB"),
                                                  min_free_disk_mb=d.get("minFreeDiskMb"))
        return Response(TemplateRequestResponseV3Serializer(registered).data, status=status.HTTP_202_ACCEPTED)


class TemplatesView(APIView):
    """``GET /templates``: the team's templates."""

    @extend_schema(operation_id="templates_list", parameters=[TemplateListQuerySerializer],
                   responses={200: TemplateSerializer(many=True), **ERRORS})
    async def get(self, request):
        q = valid(TemplateListQuerySerializer, request.query_params).validated_data
        views = await queries.list_templates(team_of(request), q.get("teamID") or None)
        return Response(TemplateSerializer(views, many=True).data)


class TemplatesV2View(APIView):
    """``GET /v2/templates``: the team's templates, newest first, ``X-Next-Token`` paginated."""

    @extend_schema(operation_id="templates_list_v2", parameters=[TemplatePageQuerySerializer],
                   responses={200: TemplateSerializer(many=True), **ERRORS})
    async def get(self, request):
        q = valid(TemplatePageQuerySerializer, request.query_params).validated_data
        page = await queries.page_templates(team_of(request), team_id=q.get("teamID") or None, limit=q["limit"],
                                            next_token=q.get("nextToken") or None)
        response = Response(TemplateSerializer(page.items, many=True).data)
        if page.next_token:
            response["X-Next-Token"] = page.next_token
        response["Access-Control-Expose-Headers"] = "X-Next-Token"
        return response


class TemplateView(APIView):
    """``/templates/{id}``: the template with its builds (GET), publish (PATCH), delete
    (DELETE: 204; 409 while sandboxes or snapshots use it; a snapshot id or name deletes
    that snapshot, as ``Sandbox.delete_snapshot`` does)."""

    @extend_schema(operation_id="template_get", parameters=[TEMPLATE_ID, TemplateDetailQuerySerializer],
                   responses={200: TemplateWithBuildsSerializer, **ERRORS})
    async def get(self, request, template_id: str):
        q = valid(TemplateDetailQuerySerializer, request.query_params).validated_data
        view, token = await queries.get_template(team_of(request), template_id, limit=q["limit"],
                                                 next_token=q.get("nextToken") or None)
        response = Response(TemplateWithBuildsSerializer(view).data)
        if token:
            response["X-Next-Token"] = token
        response["Access-Control-Expose-Headers"] = "X-Next-Token"
        return response

    @extend_schema(operation_id="template_update", parameters=[TEMPLATE_ID], request=TemplateUpdateSerializer,
                   responses={200: OpenApiResponse(description="updated"), **ERRORS})
    async def patch(self, request, template_id: str):
        body = valid(TemplateUpdateSerializer, body_of(request)).validated_data
        await manage.set_public(team_of(request), template_id, body["public"])
        return Response(status=status.HTTP_200_OK)

    @extend_schema(operation_id="template_delete", parameters=[TEMPLATE_ID],
                   responses={204: OpenApiResponse(description="deleted"), **ERRORS})
    async def delete(self, request, template_id: str):
        await manage.delete(team_of(request), template_id, actor=actor_of(request))
        return Response(status=status.HTTP_204_NO_CONTENT)


class TemplateV2View(APIView):
    """``PATCH /v2/templates/{id}`` (``e2b template publish``): 200 ``{"names"}``."""

    @extend_schema(operation_id="template_update_v2", parameters=[TEMPLATE_ID], request=TemplateUpdateSerializer,
                   responses={200: TemplateUpdateResponseSerializer, **ERRORS})
    async def patch(self, request, template_id: str):
        body = valid(TemplateUpdateSerializer, body_of(request)).validated_data
        template = await manage.set_public(team_of(request), template_id, body["public"])
        return Response({"names": template.names})


class FileUploadLinkView(APIView):
    """``GET /templates/{id}/files/{hash}``: 201 ``{present, url}`` (a URL always: the SDK
    PUTs there when the archive is missing or the step forces the upload)."""

    @extend_schema(operation_id="template_files_upload_link", parameters=[TEMPLATE_ID, FILES_HASH],
                   responses={201: TemplateBuildFileUploadSerializer, **ERRORS})
    async def get(self, request, template_id: str, files_hash: str):
        link = await uploads.upload_link(team_of(request), template_id, files_hash, request.build_absolute_uri("/"))
        return Response(TemplateBuildFileUploadSerializer(link).data, status=status.HTTP_201_CREATED)


class BuildStartView(APIView):
    """``POST /v2/templates/{id}/builds/{buildID}``: 202 with an empty body once the build
    is handed to a node (or has failed on its start body); 400 when it is not waiting."""

    @extend_schema(operation_id="template_build_start_v2", parameters=[TEMPLATE_ID, BUILD_ID],
                   request=BuildStartSerializer, responses={202: OpenApiResponse(description="started"), **ERRORS})
    async def post(self, request, template_id: str, build_id: str):
        body = valid(BuildStartSerializer, body_of(request)).to_start()
        await start.start_build(team_of(request), template_id, build_id, body, actor=actor_of(request))
        return Response(status=status.HTTP_202_ACCEPTED)


class BuildStatusView(APIView):
    """``GET /templates/{id}/builds/{buildID}/status``: 200 ``TemplateBuildInfo`` with log
    entries ``[logsOffset, logsOffset + limit)`` (limit ≤ 100)."""

    @extend_schema(operation_id="template_build_status", parameters=[TEMPLATE_ID, BUILD_ID,
                                                                      BuildStatusQuerySerializer],
                   responses={200: TemplateBuildInfoSerializer, **ERRORS})
    async def get(self, request, template_id: str, build_id: str):
        q = valid(BuildStatusQuerySerializer, request.query_params).validated_data
        build = await queries.build_of(team_of(request), template_id, build_id)
        entries = await queries.log_page(build, q["logsOffset"], q["limit"], q.get("level"))
        return Response(TemplateBuildInfoSerializer((build, entries)).data)


class BuildView(APIView):
    """``GET /templates/{id}/builds/{buildID}``: 200 the build (E2B's ``TemplateBuild``, as
    in ``GET /templates/{id}``); another team's build, or none: 404."""

    @extend_schema(operation_id="template_build_get", parameters=[TEMPLATE_ID, BUILD_ID],
                   responses={200: TemplateBuildSerializer, **ERRORS})
    async def get(self, request, template_id: str, build_id: str):
        build = await queries.team_build(team_of(request), template_id, build_id)
        return Response(TemplateBuildSerializer(build).data)


class BuildLogsView(APIView):
    """``GET /templates/{id}/builds/{buildID}/logs``: 200 ``{"logs": [BuildLogEntry]}``."""

    @extend_schema(operation_id="template_build_logs", parameters=[TEMPLATE_ID, BUILD_ID, BuildLogsQuerySerializer],
                   responses={200: TemplateBuildLogsResponseSerializer, **ERRORS})
    async def get(self, request, template_id: str, build_id: str):
        q = valid(BuildLogsQuerySerializer, request.query_params).validated_data
        build = await queries.build_of(team_of(request), template_id, build_id)
        entries = await queries.log_window(build, cursor_ms=q.get("cursor"), limit=q["limit"],
                                           direction=q["direction"], level=q.get("level"))
        return Response(TemplateBuildLogsResponseSerializer({"logs": entries}).data)


class AliasView(APIView):
    """``GET /templates/aliases/{alias}`` (``Template.exists``): 200 the team's, 403 another
    team's, 404 none."""

    @extend_schema(operation_id="template_alias", parameters=[ALIAS],
                   responses={200: TemplateAliasResponseSerializer, **ERRORS})
    async def get(self, request, alias: str):
        template = await queries.alias_info(team_of(request), alias)
        return Response(TemplateAliasResponseSerializer(template).data)


class TagsView(APIView):
    """``/templates/tags``: assign tags to a build (POST, 201) or remove them (DELETE, 204)."""

    @extend_schema(operation_id="template_tags_assign", request=AssignTagsSerializer,
                   responses={201: AssignedTemplateTagsSerializer, **ERRORS})
    async def post(self, request):
        body = valid(AssignTagsSerializer, body_of(request)).validated_data
        assigned = await tags.assign_tags(team_of(request), body["target"], body["tags"])
        return Response(AssignedTemplateTagsSerializer(assigned).data, status=status.HTTP_201_CREATED)

    @extend_schema(operation_id="template_tags_remove", request=DeleteTagsSerializer,
                   responses={204: OpenApiResponse(description="removed"), **ERRORS})
    async def delete(self, request):
        body = valid(DeleteTagsSerializer, body_of(request)).validated_data
        await tags.remove_tags(team_of(request), body["name"], body["tags"])
        return Response(status=status.HTTP_204_NO_CONTENT)


class TemplateTagsView(APIView):
    """``GET /templates/{id}/tags``: the newest assignment of each tag, sorted by tag."""

    @extend_schema(operation_id="template_tags_list", parameters=[TEMPLATE_ID],
                   responses={200: TemplateTagSerializer(many=True), **ERRORS})
    async def get(self, request, template_id: str):
        rows = await tags.list_tags(team_of(request), template_id)
        return Response(TemplateTagSerializer(rows, many=True).data)


# --------------------------------------------------------------------------- the upload


def _json_error(code: int, message: str) -> JsonResponse:
    return JsonResponse({"code": code, "message": message}, status=code)


def _chunks(request, size: int = 1 << 20):
    while True:
        chunk = request.read(size)
        if not chunk:
            return
        yield chunk


@csrf_exempt
async def upload_view(request, files_hash: str):
    """``PUT /template-files/{hash}?token=…``: the archive of a COPY step. 200 with an empty
    body once stored; 400 not a usable archive, 403 a bad or expired URL, 411 no
    Content-Length, 413 too large (``config.request_body``)."""
    if request.method != "PUT":
        response = _json_error(405, f"method {request.method} not allowed; PUT the archive")
        response["Allow"] = "PUT"
        return response
    if not request.headers.get("Content-Length"):
        return _json_error(411, "the upload needs a Content-Length")
    try:
        # off the request's thread (the store may be slow), its connection closed there after
        # (lifecycle.templates.uploads._present says why)
        await database_sync_to_async(uploads.receive_upload, thread_sensitive=False)(
            request.GET.get("token", ""), files_hash, _chunks(request))
    except LifecycleError as exc:
        return _json_error(status_of(exc), exc.message)
    return HttpResponse(status=200, content=b"")
