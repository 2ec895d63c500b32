"""Lifecycle events and webhooks (E2B's ``/events/...``)."""
from django.urls import path

from api.events import views

urlpatterns = [
    path("events/sandboxes", views.TeamEventsView.as_view(), name="events-sandboxes"),
    path("events/sandboxes/<str:sandbox_id>", views.SandboxEventsView.as_view(), name="events-sandbox"),
    path("events/webhooks", views.WebhooksView.as_view(), name="events-webhooks"),
    path("events/webhooks/<str:webhook_id>", views.WebhookView.as_view(), name="events-webhook"),
    path("events/webhooks/<str:webhook_id>/deliveries", views.WebhookDeliveriesView.as_view(),
         name="events-webhook-deliveries"),
    path("events/webhooks/<str:webhook_id>/stats", views.WebhookStatsView.as_view(), name="events-webhook-stats"),
]
