"""A team's webhooks: register, read, change, delete, in E2B's shapes (``WebhookCreate``,
``WebhookConfiguration``, ``WebhookDetail``).

Why the checks live here and not in a serializer: the dashboard may manage webhooks too,
and a URL must be judged the same way wherever it comes from (``events.outbound``)."""
from __future__ import annotations

import secrets
import socket
import uuid

from django.conf import settings
from django.db import transaction

from events import catalog, outbound, sealing
from events.models import Webhook
from sandboxes.errors import Invalid, NotFound
from sandboxes.models import Team

SECRET_MIN, SECRET_MAX = 16, 256
NAME_MAX = 128


def detail(hook: Webhook) -> dict:
    """E2B's ``WebhookDetail`` (also its ``WebhookCreation``): never the secret."""
    return {"id": str(hook.id), "teamId": str(hook.team_id), "name": hook.name,
            "createdAt": catalog.iso(hook.created_at), "url": hook.url, "enabled": hook.enabled,
            "events": list(hook.events)}


def get(team: Team, webhook_id) -> Webhook:
    """The team's webhook, or NotFound (another team's is not found either)."""
    try:
        key = uuid.UUID(str(webhook_id))
    except ValueError:
        raise Invalid(f'webhookID "{webhook_id}" is not a UUID') from None
    hook = Webhook.objects.filter(pk=key, team=team).first()
    if hook is None:
        raise NotFound(f'webhook "{webhook_id}" not found')
    return hook


def check_url(url) -> str:
    """A URL a webhook may have: http(s), and a host that is not (now) a refused address.
    A host that does not resolve yet is accepted; every delivery checks it again."""
    try:
        target = outbound.check_url(url)
        outbound.check_destination(target, settings.AENV_WEBHOOK_ALLOW_PRIVATE)
    except outbound.BadUrl as exc:
        raise Invalid(f"url: {exc}") from None
    except (socket.gaierror, UnicodeError):
        pass
    return url


def check_events(events) -> list[str]:
    if not isinstance(events, list) or not events:
        raise Invalid(f"events: must list at least one event type of {', '.join(catalog.TYPES)}")
    unknown = [e for e in events if e not in catalog.TYPES]
    if unknown:
        raise Invalid(f"events: unknown event type(s) {', '.join(map(str, unknown))}; "
                      f"known: {', '.join(catalog.TYPES)}")
    return list(dict.fromkeys(events))


def check_name(name) -> str:
    if not isinstance(name, str) or not name.strip() or len(name) > NAME_MAX:
        raise Invalid(f"name: must be a non-empty string of at most {NAME_MAX} characters")
    return name.strip()


def check_secret(secret) -> str:
    if not isinstance(secret, str) or not SECRET_MIN <= len(secret) <= SECRET_MAX:
        raise Invalid(f"signatureSecret: must be a string of {SECRET_MIN} to {SECRET_MAX} characters")
    return secret


def check_enabled(enabled) -> bool:
    if not isinstance(enabled, bool):
        raise Invalid("enabled: must be true or false")
    return enabled


def _body(data) -> dict:
    if not isinstance(data, dict):
        raise Invalid("the body must be a JSON object")
    return data


def create(team: Team, data) -> tuple[Webhook, str | None]:
    """Registers a webhook → (webhook, the secret when aenv made it, to be shown this once).
    E2B requires ``signatureSecret``; without one aenv makes a random one."""
    data = _body(data)
    url = check_url(data.get("url"))
    events = check_events(data.get("events"))
    name = check_name(data["name"]) if data.get("name") is not None else outbound.check_url(url).host
    enabled = check_enabled(data["enabled"]) if "enabled" in data else True
    made = None
    if data.get("signatureSecret") is not None:
        secret = check_secret(data["signatureSecret"])
    else:
        secret = made = "whsec_" + secrets.token_urlsafe(32)
    with transaction.atomic():
        # Counted under the team's row lock, so two creates cannot both take the last place.
        Team.objects.select_for_update().filter(pk=team.pk).first()
        if Webhook.objects.filter(team=team).count() >= settings.AENV_WEBHOOKS_PER_TEAM:
            raise Invalid(f"a team may have at most {settings.AENV_WEBHOOKS_PER_TEAM} webhooks "
                          "(AENV_WEBHOOKS_PER_TEAM)", code="too_many_webhooks")
        hook = Webhook.objects.create(team=team, name=name, url=url, events=events, enabled=enabled,
                                      secret_sealed=sealing.seal(secret))
    return hook, made


def update(team: Team, webhook_id, data) -> Webhook:
    """E2B's PATCH: the fields given replace the webhook's (a new ``signatureSecret`` too)."""
    data = _body(data)
    hook = get(team, webhook_id)
    if "url" in data:
        hook.url = check_url(data["url"])
    if "events" in data:
        hook.events = check_events(data["events"])
    if "name" in data:
        hook.name = check_name(data["name"])
    if "enabled" in data:
        hook.enabled = check_enabled(data["enabled"])
    if "signatureSecret" in data:
        hook.secret_sealed = sealing.seal(check_secret(data["signatureSecret"]))
    hook.save()
    return hook


def delete(team: Team, webhook_id) -> None:
    """Deletes the webhook with its delivery history."""
    get(team, webhook_id).delete()
