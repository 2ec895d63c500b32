"""The team's webhooks and their delivery history (``events``): read-only pages, so a team
can see what reached its receivers, what did not and why, without the API. Another team's
webhook is a 404."""
from __future__ import annotations

from django.db.models import Count, Q
from django.http import Http404
from django.shortcuts import render
from django.views.decorators.http import require_GET

from events.models import Webhook, WebhookDelivery
from dashboard.views import _base_context, team_page

DELIVERIES_SHOWN = 100


@require_GET
@team_page
def webhook_list(request):
    hooks = (Webhook.objects.filter(team=request.team).order_by("created_at", "id")
             .annotate(delivered=Count("deliveries", filter=Q(deliveries__status="success")),
                       failed=Count("deliveries", filter=Q(deliveries__status="failed")),
                       pending=Count("deliveries", filter=Q(deliveries__status="pending"))))
    return render(request, "dashboard/webhooks.html", _base_context(request, "webhooks", hooks=hooks))


@require_GET
@team_page
def webhook_detail(request, webhook_id):
    hook = Webhook.objects.filter(pk=webhook_id, team=request.team).first()
    if hook is None:
        raise Http404("no such webhook")
    deliveries = (WebhookDelivery.objects.filter(webhook=hook).select_related("event")
                  .prefetch_related("attempt_log").order_by("-event__seq")[:DELIVERIES_SHOWN])
    return render(request, "dashboard/webhook_detail.html",
                  _base_context(request, "webhooks", hook=hook, deliveries=deliveries, shown=DELIVERIES_SHOWN))
