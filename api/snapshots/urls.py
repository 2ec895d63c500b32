"""Snapshot and fork routes (E2B paths, at the root like the sandbox routes)."""
from django.urls import path, re_path

from api.snapshots import views

# DELETE /templates/{snapshotID} (the SDK's delete_snapshot) is served by template_builds'
# /templates/{id} route, which deletes the team's template of that name or else the snapshot.
urlpatterns = [
    path("sandboxes/<str:sandbox_id>/snapshots", views.SandboxSnapshotsView.as_view(), name="sandbox-snapshots"),
    path("sandboxes/<str:sandbox_id>/fork", views.SandboxForkView.as_view(), name="sandbox-fork"),
    path("snapshots", views.SnapshotsView.as_view(), name="snapshots"),
    # AgentENV's: one snapshot by id or name, and its delete (the same as DELETE /templates/{id}).
    # A name may be "<team slug>/name" (percent-encoded by clients, decoded by the server): one "/".
    re_path(r"^snapshots/(?P<snapshot_id>[^/]+(?:/[^/]+)?)$", views.SnapshotView.as_view(), name="snapshot"),
]
