"""Which team a dashboard request acts for.

A user sees only teams they are a member of (``Team.members``). The current team is
kept in the session; a stale or foreign value falls back to the user's first team."""
from sandboxes.models import Team

SESSION_KEY = "dashboard_team_id"


def user_teams(user):
    if not user.is_authenticated:
        return Team.objects.none()
    return Team.objects.filter(members=user).order_by("name")


def current_team(request) -> Team | None:
    teams = user_teams(request.user)
    wanted = request.session.get(SESSION_KEY)
    team = teams.filter(pk=wanted).first() if wanted else None
    if team is None:
        team = teams.first()
        if team is not None:
            request.session[SESSION_KEY] = str(team.pk)
    return team


def set_current_team(request, team: Team) -> None:
    request.session[SESSION_KEY] = str(team.pk)
