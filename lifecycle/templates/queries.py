"""Reads: a build's status and log pages, the team's templates (one, all, a page), and
whether a name exists (``Template.exists``)."""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone as dt_timezone

from django.db.models import Count, Max, Q

from sandboxes.errors import Forbidden, Invalid, NotFound
from lifecycle.sandboxes.queries import Page, decode_page_token, encode_page_token
from sandboxes.models import Team, Template

from lifecycle import resolve
from template_builds.models import BuildLogEntry, BuildStatus as B, TemplateBuild, levels_from
from template_builds.names import InvalidName, parse
from lifecycle.templates.common import FORBID, build_uuid, settle_stale, team_template

MAX_LOG_PAGE = 100


# --------------------------------------------------------------------------- builds


async def build_of(team: Team, template_ref: str, build_id: str) -> TemplateBuild:
    """A build for its status or log: another team's is Forbidden, an unknown one (or not
    of that template) Invalid (E2B's 400 ``Build '<id>' not found``). A build whose node or
    builder went away is failed first (so a poll always ends)."""
    bid = build_uuid(build_id)
    build = await TemplateBuild.objects.select_related("template", "template__team").filter(pk=bid).afirst()
    if build is not None and build.template.team_id != team.pk:
        raise Forbidden(f"build '{bid}' belongs to another team")
    if build is None or template_ref not in (build.template_id, *build.template.names, build.template.alias):
        raise Invalid(f"Build '{bid}' not found")
    return await settle_stale(build)


async def team_build(team: Team, template_ref: str, build_id: str) -> TemplateBuild:
    """``GET /templates/{id}/builds/{buildID}``: one build of one of the team's templates
    (by the template's id, alias or name). An id that is not a UUID: Invalid; another
    team's build, a build of another template, or none: NotFound (nothing said about
    whose it is)."""
    bid = build_uuid(build_id)
    build = await TemplateBuild.objects.select_related("template", "template__team").filter(
        pk=bid, template__team=team, template__deleted_at__isnull=True).afirst()
    if build is None or template_ref not in (build.template_id, *build.template.names, build.template.alias):
        raise NotFound(f"build '{bid}' of template '{template_ref}' not found")
    return await settle_stale(build)


async def log_page(build: TemplateBuild, offset: int, limit: int, level: str | None = None) -> list[BuildLogEntry]:
    """Entries ``[offset, offset + limit)`` of the build's log (of those at ``level`` or
    above, when given), oldest first."""
    qs = BuildLogEntry.objects.filter(build=build)
    levels = levels_from(level)
    if levels is not None:
        qs = qs.filter(level__in=levels)
    limit = max(0, min(limit, MAX_LOG_PAGE))
    return [e async for e in qs.order_by("index")[offset:offset + limit]] if limit else []


async def log_window(build: TemplateBuild, *, cursor_ms: int | None, limit: int, direction: str,
                     level: str | None = None) -> list[BuildLogEntry]:
    """``GET …/logs``: up to ``limit`` entries from ``cursor_ms`` (a Unix time in ms;
    forward: at or after it, oldest first; backward: at or before it, newest first)."""
    qs = BuildLogEntry.objects.filter(build=build)
    levels = levels_from(level)
    if levels is not None:
        qs = qs.filter(level__in=levels)
    if cursor_ms is not None:
        when = datetime.fromtimestamp(cursor_ms / 1000, tz=dt_timezone.utc)
        qs = qs.filter(timestamp__gte=when) if direction == "forward" else qs.filter(timestamp__lte=when)
    qs = qs.order_by("index") if direction == "forward" else qs.order_by("-index")
    limit = max(0, min(limit, MAX_LOG_PAGE))
    return [e async for e in qs[:limit]] if limit else []


# --------------------------------------------------------------------------- templates


