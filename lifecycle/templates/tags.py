"""Tags (spec §5.3): assign tags to the build a ``name:tag`` picks, remove tags from a
template, list a template's tags. Assignments are kept as history: a tag resolves to its
newest assignment whose build is ready."""
from __future__ import annotations

from dataclasses import dataclass

from asgiref.sync import sync_to_async
from django.db import transaction

from sandboxes.errors import Invalid, NotFound
from sandboxes.models import Team

from lifecycle import resolve
from template_builds.models import TemplateTag
from template_builds.names import DEFAULT_TAG, InvalidName, check_tag, parse
from lifecycle.templates.common import FORBID, team_template


@dataclass
class Assigned:
    tags: list[str]
    build_id: str


def _tags(tags) -> list[str]:
    if not tags:
        raise Invalid("tags must not be empty")
    out: list[str] = []
    try:
        for tag in tags:
            tag = check_tag(tag)
            if tag not in out:
                out.append(tag)
    except InvalidName as exc:
        raise Invalid(str(exc)) from None
    return out


def _name(ref: str):
    try:
        return parse(ref)
    except InvalidName as exc:
        raise Invalid(f"invalid template name '{ref}': {exc}") from None


async def assign_tags(team: Team, target: str, tags) -> Assigned:
    """``POST /templates/tags``: the newest ready build ``target`` (``name[:tag]``, tag
    ``default`` when none) picks gets ``tags`` too."""
    name = _name(target)
    new = _tags(tags)
    template = await team_template(team, target, others=FORBID)
    build = await resolve.ready_build(template, name.tag)
    if build is None:
        raise NotFound(f"tag '{name.tag or DEFAULT_TAG}' of template '{target}' has no ready build")
    await TemplateTag.objects.abulk_create([TemplateTag(template=template, build=build, tag=t) for t in new])
    return Assigned(new, str(build.pk))


async def remove_tags(team: Team, name_ref: str, tags) -> None:
    """``DELETE /templates/tags``: the template loses ``tags`` (every assignment of them)."""
    name = _name(name_ref)
    if name.tag is not None or ":" in name_ref:
        raise Invalid("name must be a template name without a tag")
    removed = _tags(tags)
    if DEFAULT_TAG in removed:
        raise Invalid("the 'default' tag cannot be removed")
    template = await team_template(team, name_ref, others=FORBID)
    await _delete(template, removed)


@sync_to_async
def _delete(template, tags: list[str]) -> None:
    with transaction.atomic():
        TemplateTag.objects.filter(template=template, tag__in=tags).delete()


async def list_tags(team: Team, ref: str) -> list[TemplateTag]:
    """``GET /templates/{id}/tags``: the newest assignment of each tag (also when its build
    failed), sorted by tag, of a template the team can see (its own, or public)."""
    name = _name(ref)
    template = await resolve.find_template(team, name)
    if template is None or not resolve.visible(team, template):
        raise NotFound(f"template '{ref}' not found")
    newest: dict[str, TemplateTag] = {}
    async for row in TemplateTag.objects.filter(template=template).order_by("tag", "-created_at", "-id"):
        newest.setdefault(row.tag, row)
    return [newest[tag] for tag in sorted(newest)]
