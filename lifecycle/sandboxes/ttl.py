"""TTLs: set a sandbox's expiry (may shorten), or extend it (keep-alive, never shortens).
What happens at expiry (pause or kill) is the sweeper's job (``lifecycle.expiry``)."""
from __future__ import annotations

from datetime import datetime, timedelta

from asgiref.sync import sync_to_async
from django.db import transaction
from django.utils import timezone

from sandboxes.models import Sandbox, Team
from sandboxes.states import LIVE
from lifecycle.sandboxes import core
from sandboxes.errors import NotFound


async def set_timeout(team: Team, sandbox_id: str, seconds: int, actor: str = "") -> Sandbox:
    """``end_at = now + seconds`` (may shorten: 0 expires the sandbox at once)."""
    sandbox = await core.visible(team, sandbox_id)
    end_at = timezone.now() + timedelta(seconds=seconds)
    await set_end_at(sandbox, end_at, "set_timeout", actor, {"timeout": seconds})
    return sandbox


async def refresh(team: Team, sandbox_id: str, seconds: int, actor: str = "") -> Sandbox:
    """Keep-alive: extends ``end_at`` to ``now + seconds`` but never shortens it."""
    sandbox = await core.visible(team, sandbox_id)
    end_at = max(sandbox.end_at, timezone.now() + timedelta(seconds=seconds))
    if end_at != sandbox.end_at:
        await set_end_at(sandbox, end_at, "refresh", actor, {"duration": seconds})
    return sandbox


@sync_to_async
def set_end_at(sandbox: Sandbox, end_at: datetime, operation: str, actor: str, details: dict) -> None:
    """A new expiry and its event, in one transaction (the state does not change)."""
    with transaction.atomic():
        updated = Sandbox.objects.filter(pk=sandbox.pk, state__in=LIVE).update(
            end_at=end_at, updated_at=timezone.now()
        )
        if not updated:
            raise NotFound(f'sandbox "{sandbox.pk}" not found')
        core.event(sandbox.pk, operation, from_state=sandbox.state, to_state=sandbox.state, actor=actor,
                   details={**details, "end_at": end_at.isoformat()}).save()
    sandbox.end_at = end_at
