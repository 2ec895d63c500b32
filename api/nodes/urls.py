"""The node API's routes (``/nodes``, ``/nodes/{id}``), at the root like the E2B API."""
from django.urls import path

from api.nodes import views

urlpatterns = [
    path("nodes", views.NodesView.as_view(), name="nodes"),
    path("nodes/<str:node_id>", views.NodeView.as_view(), name="node"),
]
