"""Team, API key, access token and team metric routes (E2B paths, at the root)."""
from django.urls import path

from api.teams import views

urlpatterns = [
    path("teams", views.TeamsView.as_view(), name="teams"),
    path("teams/<str:team_id>/metrics", views.TeamMetricsView.as_view(), name="team-metrics"),
    path("teams/<str:team_id>/metrics/max", views.TeamMetricsMaxView.as_view(), name="team-metrics-max"),
    path("api-keys", views.ApiKeysView.as_view(), name="api-keys"),
    path("api-keys/<str:key_id>", views.ApiKeyView.as_view(), name="api-key"),
    path("access-tokens", views.AccessTokensView.as_view(), name="access-tokens"),
    path("access-tokens/<str:token_id>", views.AccessTokenView.as_view(), name="access-token"),
]
