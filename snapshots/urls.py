"""Snapshot and fork routes (E2B paths, at the root like the sandbox routes)."""
from django.urls import path, re_path

from . import views

urlpatterns = [
    path("sandboxes/<str:sandbox_id>/snapshots", views.SandboxSnapshotsView.as_view(), name="sandbox-snapshots"),
    path("sandboxes/<str:sandbox_id>/fork", views.SandboxForkView.as_view(), name="sandbox-fork"),
    path("snapshots", views.SnapshotsView.as_view(), name="snapshots"),
    # Names arrive percent-encoded as one segment; "team/name" decodes to two parts.
    re_path(r"^templates/(?P<template_id>[^/]+(?:/[^/]+)?)$", views.TemplateDeleteView.as_view(),
            name="template-delete"),
]
