"""``/volumecontent/{volumeID}/…``: a volume's files without a sandbox (E2B's volume content
API), authorized by the volume's own token (``Authorization: Bearer``), never an API key:
whoever holds the token of one volume reaches that volume's files and nothing else.

The file work is ``volumes.content``'s (confined to the volume, symlinks never followed);
here: the token, the query, bounded bodies (``AENV_VOLUME_MAX_FILE_BYTES``, a declared
length required: ``config.request_body``) and the answers. Blocking file I/O runs in
worker threads, not on the event loop."""
import hmac

from adrf.views import APIView
from asgiref.sync import sync_to_async
from django.conf import settings
from django.http import StreamingHttpResponse
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import authentication, exceptions, status
from rest_framework.response import Response

from api.errors import error_response
from api.fields import ErrorSerializer
from api.requests import valid
from api.volumes.serializers import EntrySerializer, ListQuerySerializer, MetadataSerializer, PathQuerySerializer, WriteQuerySerializer
from volumes import content, store
from volumes.models import Volume

ERRORS = {code: OpenApiResponse(ErrorSerializer) for code in (400, 401, 403, 404, 409, 411, 413, 500, 507)}
PATH = OpenApiParameter("path", OpenApiTypes.STR, required=True, description="a path inside the volume")


class VolumePrincipal:
    """``request.user`` on the content API: one volume, by its token."""

    is_authenticated = True
    is_anonymous = False
    is_operator = False

    def __init__(self, volume: Volume):
        self.volume = volume
        self.team_id = volume.team_id

    def __str__(self) -> str:
        return f"volume:{self.volume.id}"


class VolumeTokenAuthentication(authentication.BaseAuthentication):
    """``Authorization: Bearer <token>`` of the volume in the URL. An unknown volume and a
    wrong token answer the same 401, so the API tells nobody which volume ids exist."""

    def authenticate(self, request):
        scheme, _, token = request.META.get("HTTP_AUTHORIZATION", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise exceptions.NotAuthenticated("missing Authorization: Bearer <volume token>")
        volume_id = request.parser_context["kwargs"].get("volume_id", "")
        volume = Volume.objects.filter(pk=volume_id).first() if len(volume_id) <= 64 else None
        expected = volume.token if volume is not None else "-" * 64
        if not hmac.compare_digest(token.strip().encode(), expected.encode()) or volume is None:
            raise exceptions.AuthenticationFailed("invalid volume token")
        return VolumePrincipal(volume), None

    def authenticate_header(self, request):
        return 'Bearer realm="aenv-volume"'


class VolumeTokenScheme(OpenApiAuthenticationExtension):
    """The schema's name for the content API's credential (E2B's volume token)."""

    target_class = "api.volumes.content.VolumeTokenAuthentication"
    name = "VolumeTokenAuth"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer"}


def _files(request) -> content.VolumeFiles:
    return store.files_of(request.user.volume)


async def _run(fn, *args, **kwargs):
    """A ``volumes.content`` call in a worker thread; its refusals become E2B's JSON."""
    try:
        return await sync_to_async(fn, thread_sensitive=False)(*args, **kwargs), None
    except content.ContentError as exc:
        return None, error_response(exc.status, exc.message)


def _owner(q: dict) -> dict:
    return {k: q[k] for k in ("uid", "gid", "mode") if q.get(k) is not None}


class _ContentView(APIView):
    authentication_classes = [VolumeTokenAuthentication]


class PathView(_ContentView):
    """``…/path``: stat (GET), remove (DELETE), chmod / chown (PATCH)."""

    @extend_schema(operation_id="volume_content_stat", parameters=[PATH], responses={200: EntrySerializer, **ERRORS})
    async def get(self, request, volume_id: str):
        q = valid(PathQuerySerializer, request.query_params).validated_data
        entry, failed = await _run(_files(request).stat, q["path"])
        return failed or Response(entry)

    @extend_schema(operation_id="volume_content_remove", parameters=[PATH], request=None, responses={204: None, **ERRORS})
    async def delete(self, request, volume_id: str):
        q = valid(PathQuerySerializer, request.query_params).validated_data
        _, failed = await _run(_files(request).remove, q["path"])
        return failed or Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(operation_id="volume_content_update", parameters=[PATH], request=MetadataSerializer,
                   responses={200: EntrySerializer, **ERRORS})
    async def patch(self, request, volume_id: str):
        q = valid(PathQuerySerializer, request.query_params).validated_data
        if not isinstance(request.data, dict):
            return error_response(400, "the body must be a JSON object: {uid, gid, mode}")
        meta = valid(MetadataSerializer, request.data).validated_data
        entry, failed = await _run(_files(request).set_meta, q["path"], **_owner(meta))
        return failed or Response(entry)


class DirView(_ContentView):
    """``…/dir``: list (GET, ``depth`` levels) and make (POST; ``force`` makes parents)."""

    @extend_schema(operation_id="volume_content_list", parameters=[ListQuerySerializer],
                   responses={200: EntrySerializer(many=True), **ERRORS})
    async def get(self, request, volume_id: str):
        q = valid(ListQuerySerializer, request.query_params).validated_data
        entries, failed = await _run(_files(request).list, q["path"], q["depth"],
                                     settings.AENV_VOLUME_MAX_LIST_ENTRIES)
        return failed or Response(entries)

    @extend_schema(operation_id="volume_content_mkdir", parameters=[WriteQuerySerializer], request=None,
                   responses={201: EntrySerializer, **ERRORS})
    async def post(self, request, volume_id: str):
        q = valid(WriteQuerySerializer, request.query_params).validated_data
        entry, failed = await _run(_files(request).mkdir, q["path"], parents=q["force"], **_owner(q))
        return failed or Response(entry, status=status.HTTP_201_CREATED)


def _body(request, size: int = 1 << 20):
    raw = request._request  # the Django request: its body stream, not DRF's parsers
    while True:
        chunk = raw.read(size)
        if not chunk:
            return
        yield chunk


class FileView(_ContentView):
    """``…/file``: read (GET, streamed) and write (PUT ``application/octet-stream``, whole,
    replacing atomically, parents made)."""

    @extend_schema(operation_id="volume_content_read", parameters=[PATH],
                   responses={(200, "application/octet-stream"): OpenApiTypes.BINARY, **ERRORS})
    async def get(self, request, volume_id: str):
        q = valid(PathQuerySerializer, request.query_params).validated_data
        opened, failed = await _run(_files(request).open_file, q["path"])
        if failed:
            return failed
        fd, size = opened
        response = StreamingHttpResponse(content.VolumeFiles.async_chunks(fd), content_type="application/octet-stream")
        response["Content-Length"] = str(size)
        return response

    @extend_schema(operation_id="volume_content_write", parameters=[WriteQuerySerializer],
                   request={"application/octet-stream": OpenApiTypes.BINARY},
                   responses={201: EntrySerializer, **ERRORS})
    async def put(self, request, volume_id: str):
        q = valid(WriteQuerySerializer, request.query_params).validated_data
        entry, failed = await _run(_files(request).write, q["path"], _body(request),
                                   max_bytes=settings.AENV_VOLUME_MAX_FILE_BYTES, **_owner(q))
        return failed or Response(entry, status=status.HTTP_201_CREATED)
