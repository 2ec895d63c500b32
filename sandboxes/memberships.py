"""Which teams a person acts for: the teams they are a member of (``Team.members``), the
one they act for when they name none, and E2B's ``GET /teams`` answer.

Why a default: E2B marks one team of each user ``isDefault``; aenv keeps no such flag, so
the user's oldest team (then the smallest id) is it, the same answer every time."""
from __future__ import annotations

import uuid
from dataclasses import dataclass

from asgiref.sync import sync_to_async

from sandboxes.errors import Forbidden
from sandboxes.models import ApiKey, Team

CLI_KEY_NAME = "CLI login/configure"


@dataclass(frozen=True)
class Membership:
    team: Team
    is_default: bool
    api_key: str  # a new key of the team, made for this answer (E2B's CLI login)


async def teams_of(user) -> list[Team]:
    """The user's teams, oldest first (the first is the default)."""
    return [t async for t in Team.objects.filter(members=user).order_by("created_at", "id")]


async def team_for(user, raw_team_id: str | None) -> Team:
    """The team a user principal acts for: ``raw_team_id`` when given (Forbidden unless the
    user is a member: an unknown id and another team's get the same answer), else the
    default team (Forbidden when the user is in none)."""
    if raw_team_id:
        try:
            team_id = uuid.UUID(str(raw_team_id).strip())
        except ValueError:
            team_id = None
        team = None if team_id is None else await Team.objects.filter(pk=team_id, members=user).afirst()
        if team is None:
            raise Forbidden(f"you are not a member of team '{raw_team_id}'")
        return team
    teams = await teams_of(user)
    if not teams:
        raise Forbidden("you are not a member of any team")
    return teams[0]


async def cli_memberships(user) -> list[Membership]:
    """E2B's ``GET /teams``: each of the user's teams with a new API key made for the caller
    (keys are stored hashed, so an existing one cannot be shown again: E2B does the same
    for its CLI's login), named "CLI login/configure" and made by the user."""
    out = []
    for index, team in enumerate(await teams_of(user)):
        _, raw = await sync_to_async(ApiKey.generate)(team, name=CLI_KEY_NAME, created_by=user)
        out.append(Membership(team=team, is_default=index == 0, api_key=raw))
    return out
