"""Make a system template's serving build match its recipe (see the package docstring):
nothing when the build tagged with the recipe is ready; else register a build of the
global template, store its COPY archives for the system team, start it on a node
(``lifecycle.start.start_waiting_build``: the ordinary placement and builder) and,
unless told not to, wait for it, printing its log.

Idempotent and safe to run concurrently with itself: a build of the same recipe that is
already waiting or building is waited for, not started again."""
from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
import uuid
from pathlib import Path

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import transaction

from sandboxes.errors import LifecycleError
from sandboxes.models import Team, Template

from template_builds import files
from lifecycle.templates import common, start
from template_builds.models import BuildStatus as B, TemplateBuild, TemplateFile, TemplateTag
from template_builds.names import DEFAULT_TAG
from template_builds.system import SYSTEM_TEAM_SLUG
from template_builds.system.recipes import Recipe, tree_archive

# The same in every database: the node's layer cache keys include the team.
SYSTEM_TEAM_ID = uuid.uuid5(uuid.NAMESPACE_URL, "https://aenv.dev/teams/aenv-system")
POLL_SECONDS = 2.0


class SystemTemplateError(Exception):
    """The build failed (with the builder's reason) or could not be started."""


def system_team() -> Team:
    team, _ = Team.objects.get_or_create(pk=SYSTEM_TEAM_ID, defaults={"slug": SYSTEM_TEAM_SLUG,
                                                                       "name": "aenv (system templates)"})
    return team


def global_template(recipe: Recipe) -> Template:
    """The public template row every team resolves ``recipe.alias`` to."""
    with transaction.atomic():
        template, created = Template.objects.select_for_update().get_or_create(
            pk=recipe.alias, defaults=dict(team=None, alias=recipe.alias, public=True, image="",
                                           cpu_count=recipe.cpu_count, memory_mb=recipe.memory_mb,
                                           disk_size_mb=settings.AENV_TEMPLATE_DISK_MB))
        if not created and (template.team_id or template.deleted_at or not template.public):
            raise SystemTemplateError(f"template id '{recipe.alias}' is taken by another template")
    return template


def _builds_of_recipe(template: Template, recipe: Recipe):
    return TemplateBuild.objects.filter(template=template, tag_assignments__tag=recipe.tag).distinct()


def store_trees(team: Team, recipe: Recipe) -> None:
    """Each COPY tree archived into the file store as the system team's (once per hash)."""
    store = files.get_file_store()
    for tree in recipe.trees.values():
        h = tree.files_hash
        if TemplateFile.objects.filter(team=team, hash=h).exists() and store.exists(team.pk, h):
            continue
        with tempfile.TemporaryDirectory(dir=store.staging_dir()) as tmp:
            archive = Path(tmp) / "tree.tar.gz"
            if tree.archive is not None:  # made ahead with the tree (a large one, archived once)
                shutil.copyfile(tree.archive, archive)
            else:
                tree_archive(tree.root, tree.name, archive, tree.keep_caches)
            size = archive.stat().st_size
            store.save(team.pk, h, archive)
        TemplateFile.objects.update_or_create(team=team, hash=h, defaults=dict(size_bytes=size, gzip=True))


def register(recipe: Recipe) -> tuple[Team, TemplateBuild]:
    """The build of this recipe to use: a ready one (its snapshot still there), else one in
    progress, else a new waiting one."""
    team = system_team()
    template = global_template(recipe)
    ours = _builds_of_recipe(template, recipe).select_related("snapshot")
    for status in (B.READY, B.BUILDING, B.WAITING):
        build = ours.filter(status=status).order_by("-created_at").first()
        if build is not None and (status != B.READY or _snapshot_ok(build)):
            return team, build
    store_trees(team, recipe)
    with transaction.atomic():
        build = TemplateBuild.objects.create(template=template, cpu_count=recipe.cpu_count,
                                             memory_mb=recipe.memory_mb,
                                             disk_size_mb=settings.AENV_TEMPLATE_DISK_MB,
                                             envd_version=template.envd_version)
        TemplateTag.objects.bulk_create([TemplateTag(template=template, build=build, tag=tag)
                                         for tag in (DEFAULT_TAG, recipe.tag)])
    return team, build


def _snapshot_ok(build: TemplateBuild) -> bool:
    """A ready build still has what a create starts from (its snapshot was not deleted)."""
    if build.snapshot_id is None:
        return bool(build.image)
    return build.snapshot.state == "ready"


async def ensure(recipe: Recipe, *, wait: bool = True, timeout: float | None = None, say=print) -> TemplateBuild:
    """The recipe's build, ready (``wait``) or at least started. Raises SystemTemplateError."""
    team, build = await sync_to_async(register)(recipe)
    if build.status == B.READY:
        say(f"{recipe.alias}: up to date (build {build.pk}, {recipe.tag})")
        return build
    if build.status == B.WAITING:
        say(f"{recipe.alias}: building {recipe.tag} (build {build.pk})")
        try:
            build = await start.start_waiting_build(team, build, recipe.body(), actor="system")
        except LifecycleError as exc:
            build = await TemplateBuild.objects.aget(pk=build.pk)
            if build.status == B.WAITING:  # no node with room, or its queue unreachable
                raise SystemTemplateError(f"{recipe.alias}: the build could not start: {exc.message}") from exc
    else:
        say(f"{recipe.alias}: build {build.pk} of {recipe.tag} is {build.status}; waiting for it")
    if not wait:
        return build
    return await follow(build, timeout=timeout or settings.AENV_TEMPLATE_BUILD_TIMEOUT + 60, say=say)


async def follow(build: TemplateBuild, *, timeout: float, say=print) -> TemplateBuild:
    """Prints the build's log until it ends; the ended build, or SystemTemplateError."""
    end = time.monotonic() + timeout
    offset = 0
    while True:
        build = await common.settle_stale(await TemplateBuild.objects.select_related("template").aget(pk=build.pk))
        async for entry in build.log_entries.filter(index__gte=offset).order_by("index"):
            say(f"  {entry.message}")
            offset = entry.index + 1
        if build.status == B.READY:
            return build
        if build.status == B.ERROR:
            step = f" at step {build.reason_step}" if build.reason_step else ""
            raise SystemTemplateError(f"{build.template_id}: build {build.pk} failed{step}: {build.reason_message}")
        if time.monotonic() > end:
            raise SystemTemplateError(f"{build.template_id}: build {build.pk} still {build.status} after {timeout:.0f}s")
        await asyncio.sleep(POLL_SECONDS)
