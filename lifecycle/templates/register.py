"""``POST /v3/templates``: register a build of a template, by name.

An alias the team already has is rebuilt in place (same template id, ``public`` kept, a
new build); otherwise a new template is made. The build starts ``waiting`` and gets its
tags at once (a create only ever picks a *ready* build, so nothing changes for sandboxes
until it is). Older builds of the template that were never started and share a tag are
failed as superseded."""
from __future__ import annotations

from dataclasses import dataclass

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import IntegrityError, transaction

from sandboxes.errors import Conflict, Invalid, RateLimited
from sandboxes.models import Team, Template

from template_builds.models import BuildStatus as B, TemplateBuild, TemplateTag
from template_builds.names import DEFAULT_TAG, InvalidName, check_tag, is_uuid, new_template_id, parse
from template_builds.transitions import Log, transition_sync
from lifecycle.templates.common import check_shape

SUPERSEDED = "The build was superseded by a newer one."


@dataclass
class Registered:
    template: Template
    build: TemplateBuild
    tags: list[str]


def build_tags(name_tag: str | None, tags) -> list[str]:
    """The tags of a new build: the name's (unless ``default``) then ``tags``, lower-cased,
    without repeats; ``["default"]`` when that leaves none. Invalid for a bad tag."""
    out: list[str] = []
    try:
        if name_tag is not None:
            if is_uuid(name_tag):
                raise InvalidName(f"invalid tag '{name_tag}': a tag must not look like a build ID")
            out.append(name_tag)
        for tag in tags or []:
            tag = check_tag(tag)
            if tag not in out:
                out.append(tag)
    except InvalidName as exc:
        raise Invalid(str(exc)) from None
    return out or [DEFAULT_TAG]


async def request_build(team: Team, name: str, *, tags=None, cpu_count=None, memory_mb=None,
                        min_free_disk_mb=None) -> Registered:
    try:
        parsed = parse(name)
    except InvalidName as exc:
        raise Invalid(f"invalid template name '{name}': {exc}") from None
    if parsed.namespace is not None and parsed.namespace != team.slug:
        raise Invalid(f"namespace '{parsed.namespace}' is not your team's ('{team.slug}')")
    all_tags = build_tags(parsed.tag, tags)
    cpu, memory, min_free = check_shape(cpu_count, memory_mb, min_free_disk_mb)
    return await _register(team, parsed.alias, all_tags, cpu, memory, min_free)


@sync_to_async
def _register(team: Team, alias: str, tags: list[str], cpu: int, memory: int, min_free) -> Registered:
    if Template.objects.filter(team__isnull=True, alias=alias, deleted_at__isnull=True).exists():
        raise Conflict(f"template name '{alias}' is taken by a public template")
    limit = settings.AENV_TEMPLATE_MAX_CONCURRENT_BUILDS
    if TemplateBuild.objects.filter(template__team=team, status=B.BUILDING).count() >= limit:
        raise RateLimited(f"your team already runs {limit} template builds at once; wait for one to finish")
    for attempt in range(3):
        try:
            with transaction.atomic():
                return _insert(team, alias, tags, cpu, memory, min_free)
        except IntegrityError:  # a concurrent request made the alias (or the id was taken): again
            if attempt == 2:
                raise Conflict(f"template name '{alias}' is being registered by a concurrent request") from None
    raise AssertionError("unreachable")


def _insert(team: Team, alias: str, tags: list[str], cpu: int, memory: int, min_free) -> Registered:
    template = (Template.objects.select_for_update().select_related("team")
                .filter(team=team, alias=alias, deleted_at__isnull=True).first())
    if template is None:
        template = Template.objects.create(
            id=new_template_id(), team=team, alias=alias, public=False, image="", cpu_count=cpu, memory_mb=memory,
            disk_size_mb=settings.AENV_TEMPLATE_DISK_MB)
    build = TemplateBuild.objects.create(
        template=template, cpu_count=cpu, memory_mb=memory, disk_size_mb=settings.AENV_TEMPLATE_DISK_MB,
        min_free_disk_mb=min_free, envd_version=template.envd_version)
    TemplateTag.objects.bulk_create([TemplateTag(template=template, build=build, tag=tag) for tag in tags])
    older = (TemplateBuild.objects.filter(template=template, status=B.WAITING, tag_assignments__tag__in=tags)
             .exclude(pk=build.pk).values_list("pk", flat=True).distinct())
    for old in list(older):
        transition_sync(old, "fail", where={"status": B.WAITING}, reason_message=SUPERSEDED,
                        logs=[Log("error", f"Build failed: {SUPERSEDED}")])
    return Registered(template, build, tags)
