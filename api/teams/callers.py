"""Which team a request acts for on the routes both teams and people may call: an API key's
own team, or for a person (an access token, the dashboard's session) the team named by E2B's
``X-Supabase-Team`` header, else the person's default team (``sandboxes.memberships``)."""
from api.auth import ApiKeyPrincipal
from sandboxes import memberships
from sandboxes.errors import Forbidden

TEAM_HEADER = "X-Supabase-Team"


def person_of(request):
    """The Django user behind the request, or None for an API key (a team, nobody)."""
    return None if isinstance(request.user, ApiKeyPrincipal) else request.user


async def team_of(request, named: str | None = None):
    """The team the request acts for; ``named`` (a path's teamID) must be it, or one the
    person is a member of (Forbidden otherwise, whether or not such a team exists)."""
    if isinstance(request.user, ApiKeyPrincipal):
        team = request.user.team
        if named is not None and named != str(team.pk):
            raise Forbidden(f"you are not authorized to access team '{named}' with this API key")
        return team
    return await memberships.team_for(request.user, named if named is not None else request.headers.get(TEAM_HEADER))
