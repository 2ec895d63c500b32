"""What a template reference names (spec §5.5): the one resolver behind a create's
``templateID``, a build's ``fromTemplate`` and ``Template.exists``.

A reference may be a snapshot of the team (id or name, as before templates had builds),
a template id, an alias, ``alias:tag``, ``namespace/alias[:tag]`` or ``alias:<buildID>``.
Order: a snapshot of the team first (so existing snapshot names keep meaning what they
meant), then the template: with a namespace only that team's alias; a bare alias in the
caller's namespace, then among global aliases (``base``), then as a template id. The
build is the newest assignment of the tag (``default`` when none is given) whose build
is **ready**, so a failed rebuild leaves the previous build in service. A global template
without builds (``base``, made by ``manage.py bootstrap``) boots its vmm image."""
from __future__ import annotations

from dataclasses import dataclass

from asgiref.sync import sync_to_async
from django.db.models import Q

from sandboxes.errors import Failed, Invalid, NotFound
from sandboxes.models import Team, Template
from sandboxes.prepared import PreparedQuery
from lifecycle import sources

from template_builds.models import BuildStatus as B, TemplateBuild, TemplateTag
from template_builds.names import DEFAULT_TAG, InvalidName, Name, is_uuid, parse


@dataclass
class Source:
    """What a sandbox starts from: restore ``snapshot`` if set, else boot ``image``; with
    the shape and envd version that come with it."""

    template: Template
    build: TemplateBuild | None = None
    snapshot: object | None = None  # snapshots.models.Snapshot
    image: str = ""
    cpu_count: int = 2
    memory_mb: int = 512
    disk_size_mb: int = 2048
    envd_version: str = "0.6.4"


def _live():
    return Template.objects.select_related("team").filter(deleted_at__isnull=True)


def find_template_sync(team: Team, name: Name) -> Template | None:
    """The (not deleted) template ``name`` names, whoever owns it; None if none."""
    if name.namespace:
        return _live().filter(team__slug=name.namespace, alias=name.alias).first()
    # In this order: the team's alias, a global alias, a template id. One query for the three
    # (a create's hot path, issue 26), the order kept in Python; a handful of rows at most.
    order = (lambda t: t.team_id == team.pk and t.alias == name.alias,
             lambda t: t.team_id is None and t.alias == name.alias,
             lambda t: t.pk == name.alias)
    found = _CANDIDATES.rows(team=team.pk, alias=name.alias)
    for matches in order:
        template = next((t for t in found if matches(t)), None)
        if template is not None:
            return template
    return None


# The hot path's reads with their SQL compiled once (sandboxes.prepared): compiling them cost
# several times running them (issue 26: the resolve was ~1.9 ms of CPU per create, SQLite).
_CANDIDATES = PreparedQuery(
    lambda team, alias: _live().filter(Q(team=team, alias=alias) | Q(team__isnull=True, alias=alias) | Q(pk=alias))
    .order_by("id"),
    team=Team._meta.pk, alias=Template._meta.get_field("alias"))
_TAGGED = PreparedQuery(
    lambda template, tag: TemplateTag.objects.filter(template=template, tag=tag, build__status=B.READY)
    .order_by("-created_at", "-id").values_list("build_id", flat=True)[:1],
    template=Template._meta.pk, tag=TemplateTag._meta.get_field("tag"))
_BUILD = PreparedQuery(
    lambda pk: TemplateBuild.objects.select_related("snapshot", "snapshot__node", "snapshot__template")
    .filter(pk=pk).order_by("pk")[:1],
    pk=TemplateBuild._meta.pk)
_ANY_BUILD = PreparedQuery(lambda template: TemplateBuild.objects.filter(template=template).values_list("pk", flat=True)[:1],
                           template=Template._meta.pk)


def visible(team: Team, template: Template) -> bool:
    return template.team_id == team.pk or template.public


