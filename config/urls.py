"""Top-level routes: the E2B-compatible API lives at the root (the SDK appends its
paths to E2B_API_URL as-is); admin and schema under their own prefixes."""
from django.contrib import admin
from django.urls import include, path, re_path
from django.views.generic import RedirectView
from drf_spectacular.views import SpectacularAPIView

from api.errors import e2b_admin_not_served
from api.sandboxes import metrics as metrics_api

from config.prometheus import metrics_view

urlpatterns = [
    # E2B's admin routes (/admin/teams/...) answer JSON, not the Django admin's HTML.
    re_path(r"^admin/teams/(?P<rest>.*)$", e2b_admin_not_served),
    path("admin/", admin.site.urls),
    path("api/schema", SpectacularAPIView.as_view(), name="schema"),
    path("dashboard/", include("dashboard.urls")),
    path("", RedirectView.as_view(url="/dashboard/", permanent=False)),
    # Prometheus (aggregates only; behind AENV_METRICS_TOKEN when set: config.prometheus).
    path("metrics", metrics_view, name="metrics"),
    # E2B's sandbox metrics; before api.sandboxes.urls, whose sandboxes/<id> would take "metrics".
    path("sandboxes/metrics", metrics_api.SandboxesMetricsView.as_view(), name="sandboxes-metrics"),
    path("sandboxes/<str:sandbox_id>/metrics", metrics_api.SandboxMetricsView.as_view(), name="sandbox-metrics"),
    path("", include("api.secrets.urls")),  # /secrets…, and the nodes' /nodes/secrets/resolve
    path("", include("api.nodes.urls")),
    path("", include("api.sandboxes.urls")),
    path("", include("api.events.urls")),  # E2B's /events/sandboxes and /events/webhooks
    path("", include("api.snapshots.urls")),
    # Teams, their metrics, API keys and access tokens.
    path("", include("api.teams.urls")),
    path("", include("api.volumes.urls")),  # /volumes and the volume content API (/volumecontent)
    # Template builds, tags, uploads, and /templates/{id} (a template, or a snapshot by id or name).
    path("", include("api.templates.urls")),
]

# Unknown URLs and crashes answer JSON {code, message} like the rest of the API.
handler404 = "api.errors.json_not_found"
handler500 = "api.errors.json_server_error"
