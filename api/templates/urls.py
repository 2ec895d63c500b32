"""Template API routes (E2B paths, at the root like the sandbox routes).

A name arrives percent-encoded as one segment and decoded by the server, so
``namespace/alias`` is two segments here: the template patterns take one or two. The
order matters: fixed paths (``templates/tags``, ``templates/aliases/…``) before the
patterns that would read them as a template name."""
from django.urls import path, re_path

from api.templates import views

REF = r"(?P<template_id>[^/]+(?:/[^/]+)?)"
BUILD = r"(?P<build_id>[^/]+)"

urlpatterns = [
    path("v3/templates", views.TemplatesV3View.as_view(), name="templates-v3"),
    path("v2/templates", views.TemplatesV2View.as_view(), name="templates-v2"),
    path("templates", views.TemplatesView.as_view(), name="templates"),
    path("templates/tags", views.TagsView.as_view(), name="template-tags-assign"),
    re_path(r"^templates/aliases/(?P<alias>[^/]+(?:/[^/]+)?)$", views.AliasView.as_view(), name="template-alias"),
    re_path(rf"^templates/{REF}/files/(?P<files_hash>[^/]+)$", views.FileUploadLinkView.as_view(),
            name="template-files"),
    re_path(rf"^templates/{REF}/builds/{BUILD}/status$", views.BuildStatusView.as_view(),
            name="template-build-status"),
    re_path(rf"^templates/{REF}/builds/{BUILD}/logs$", views.BuildLogsView.as_view(), name="template-build-logs"),
    re_path(rf"^templates/{REF}/builds/{BUILD}$", views.BuildView.as_view(), name="template-build"),
    re_path(rf"^templates/{REF}/tags$", views.TemplateTagsView.as_view(), name="template-tags"),
    re_path(rf"^v2/templates/{REF}/builds/{BUILD}$", views.BuildStartView.as_view(), name="template-build-start"),
    re_path(rf"^v2/templates/{REF}$", views.TemplateV2View.as_view(), name="template-v2"),
    re_path(rf"^templates/{REF}$", views.TemplateView.as_view(), name="template"),
    # The COPY archive upload: no API key (the URL's signed token), not a DRF view.
    path("template-files/<str:files_hash>", views.upload_view, name="template-file-upload"),
]
