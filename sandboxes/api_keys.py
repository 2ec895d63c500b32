"""A team's API keys as E2B's ``/api-keys`` manages them: list (never a secret, only E2B's
mask), create (the key returned once), rename, delete.

Why delete is a revocation: the dashboard revokes keys the same way (``revoked_at``), so a
deleted key keeps its row for the team's history (who made it, when it was last used) and
both edges agree on what "gone" means; E2B's API never shows it again.

A team keeps working: the team's last live key is never deleted (Conflict); the key a
request authenticates with may be deleted when another one is left, and stops working at
once (the next request with it is a 401). Sandboxes, snapshots and templates belong to the
team, not to a key, so nothing else changes."""
from __future__ import annotations

import uuid
from dataclasses import dataclass

from asgiref.sync import sync_to_async
from django.db import transaction
from django.utils import timezone

from sandboxes import key_cache
from sandboxes.errors import Conflict, Invalid, NotFound
from sandboxes.models import AccessToken, ApiKey, Team

NAME_MAX = 128
VALUE_LENGTH = 40  # hex digits after the kind's prefix (sandboxes.models.new_secret)
MASK_PREFIX_LENGTH = 2
MASK_SUFFIX_LENGTH = 4


@dataclass(frozen=True)
class Mask:
    """E2B's ``IdentifierMaskingDetails``: enough to recognise a secret, never to use it."""

    prefix: str
    value_length: int
    masked_value_prefix: str
    masked_value_suffix: str


def mask_of(row: ApiKey | AccessToken) -> Mask:
    """The mask of a stored key or token from the characters kept in clear (``prefix``: the
    kind's prefix and the first digits; ``suffix``: the last four, empty for keys older than
    the mask)."""
    kind = AccessToken.PREFIX if isinstance(row, AccessToken) else ApiKey.PREFIX
    first = row.prefix[len(kind):len(kind) + MASK_PREFIX_LENGTH] if row.prefix.startswith(kind) else ""
    return Mask(kind, VALUE_LENGTH, first, row.suffix[-MASK_SUFFIX_LENGTH:])


def clean_name(name) -> str:
    """A key's or token's name: a non-blank string of at most 128 characters."""
    if not isinstance(name, str) or not name.strip():
        raise Invalid("name must be a non-empty string")
    name = name.strip()
    if len(name) > NAME_MAX:
        raise Invalid(f"name must be at most {NAME_MAX} characters")
    return name


def key_uid(raw: str) -> uuid.UUID:
    """An ``apiKeyID`` of the path: a UUID (E2B's 400 otherwise)."""
    try:
        return uuid.UUID(str(raw))
    except ValueError:
        raise Invalid(f"invalid API key ID '{raw}': not a UUID") from None


async def list_keys(team: Team) -> list[ApiKey]:
    """The team's live keys, newest first, with who made them."""
    return [k async for k in ApiKey.objects.filter(team=team, revoked_at__isnull=True)
            .select_related("created_by").order_by("-created_at", "-id")]


async def create_key(team: Team, name, user=None) -> tuple[ApiKey, str]:
    """A new key of ``team`` made by ``user`` (None: made with an API key, nobody's);
    returns the row and the raw key, which is not stored."""
    name = clean_name(name)
    key, raw = await sync_to_async(ApiKey.generate)(team, name=name, created_by=user)
    return await ApiKey.objects.select_related("created_by").aget(pk=key.pk), raw


async def _live_key(team: Team, raw_id: str) -> ApiKey:
    uid = key_uid(raw_id)
    key = await ApiKey.objects.filter(team=team, uid=uid, revoked_at__isnull=True).afirst()
    if key is None:  # another team's key is not found either
        raise NotFound(f"API key '{uid}' not found")
    return key


async def rename_key(team: Team, raw_id: str, name) -> ApiKey:
    name = clean_name(name)
    key = await _live_key(team, raw_id)
    await ApiKey.objects.filter(pk=key.pk).aupdate(name=name)
    key.name = name
    return key


async def delete_key(team: Team, raw_id: str) -> ApiKey:
    """Revokes the team's key ``raw_id``; Conflict when it is the team's last live key."""
    key = await _live_key(team, raw_id)
    await sync_to_async(_revoke_unless_last)(team, key)
    return key


def _revoke_unless_last(team: Team, key: ApiKey) -> None:
    """Revoke, then count what is left, in one transaction with the team's row locked
    (PostgreSQL): two deletes of a team's last two keys cannot both win. On SQLite the
    first write holds the database until commit, which orders them the same way."""
    with transaction.atomic():
        Team.objects.select_for_update().filter(pk=team.pk).first()
        if not ApiKey.objects.filter(pk=key.pk, revoked_at__isnull=True).update(revoked_at=timezone.now()):
            raise NotFound(f"API key '{key.uid}' not found")
        if not ApiKey.objects.filter(team=team, revoked_at__isnull=True).exists():  # rolled back
            raise Conflict(f"API key '{key.uid}' is the team's last API key; create another one before "
                           "deleting it")
        transaction.on_commit(lambda: key_cache.forget(key.key_hash))  # refused at once here (key_cache)
