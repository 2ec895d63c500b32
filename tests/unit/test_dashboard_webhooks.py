"""The dashboard's webhook pages: sign-in required, the team's webhooks with their delivery
counts, one webhook's deliveries with every attempt (status code, error, latency), and
another team's webhook a 404."""
from datetime import timedelta

import pytest
from django.utils import timezone

from events import catalog, webhooks
from events.models import LifecycleEvent, WebhookAttempt, WebhookDelivery
from sandboxes.models import Sandbox

HOOK = {"name": "ci hook", "url": "https://hooks.example.com/in", "events": [catalog.CREATED],
        "signatureSecret": "a-long-enough-secret-value"}


def _history(team, template):
    """A webhook with one delivery that failed once (503) and then succeeded, and one pending."""
    hook = webhooks.create(team, HOOK)[0]
    sb = Sandbox.objects.create(team=team, template=template, state="running",
                                end_at=timezone.now() + timedelta(minutes=5))
    for seq, status in ((1, "success"), (2, "pending")):
        event = LifecycleEvent.objects.create(team=team, sandbox_id=sb.id, type=catalog.CREATED,
                                              timestamp=timezone.now(), seq=seq, payload={})
        d = WebhookDelivery.objects.create(webhook=hook, event=event, status=status, attempts=2 if seq == 1 else 0)
        if seq == 1:
            WebhookAttempt.objects.create(delivery=d, number=1, duration_ms=41.7, status_code=503,
                                          error_class="http_error", error_message="answered 503")
            WebhookAttempt.objects.create(delivery=d, number=2, duration_ms=12.2, status_code=200, ok=True)
    return hook, sb


@pytest.mark.parametrize("path", ["/dashboard/webhooks/", "/dashboard/webhooks/00000000-0000-0000-0000-000000000000/"])
def test_pages_require_login(client, db, path):
    resp = client.get(path)
    assert resp.status_code == 302 and resp["Location"].startswith("/dashboard/login/")


def test_list_shows_the_teams_webhooks_with_counts(dash, team, other_team, base_template):
    hook, _ = _history(team, base_template)
    webhooks.create(other_team, {**HOOK, "name": "their hook"})
    page = dash.get("/dashboard/webhooks/").content.decode()
    assert "ci hook" in page and "their hook" not in page and f"/dashboard/webhooks/{hook.pk}/" in page
    assert "https://hooks.example.com/in" in page and "a-long-enough-secret" not in page
    row = page[page.index("ci hook"):]
    assert [c.split("<")[0] for c in row.split('<td class="num">')[1:4]] == ["1", "0", "1"]
    assert 'href="/dashboard/webhooks/"' in dash.get("/dashboard/").content.decode()  # in the navigation


def test_detail_shows_every_attempt(dash, team, base_template):
    hook, sb = _history(team, base_template)
    page = dash.get(f"/dashboard/webhooks/{hook.pk}/").content.decode()
    assert page.count('class="attempt ') == 3  # two attempts, one not attempted yet
    assert "answered 503" in page and "http_error" in page and ">503<" in page and ">200<" in page
    assert "42 ms" in page and "12 ms" in page and sb.id in page and "not attempted yet" in page


def test_another_teams_webhook_is_404(dash, other_team):
    hook = webhooks.create(other_team, HOOK)[0]
    assert dash.get(f"/dashboard/webhooks/{hook.pk}/").status_code == 404
