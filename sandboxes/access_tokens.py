"""A person's access tokens (E2B's ``/access-tokens``): create (the token returned once)
and delete, and finding the token a request presents.

Why per user and not per team: E2B gives access tokens to people; aenv's people are
Django users, members of teams (``Team.members``). A token acts for its user, in the teams
the user is a member of at the time of each request: leaving a team takes that team away
from the user's tokens too."""
from __future__ import annotations

import uuid
from datetime import timedelta

from asgiref.sync import sync_to_async
from django.utils import timezone

from sandboxes.api_keys import clean_name
from sandboxes.errors import Invalid, NotFound
from sandboxes.models import AccessToken, hash_api_key

LAST_USED_EVERY = timedelta(seconds=60)  # how stale ``last_used_at`` may get (one write a minute at most)


async def create_token(user, name) -> tuple[AccessToken, str]:
    name = clean_name(name)
    return await sync_to_async(AccessToken.generate)(user, name)


def token_uid(raw: str) -> uuid.UUID:
    try:
        return uuid.UUID(str(raw))
    except ValueError:
        raise Invalid(f"invalid access token ID '{raw}': not a UUID") from None


async def delete_token(user, raw_id: str) -> None:
    """Deletes the user's token ``raw_id``; another user's (or none) is NotFound. A token
    may delete itself: the request it came with is answered, the next one is a 401."""
    uid = token_uid(raw_id)
    deleted, _ = await AccessToken.objects.filter(pk=uid, user=user).adelete()
    if not deleted:
        raise NotFound(f"access token '{uid}' not found")


def find_token(raw: str) -> AccessToken | None:
    """The live token ``raw`` is (its user loaded), marking it used; None: not one of ours,
    or its user is inactive."""
    token = (AccessToken.objects.select_related("user").filter(token_hash=hash_api_key(raw.strip()))
             .first())
    if token is None or not token.user.is_active:
        return None
    now = timezone.now()
    if token.last_used_at is None or now - token.last_used_at > LAST_USED_EVERY:
        AccessToken.objects.filter(pk=token.pk).update(last_used_at=now)
    return token