def ready_build_sync(template: Template, tag: str | None) -> TemplateBuild | None:
    """The build ``tag`` (None: ``default``; or a build id) picks: the newest assignment of
    the tag whose build is ready. None if none is."""
    builds = TemplateBuild.objects.select_related("snapshot", "snapshot__node", "snapshot__template")
    if tag and is_uuid(tag):
        return builds.filter(pk=tag, template=template, status=B.READY).first()
    assignment = _TAGGED.first(template=template.pk, tag=tag or DEFAULT_TAG)
    return _BUILD.first(pk=assignment) if assignment else None


def pick_build_sync(template: Template, tag: str | None, ref: str) -> TemplateBuild | None:
    """``ready_build`` or NotFound saying why; None only for a template without builds
    asked for no tag (it boots its image)."""
    build = ready_build_sync(template, tag)
    if build is not None:
        return build
    if tag is None and not _ANY_BUILD.rows(template=template.pk):
        return None
    if tag and is_uuid(tag):
        raise NotFound(f"build '{tag}' of template '{ref}' does not exist or is not ready")
    tag = tag or DEFAULT_TAG
    pending = TemplateTag.objects.filter(template=template, tag=tag,
                                         build__status__in=[B.WAITING, B.BUILDING]).exists()
    if pending:
        raise NotFound(f"tag '{tag}' of template '{ref}' has no ready build yet (it is being built)")
    raise NotFound(f"tag '{tag}' does not exist for template '{ref}'")


def source_of(template: Template, build: TemplateBuild | None) -> Source:
    """What a sandbox of ``template`` (its ``build``, if it has builds) starts from."""
    if build is None:
        return Source(template=template, image=template.image, cpu_count=template.cpu_count,
                      memory_mb=template.memory_mb, disk_size_mb=template.disk_size_mb,
                      envd_version=template.envd_version)
    if build.snapshot is None and not build.image:
        raise Failed(f"build {build.pk} of template {template.pk} has no result to start from any more",
                     code="template_build_without_result")
    return Source(template=template, build=build, snapshot=build.snapshot, image=build.image or template.image,
                  cpu_count=build.cpu_count, memory_mb=build.memory_mb, disk_size_mb=build.disk_size_mb,
                  envd_version=build.envd_version)


def resolve_template_sync(team: Team, ref: str) -> Source:
    """A template reference (no snapshots) → its Source. A name outside the grammar, or a
    template the team cannot see: Invalid (the request names nothing that exists); a
    known template without a ready build for the tag: NotFound."""
    try:
        name = parse(ref)
    except InvalidName as exc:
        raise Invalid(f"Invalid template reference: {ref}: {exc}") from None
    template = find_template_sync(team, name)
    if template is None or not visible(team, template):
        raise Invalid(f'template "{ref}" not found')
    return source_of(template, pick_build_sync(template, name.tag, ref))


def resolve_source_sync(team: Team, ref: str) -> Source:
    """What ``templateID`` (create) or ``fromTemplate`` (a build) names: a snapshot of the
    team (restored), else a template (§5.5). A snapshot still being captured: Conflict."""
    ref = (ref or "").strip()
    if not ref:
        raise Invalid("templateID is required")
    snapshot = sources.resolve_snapshot_sync(team, ref)
    if snapshot is not None:
        return Source(template=snapshot.template, snapshot=snapshot, cpu_count=snapshot.cpu_count,
                      memory_mb=snapshot.memory_mb, disk_size_mb=snapshot.disk_size_mb,
                      envd_version=snapshot.envd_version)
    return resolve_template_sync(team, ref)


# The async API: each a single thread hop for all its statements (a create's resolve was one
# hop per statement, four for a template: issue 26).
find_template = sync_to_async(find_template_sync)
ready_build = sync_to_async(ready_build_sync)
pick_build = sync_to_async(pick_build_sync)
resolve_template = sync_to_async(resolve_template_sync)
resolve_source = sync_to_async(resolve_source_sync)
