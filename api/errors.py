"""Every error the API returns is JSON `{code, message}`: the E2B SDK parses the body
of every error status before looking at it, and crashes on anything else.

The one table from domain errors (``sandboxes.errors``) to HTTP lives here:
the lifecycle never speaks HTTP, the views never pick status codes for it."""
import logging

from django.conf import settings
from django.db import OperationalError
from django.http import Http404
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler

from sandboxes import errors as domain

log = logging.getLogger(__name__)

STATUS = {
    domain.Invalid: 400,
    domain.Unauthenticated: 401,
    domain.Forbidden: 403,
    domain.NotFound: 404,
    domain.Conflict: 409,
    domain.RateLimited: 429,
    domain.Failed: 500,
    domain.Unavailable: 503,
    domain.NoRoom: 503,  # an admission refusal: with Retry-After (headers_of)
    domain.Timeout: 504,
    domain.StorageFull: 507,
}
# Failed creates are not retried by the SDK when told so: each retry would insert (and
# fail) another sandbox, and neither "no capacity" nor "node dead" heals within its backoff.
NO_RETRY = {"Should-Retry": "false"}


def status_of(exc: domain.LifecycleError) -> int:
    """The HTTP status of a domain error (also what the dashboard shows)."""
    for kind in type(exc).__mro__:
        if kind in STATUS:
            return STATUS[kind]
    return 500


def headers_of(exc: domain.LifecycleError) -> dict | None:
    """``Should-Retry: false`` where the SDK's own quick retries cannot help; an admission
    refusal (``NoRoom``) also says when a new try may find room (``Retry-After``, seconds),
    so clients back off instead of hammering a full cluster."""
    headers = {} if exc.retry else dict(NO_RETRY)
    if isinstance(exc, domain.NoRoom):
        headers["Retry-After"] = str(settings.AENV_ADMISSION_RETRY_AFTER)
    return headers or None


class ApiError(exceptions.APIException):
    """An error with an explicit HTTP status and message, raised by views (the edge)."""

    def __init__(self, status_code: int, message: str, error_code: str | None = None, headers=None):
        self.status_code = status_code
        self.detail = message
        self.error_code = error_code
        self.extra_headers = headers or {}


def _message(detail) -> str:
    if isinstance(detail, dict):
        parts = []
        for field, value in detail.items():
            text = _message(value)
            parts.append(text if field in ("detail", "non_field_errors") else f"{field}: {text}")
        return "; ".join(parts)
    if isinstance(detail, (list, tuple)):
        return "; ".join(_message(item) for item in detail)
    return str(detail)


def error_response(status_code: int, message: str, error_code: str | None = None, headers=None) -> Response:
    body = {"code": status_code, "message": message}
    if error_code:
        body["error_code"] = error_code
    return Response(body, status=status_code, headers=headers)


def e2b_exception_handler(exc, context):
    if isinstance(exc, Http404):
        return error_response(404, str(exc) or "not found")
    if isinstance(exc, ApiError):
        return error_response(exc.status_code, str(exc.detail), exc.error_code, exc.extra_headers)
    if isinstance(exc, domain.LifecycleError):
        return error_response(status_of(exc), exc.message, exc.code, headers_of(exc))
    if isinstance(exc, exceptions.ParseError):
        return error_response(400, f"malformed JSON body: {exc.detail}")
    if isinstance(exc, OperationalError):  # no connection to be had (pool exhausted, database down or locked)
        log.warning("database unavailable: %s", exc)
        return error_response(503, "the database is busy or unreachable; try again")
    response = exception_handler(exc, context)
    if response is None:
        log.exception("unhandled API error", exc_info=exc)
        return error_response(status.HTTP_500_INTERNAL_SERVER_ERROR, "internal error")
    headers = {k: v for k, v in response.items() if k.lower() in ("www-authenticate", "retry-after", "allow")}
    return error_response(response.status_code, _message(response.data), headers=headers)


def _json(status_code: int, message: str):
    from django.http import JsonResponse  # noqa: PLC0415

    return JsonResponse({"code": status_code, "message": message}, status=status_code)


def json_not_found(request, exception=None):
    """handler404: an unknown URL is a JSON 404 too, so SDK clients never see HTML."""
    return _json(404, f"no route for {request.method} {request.path}")


def json_server_error(request):
    """handler500: even a crash outside DRF answers `{code, message}`."""
    return _json(500, "internal error")


def e2b_admin_not_served(request, rest: str = ""):
    """E2B's ``/admin/teams/...`` routes (its operators' calls) share Django's ``/admin/``
    prefix: without this they would get the admin site's HTML 403 (no CSRF token) instead of
    JSON. aenv's operators use the dashboard and ``manage.py`` for those jobs."""
    return _json(404, f"E2B's admin route {request.method} {request.path} is not served by aenv "
                      "(operators use the dashboard and manage.py)")


e2b_admin_not_served.csrf_exempt = True  # an API route: it answers the same for every method
