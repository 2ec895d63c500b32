"""Secret routes (E2B's paths, at the root) and the nodes' resolve routes (secret values,
upstream proxy passwords)."""
from django.urls import path

from api.secrets import node, upstream, views

urlpatterns = [
    path("secrets", views.SecretsView.as_view(), name="secrets"),
    path("secrets/<str:secret_id>", views.SecretView.as_view(), name="secret"),
    path("secrets/<str:secret_id>/versions", views.SecretVersionsView.as_view(), name="secret-versions"),
    path("nodes/secrets/resolve", node.ResolveView.as_view(), name="node-secret-resolve"),
    path("nodes/egress-proxy/resolve", upstream.UpstreamPasswordView.as_view(), name="node-egress-proxy-resolve"),
]
