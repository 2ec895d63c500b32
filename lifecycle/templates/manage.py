"""Delete and publish a template.

``DELETE /templates/{id}`` takes a template id or name (the team's own; a tag is
ignored). Refused (Conflict) while live sandboxes run from it or snapshots taken from
them still build on it. Otherwise, in one transaction: builds still waiting or building
are failed ("the template was deleted"; a builder learns it at its next report), and
the template is deleted softly (E2B's way: the row stays for its sandboxes' history, its
alias is free for a new template, nothing resolves it). The snapshots its ready builds
produced are deleted afterwards. Anything that is not one of the team's templates is
what the path meant before templates had builds: a snapshot (``Sandbox.delete_snapshot``)."""
from __future__ import annotations

import logging

from asgiref.sync import sync_to_async
from django.db import transaction
from django.utils import timezone

from sandboxes.errors import Conflict, LifecycleError, NotFound
from sandboxes.models import Sandbox, Team, Template
from sandboxes.states import LIVE
from lifecycle.snapshots import delete as snapshot_delete
from snapshots import states as snapshot_states
from snapshots.models import Snapshot

from lifecycle import resolve
from template_builds.models import TemplateBuild
from template_builds.names import InvalidName, parse
from template_builds.transitions import ACTIVE, Log, transition_sync
from lifecycle.templates.common import FORBID, team_template

log = logging.getLogger(__name__)

DELETED = "the template was deleted"


async def _own_template(team: Team, ref: str) -> Template | None:
    try:
        name = parse(ref)
    except InvalidName:
        return None
    template = await resolve.find_template(team, name)
    return template if template is not None and template.team_id == team.pk else None


async def delete(team: Team, ref: str, actor: str = "") -> str:
    """Deletes the team's template ``ref``, or else the team's snapshot ``ref``; returns
    which ("template" / "snapshot")."""
    template = await _own_template(team, ref)
    if template is None:
        await snapshot_delete.delete_snapshot(team, ref, actor=actor)
        return "snapshot"
    results = await _delete_template(template)
    for snapshot_id in results:
        try:
            await snapshot_delete.delete_snapshot(team, snapshot_id, actor=actor, build_result=True)
        except LifecycleError as exc:  # the template is gone either way; its files wait for a later cleanup
            log.warning("template %s deleted, but its build snapshot %s was not: %s", template.pk, snapshot_id,
                        exc.message)
    log.info("template %s (%s) deleted by %s", template.pk, template.alias, actor)
    return "template"


@sync_to_async
def _delete_template(template: Template) -> list[str]:
    """The soft delete (see the module); returns the ids of its builds' result snapshots."""
    with transaction.atomic():
        if not Template.objects.filter(pk=template.pk, deleted_at__isnull=True).update(
                deleted_at=timezone.now(), updated_at=timezone.now()):
            raise NotFound(f"template '{template.pk}' not found (being deleted)")
        users = list(Sandbox.objects.filter(template=template, state__in=LIVE).order_by("created_at")
                     .values_list("id", flat=True)[:6])
        if users:
            shown = ", ".join(users[:5]) + (", …" if len(users) > 5 else "")
            raise Conflict(f"template '{template.alias or template.pk}' is still used by live sandboxes "
                           f"({shown}); kill them before deleting it")
        results = set(TemplateBuild.objects.filter(template=template, snapshot__isnull=False)
                      .values_list("snapshot_id", flat=True))
        taken = list(Snapshot.objects.filter(template=template, state__in=snapshot_states.LIVE, fork_capture=False)
                     .exclude(pk__in=results).values_list("id", flat=True)[:6])
        if taken:
            raise Conflict(f"template '{template.alias or template.pk}' is still used by snapshots "
                           f"({', '.join(taken[:5])}); delete them before deleting it")
        for build_id in TemplateBuild.objects.filter(template=template, status__in=list(ACTIVE)).values_list(
                "pk", flat=True):
            transition_sync(build_id, "fail", reason_message=DELETED, finished_at=timezone.now(),
                            logs=[Log("error", f"Build failed: {DELETED}")])
    return sorted(results)


async def set_public(team: Team, ref: str, public: bool) -> Template:
    """``PATCH /templates/{id}`` and ``/v2/templates/{id}``: publish or unpublish the team's
    template (a public template can be started by every team, by id or ``namespace/alias``)."""
    template = await team_template(team, ref, others=FORBID)
    await Template.objects.filter(pk=template.pk).aupdate(public=public, updated_at=timezone.now())
    template.public = public
    return template
