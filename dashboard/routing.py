"""WebSocket routes of the dashboard (mounted by aenv_site.asgi)."""
from django.urls import path

from .terminal import TerminalConsumer

websocket_urlpatterns = [
    path("ws/sandboxes/<str:sandbox_id>/terminal", TerminalConsumer.as_asgi(), name="sandbox-terminal"),
]
