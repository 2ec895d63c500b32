"""E2B API routes, at the root because the SDK appends its paths to E2B_API_URL."""
from django.urls import path

from api.sandboxes import logs as logs_api
from api.sandboxes import views

urlpatterns = [
    path("health", views.HealthView.as_view(), name="health"),
    path("sandboxes", views.SandboxesView.as_view(), name="sandboxes"),
    path("v2/sandboxes", views.SandboxesV2View.as_view(), name="sandboxes-v2"),
    path("sandboxes/<str:sandbox_id>", views.SandboxView.as_view(), name="sandbox"),
    path("sandboxes/<str:sandbox_id>/timeout", views.SandboxTimeoutView.as_view(), name="sandbox-timeout"),
    path("sandboxes/<str:sandbox_id>/network", views.SandboxNetworkView.as_view(), name="sandbox-network"),
    path("sandboxes/<str:sandbox_id>/pause", views.SandboxPauseView.as_view(), name="sandbox-pause"),
    path("sandboxes/<str:sandbox_id>/resume", views.SandboxResumeView.as_view(), name="sandbox-resume"),
    path("sandboxes/<str:sandbox_id>/connect", views.SandboxConnectView.as_view(), name="sandbox-connect"),
    path("v2/sandboxes/<str:sandbox_id>/connect", views.SandboxConnectV2View.as_view(), name="sandbox-connect-v2"),
    path("sandboxes/<str:sandbox_id>/refreshes", views.SandboxRefreshView.as_view(), name="sandbox-refreshes"),
    path("sandboxes/<str:sandbox_id>/logs", logs_api.SandboxLogsView.as_view(), name="sandbox-logs"),
    path("v2/sandboxes/<str:sandbox_id>/logs", logs_api.SandboxLogsV2View.as_view(), name="sandbox-logs-v2"),
]
