"""Snapshot and fork routes (E2B paths, at the root like the sandbox routes)."""
from django.urls import path

from api.snapshots import views

# DELETE /templates/{snapshotID} (the SDK's delete_snapshot) is served by template_builds'
# /templates/{id} route, which deletes the team's template of that name or else the snapshot.
urlpatterns = [
    path("sandboxes/<str:sandbox_id>/snapshots", views.SandboxSnapshotsView.as_view(), name="sandbox-snapshots"),
    path("sandboxes/<str:sandbox_id>/fork", views.SandboxForkView.as_view(), name="sandbox-fork"),
    path("snapshots", views.SnapshotsView.as_view(), name="snapshots"),
]
