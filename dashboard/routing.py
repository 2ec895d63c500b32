"""WebSocket routes of the dashboard (mounted by config.asgi)."""
from django.urls import path

from dashboard.build_logs import BuildLogConsumer
from dashboard.terminal import TerminalConsumer

websocket_urlpatterns = [
    path("ws/sandboxes/<str:sandbox_id>/terminal", TerminalConsumer.as_asgi(), name="sandbox-terminal"),
    path("ws/templates/<str:template_id>/builds/<str:build_id>/logs", BuildLogConsumer.as_asgi(), name="build-log"),
]
