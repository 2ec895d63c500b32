"""Volume routes (E2B paths, at the root like the sandbox routes)."""
from django.urls import path

from api.volumes import content, views

urlpatterns = [
    path("volumes", views.VolumesView.as_view(), name="volumes"),
    path("volumes/<str:volume_id>", views.VolumeView.as_view(), name="volume"),
    path("volumecontent/<str:volume_id>/path", content.PathView.as_view(), name="volume-content-path"),
    path("volumecontent/<str:volume_id>/dir", content.DirView.as_view(), name="volume-content-dir"),
    path("volumecontent/<str:volume_id>/file", content.FileView.as_view(), name="volume-content-file"),
]
