"""CORS as E2B's public services answer it, so the TypeScript SDK works from a browser.

The E2B API and envd let any origin call them: they authenticate with headers
(``X-API-Key``, ``X-Access-Token``, ``Authorization``), never with cookies, so there is
nothing a foreign page could borrow. Preflights are answered without authentication,
allowing the standard methods and whatever headers the browser asks for (a ``*``
would not cover ``Authorization``); every response may be read, headers included
(the SDK reads ``X-Next-Token``). Nothing here sets ``Allow-Credentials``.

Used twice: ``ApiCorsMiddleware`` for the E2B API paths of the Django app (not the
dashboard or the admin, which keep their same-origin session and CSRF rules), and the
data plane (``dataplane.headers``) for envd's port and its own answers.
"""
import re

from django.http import HttpResponse

from api.middleware_base import AroundMiddleware

ALLOW_METHODS = "GET, POST, PUT, PATCH, DELETE, OPTIONS"
# Browsers cap this (Chromium at 2 h); longer would not save more preflights.
MAX_AGE = "7200"
# What a preflight that names no headers is told it may send.
DEFAULT_ALLOW_HEADERS = "*, Authorization, Content-Type, X-API-Key, X-Access-Token"

# The E2B API's paths (the SDK appends them to E2B_API_URL), as served by
# api.sandboxes.urls, api.snapshots.urls and api.templates.urls (with its upload URLs).
API_PATH = re.compile(r"^/(?:v\d+/)?(?:sandboxes|snapshots|templates|template-files|health)(?:/|$)")


def simple_headers() -> list[tuple[str, str]]:
    """Added to every (non-preflight) response: any origin may read it, headers too."""
    return [("Access-Control-Allow-Origin", "*"), ("Access-Control-Expose-Headers", "*")]


def preflight_headers(request_headers) -> list[tuple[str, str]]:
    """The answer to a preflight; ``request_headers`` maps lower-case names to values."""
    asked = (request_headers.get("access-control-request-headers") or "").strip()
    return [
        ("Access-Control-Allow-Origin", "*"),
        ("Access-Control-Allow-Methods", ALLOW_METHODS),
        ("Access-Control-Allow-Headers", asked[:4096] or DEFAULT_ALLOW_HEADERS),
        ("Access-Control-Expose-Headers", "*"),
        ("Access-Control-Max-Age", MAX_AGE),
        ("Vary", "Access-Control-Request-Headers, Access-Control-Request-Method"),
    ]


def is_preflight(method: str, request_headers) -> bool:
    return method == "OPTIONS" and "access-control-request-method" in request_headers


class ApiCorsMiddleware(AroundMiddleware):
    """CORS for the E2B API paths only; first in MIDDLEWARE, so a preflight is answered
    before authentication and every answer (errors included) carries the headers."""

    def before(self, request):
        if not API_PATH.match(request.path_info):
            return None
        headers = {k.lower(): v for k, v in request.headers.items()}
        if not is_preflight(request.method, headers):
            return None
        response = HttpResponse(status=204)
        for name, value in preflight_headers(headers):
            response[name] = value
        return response

    def after(self, request, response):
        if API_PATH.match(request.path_info):
            for name, value in simple_headers():
                response.setdefault(name, value)  # a view's own (e.g. exposing X-Next-Token) wins
        return response
