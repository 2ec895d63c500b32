"""What the template operations share: finding the template a request names (and whose it
is), the build shape checks, and failing builds whose node or builder went away."""
from __future__ import annotations

import logging
import uuid
from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from nodes.models import Node
from sandboxes.errors import Forbidden, Invalid, NotFound
from sandboxes.models import Team, Template

from lifecycle import resolve
from template_builds.models import BuildStatus as B, TemplateBuild
from template_builds.names import InvalidName, parse
from template_builds.transitions import Log, transition

log = logging.getLogger(__name__)

HIDE, FORBID = "hide", "forbid"


async def team_template(team: Team, ref: str, *, others: str = HIDE) -> Template:
    """The live template ``ref`` names (its id or ``[namespace/]alias``; a tag is ignored)
    for an operation that needs the caller to own it. Unknown or deleted: NotFound.
    Another team's: NotFound (``others=HIDE``) or Forbidden (``FORBID``, where E2B says
    403)."""
    try:
        name = parse(ref)
    except InvalidName:
        raise NotFound(f"template '{ref}' not found") from None
    template = await resolve.find_template(team, name)
    if template is None:
        raise NotFound(f"template '{ref}' not found")
    if template.team_id != team.pk:
        if others == FORBID:
            raise Forbidden(f"template '{ref}' belongs to another team")
        raise NotFound(f"template '{ref}' not found")
    return template


def build_uuid(build_id: str) -> uuid.UUID:
    try:
        return uuid.UUID(str(build_id))
    except ValueError:
        raise Invalid(f"invalid build ID '{build_id}': not a UUID") from None


def check_shape(cpu_count, memory_mb, min_free_disk_mb) -> tuple[int, int, int | None]:
    """E2B's build shape rules with aenv's team limits → (cpu, memory, min free disk);
    Invalid (400) saying which rule a value breaks."""
    cpu = settings.AENV_TEMPLATE_DEFAULT_CPU_COUNT if cpu_count is None else cpu_count
    memory = settings.AENV_TEMPLATE_DEFAULT_MEMORY_MB if memory_mb is None else memory_mb
    max_cpu, max_memory = settings.AENV_TEMPLATE_MAX_CPU_COUNT, settings.AENV_TEMPLATE_MAX_MEMORY_MB
    if cpu < 1 or (cpu != 1 and cpu % 2):
        raise Invalid(f"CPU count must be 1 or an even number, got {cpu}")
    if cpu > min(32, max_cpu):
        raise Invalid(f"CPU count {cpu} exceeds the maximum of {min(32, max_cpu)}")
    if memory < 128:
        raise Invalid(f"memory must be at least 128 MiB, got {memory}")
    if memory % 2:
        raise Invalid(f"memory must be an even number of MiB, got {memory}")
    if memory > max_memory:
        raise Invalid(f"memory {memory} MiB exceeds the maximum of {max_memory} MiB")
    if min_free_disk_mb is not None and not 0 <= min_free_disk_mb <= settings.AENV_TEMPLATE_MAX_DISK_MB:
        raise Invalid(f"minFreeDiskMb must be between 0 and {settings.AENV_TEMPLATE_MAX_DISK_MB}, "
                      f"got {min_free_disk_mb}")
    return cpu, memory, min_free_disk_mb


def _stale_reason(build: TemplateBuild, node: Node | None) -> str | None:
    now = timezone.now()
    started = build.started_at or build.created_at
    if now - started > timedelta(seconds=settings.AENV_TEMPLATE_BUILD_TIMEOUT):
        return f"the build timed out after {settings.AENV_TEMPLATE_BUILD_TIMEOUT} s"
    if build.accepted_at is None and now - started > timedelta(seconds=settings.AENV_TEMPLATE_PICKUP_TIMEOUT):
        return (f"no builder on node {build.node_id} picked the build up within "
                f"{settings.AENV_TEMPLATE_PICKUP_TIMEOUT} s")
    if node is None or not node.is_alive(now):
        return f"node {build.node_id} stopped while building (no heartbeat)"
    return None


async def settle_stale(build: TemplateBuild) -> TemplateBuild:
    """A ``building`` build that can no longer end by itself — its node stopped, no builder
    picked it up in time, or it ran past ``AENV_TEMPLATE_BUILD_TIMEOUT`` — is failed now,
    so a client polling it gets an answer. Returns the build as it now is."""
    if build.status != B.BUILDING:
        return build
    node = await Node.objects.filter(pk=build.node_id).afirst() if build.node_id else None
    reason = _stale_reason(build, node)
    if reason is None:
        return build
    if await transition(build.pk, "fail", reason_message=reason, reason_step="", finished_at=timezone.now(),
                        logs=[Log("error", f"Build failed: {reason}")]):
        log.warning("template build %s failed: %s", build.pk, reason)
    return await TemplateBuild.objects.select_related("template").aget(pk=build.pk)
