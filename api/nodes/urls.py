"""The node API's routes (``/nodes``, ``/nodes/{id}``), at the root like the E2B API; the
joining routes (``api.nodes.join``) before ``/nodes/{id}``, which would take their names."""
from django.urls import path

from api.nodes import join, views

urlpatterns = [
    path("nodes", views.NodesView.as_view(), name="nodes"),
    path("nodes/join", join.JoinView.as_view(), name="node-join"),
    path("nodes/check-in", join.CheckInView.as_view(), name="node-check-in"),
    path("nodes/join-tokens", join.JoinTokensView.as_view(), name="node-join-tokens"),
    path("nodes/join-tokens/<str:prefix>", join.JoinTokenView.as_view(), name="node-join-token"),
    path("nodes/<str:node_id>/revoke", join.NodeRevokeView.as_view(), name="node-revoke"),
    path("nodes/<str:node_id>", views.NodeView.as_view(), name="node"),
]