@dataclass
class TemplateView:
    """A template as the list and detail answers show it (E2B's ``Template``)."""

    template: Template
    build: TemplateBuild | None  # its newest ready build, else its newest build, else None
    build_count: int = 0
    spawn_count: int = 0
    last_spawned_at: datetime | None = None
    builds: list = field(default_factory=list)

    @property
    def build_id(self) -> str:
        if self.build is not None:
            return str(self.build.pk)
        # A template without builds (the global base): a stable id of its own.
        return str(uuid.uuid5(uuid.NAMESPACE_URL, f"aenv:template:{self.template.pk}"))

    @property
    def build_status(self) -> str:
        return self.build.status if self.build is not None else B.READY


def _team_templates(team: Team):
    return (Template.objects.select_related("team").filter(team=team, deleted_at__isnull=True)
            .annotate(n_builds=Count("builds", distinct=True)))


async def _view(template: Template, build_count: int | None = None) -> TemplateView:
    builds = TemplateBuild.objects.filter(template=template)
    shown = await builds.filter(status=B.READY).order_by("-created_at").afirst() or \
        await builds.order_by("-created_at").afirst()
    if shown is not None and shown.status == B.BUILDING:
        shown = await settle_stale(shown)
    spawned = await template.sandboxes.aaggregate(n=Count("id"), last=Max("created_at"))
    if build_count is None:
        build_count = await builds.acount()
    return TemplateView(template, shown, build_count, spawned["n"] or 0, spawned["last"])


async def list_templates(team: Team, team_id: str | None = None) -> list[TemplateView]:
    """``GET /templates``: the team's templates (E2B lists only the caller's); a ``teamID``
    of another team is Invalid."""
    if team_id and team_id != str(team.pk):
        raise Invalid("teamID must be your own team's ID")
    return [await _view(t, t.n_builds) async for t in _team_templates(team).order_by("-created_at", "-id")]


async def page_templates(team: Team, *, team_id: str | None = None, limit: int = 100,
                         next_token: str | None = None) -> Page:
    """``GET /v2/templates``: the same, newest first, in keyset pages (``X-Next-Token``)."""
    if team_id and team_id != str(team.pk):
        raise Invalid("teamID must be your own team's ID")
    qs = _team_templates(team)
    if next_token:
        when, last_id = decode_page_token(next_token)
        qs = qs.filter(Q(created_at__lt=when) | Q(created_at=when, id__lt=last_id))
    rows = [t async for t in qs.order_by("-created_at", "-id")[: limit + 1]]
    more = len(rows) > limit
    rows = rows[:limit]
    items = [await _view(t, t.n_builds) for t in rows]
    return Page(items, encode_page_token(rows[-1].created_at, rows[-1].pk) if more else None)


async def get_template(team: Team, template_ref: str, *, limit: int = 100, next_token: str | None = None
                       ) -> tuple[TemplateView, str | None]:
    """``GET /templates/{id}``: the team's template with a page of its builds, newest first."""
    template = await team_template(team, template_ref, others=FORBID)
    view = await _view(template)
    qs = TemplateBuild.objects.filter(template=template)
    if next_token:
        when, last_id = decode_page_token(next_token)
        qs = qs.filter(Q(created_at__lt=when) | Q(created_at=when, id__lt=last_id))
    rows = [b async for b in qs.order_by("-created_at", "-id")[: limit + 1]]
    more = len(rows) > limit
    view.builds = rows[:limit]
    token = encode_page_token(view.builds[-1].created_at, str(view.builds[-1].pk)) if more else None
    return view, token


async def alias_info(team: Team, ref: str) -> Template:
    """``GET /templates/aliases/{alias}`` (``Template.exists``): the team's template the
    name names. Not there: NotFound (the SDK's False); another team's (the global ``base``
    too): Forbidden (the SDK's True, "exists, not yours"). With a tag, the tag must have a
    ready build; without one, a registered alias is enough."""
    try:
        name = parse(ref)
    except InvalidName as exc:
        raise Invalid(f"invalid template name '{ref}': {exc}") from None
    template = await resolve.find_template(team, name)
    if template is None:
        raise NotFound(f"template '{ref}' not found")
    if template.team_id != team.pk:
        raise Forbidden(f"template '{ref}' belongs to another team")
    if name.tag is not None and await resolve.ready_build(template, name.tag) is None:
        raise NotFound(f"tag '{name.tag}' does not exist for template '{ref}'")
    return template
