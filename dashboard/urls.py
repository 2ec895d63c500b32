"""Dashboard routes, mounted at /dashboard/."""
from django.contrib.auth import views as auth_views
from django.urls import path

from dashboard import actions, node_tokens, template_pages, views, volume_pages, webhook_pages

app_name = "dashboard"

urlpatterns = [
    path("login/", auth_views.LoginView.as_view(template_name="dashboard/login.html",
                                                 redirect_authenticated_user=True,
                                                 next_page="dashboard:overview"), name="login"),
    path("logout/", auth_views.LogoutView.as_view(next_page="dashboard:login"), name="logout"),
    path("", views.overview, name="overview"),
    path("team/", views.switch_team, name="switch-team"),
    path("sandboxes/", views.sandbox_list, name="sandboxes"),
    path("api/sandboxes.json", views.sandbox_list_json, name="sandboxes-json"),
    path("sandboxes/create", actions.sandbox_create, name="sandbox-create"),
    path("snapshots/", views.snapshot_list, name="snapshots"),
    path("snapshots/<str:snapshot_id>/delete", actions.snapshot_delete, name="snapshot-delete"),
    path("sandboxes/<str:sandbox_id>/", views.sandbox_detail, name="sandbox"),
    path("api/sandboxes/<str:sandbox_id>.json", views.sandbox_detail_json, name="sandbox-json"),
    path("sandboxes/<str:sandbox_id>/kill", actions.sandbox_kill, name="sandbox-kill"),
    path("sandboxes/<str:sandbox_id>/pause", actions.sandbox_pause, name="sandbox-pause"),
    path("sandboxes/<str:sandbox_id>/resume", actions.sandbox_resume, name="sandbox-resume"),
    path("sandboxes/<str:sandbox_id>/snapshot", actions.sandbox_snapshot, name="sandbox-snapshot"),
    path("sandboxes/<str:sandbox_id>/fork", actions.sandbox_fork, name="sandbox-fork"),
    path("sandboxes/<str:sandbox_id>/timeout", actions.sandbox_timeout, name="sandbox-timeout"),
    path("templates/", template_pages.template_list, name="templates"),
    path("templates/<str:template_id>/", template_pages.template_detail, name="template"),
    path("templates/<str:template_id>/builds/<uuid:build_id>/", template_pages.build_detail, name="build"),
    path("nodes/", views.node_list, name="nodes"),
    path("nodes/join-tokens/create", node_tokens.token_create, name="node-token-create"),
    path("nodes/join-tokens/<str:prefix>/revoke", node_tokens.token_revoke, name="node-token-revoke"),
    path("nodes/<str:node_id>/revoke", node_tokens.node_revoke, name="node-revoke"),
    path("api-keys/", views.api_key_list, name="api-keys"),
    path("api-keys/create", views.api_key_create, name="api-key-create"),
    path("api-keys/<int:key_id>/revoke", views.api_key_revoke, name="api-key-revoke"),
    path("volumes/", volume_pages.volume_list, name="volumes"),
    path("volumes/create", volume_pages.volume_create, name="volume-create"),
    path("volumes/<str:volume_id>/", volume_pages.volume_detail, name="volume"),
    path("volumes/<str:volume_id>/delete", volume_pages.volume_delete, name="volume-delete"),
    path("volumes/<str:volume_id>/download", volume_pages.volume_download, name="volume-download"),
    path("volumes/<str:volume_id>/upload", volume_pages.volume_upload, name="volume-upload"),
    path("webhooks/", webhook_pages.webhook_list, name="webhooks"),
    path("webhooks/<uuid:webhook_id>/", webhook_pages.webhook_detail, name="webhook"),
]
