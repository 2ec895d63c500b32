"""Cross-site WebSocket hijacking protection for the dashboard's sockets.

A WebSocket handshake carries the session cookie but is not covered by Django's
CSRF middleware, so any site could open a terminal in a signed-in user's name.
Browsers always send ``Origin`` on a WebSocket handshake; it must name this very
site (same scheme-less host:port as the ``Host`` header) or one of
``CSRF_TRUSTED_ORIGINS``. Channels' AllowedHostsOriginValidator is not enough
here: with ``ALLOWED_HOSTS = ["*"]`` (the default) it lets every origin in."""
from urllib.parse import urlsplit

from channels.security.websocket import WebsocketDenier
from django.conf import settings


def origin_allowed(headers: dict[bytes, bytes]) -> bool:
    origin = headers.get(b"origin", b"").decode("latin1").strip()
    host = headers.get(b"host", b"").decode("latin1").strip().lower()
    if not origin or origin == "null":
        return False
    if origin.rstrip("/") in {o.rstrip("/") for o in getattr(settings, "CSRF_TRUSTED_ORIGINS", [])}:
        return True
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return False
    default_port = {"http": "80", "https": "443"}[parts.scheme]
    netloc = parts.netloc.lower()
    return netloc == host or f"{netloc}:{default_port}" == host or netloc == host.removesuffix(f":{default_port}")


class SameOriginValidator:
    """ASGI middleware: a WebSocket from another origin is refused (HTTP 403)."""

    def __init__(self, application):
        self.application = application

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket" and not origin_allowed(dict(scope.get("headers", []))):
            return await WebsocketDenier()(scope, receive, send)
        return await self.application(scope, receive, send)
