"""What a node's template builder reports, and the only way it changes a build.

The builder runs in the node worker (``agent.tasks.build_template``), which has Django
and the database, so it calls these functions directly (synchronous, thread-safe):

    from template_builds import progress

    if not progress.accept(build_id, node_id):      # first: the build is cancelled or gone
        return
    progress.report(build_id, "info", "[base] FROM python:3.11", step="base")
    ...                                              # report() returns False once the build
                                                     # was cancelled (template deleted,
                                                     # timed out): stop and clean up then
    progress.finish(build_id, result=progress.BuildResult(snapshot_id=snap.id))
    # or, on failure:
    progress.finish(build_id, error="failed to run command 'false': exit status 1", step="2")

Every call is durable before it returns (the SDK's next poll sees it) and goes through
``template_builds.transitions``; ``finish`` also appends the closing log line ("Build
finished, took …" / "Build failed: …"), in the same transaction as the status.

Steps are named as E2B names them: ``"base"`` (the image or the base template),
``"1"``…``"N"`` (the 1-based index into the start body's ``steps``) and ``"finalize"``
(start / ready commands, the snapshot); the SDK points its traceback at that call."""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from django.utils import timezone

from template_builds.models import BuildStatus as B, TemplateBuild
from template_builds.transitions import Log, append_sync, mark_accepted_sync, transition_sync


@dataclass(frozen=True)
class BuildResult:
    """What a ready build gives a create: a template snapshot to restore (memory and disk,
    the start command running) and/or a vmm image to boot, the size of its disk and the
    envd version in it, and anything else worth keeping (``details``: layer digests, the
    default user and workdir, the manifest)."""

    snapshot_id: str | None = None
    image: str | None = None
    disk_size_mb: int | None = None
    envd_version: str | None = None
    details: dict = field(default_factory=dict)


def accept(build_id, node_id: str) -> bool:
    """The builder on ``node_id`` starts on the build. False: it is no longer building
    there (cancelled, failed, or handed elsewhere): do nothing."""
    return mark_accepted_sync(build_id, node_id)


def report(build_id, level: str, message: str, step: str | None = None,
           timestamp: datetime | None = None) -> bool:
    """Appends a log entry (``level``: debug, info, warn or error). False once the build
    is no longer building: the builder should stop."""
    return append_sync(build_id, [Log(level, message, step or "", timestamp)], only_if={B.BUILDING})


def report_many(build_id, entries) -> bool:
    """Appends several entries at once (``(level, message, step, timestamp)`` each), in one
    transaction; False once the build is no longer building."""
    return append_sync(build_id, [Log(level, message, step or "", ts) for level, message, step, ts in entries],
                       only_if={B.BUILDING})


def is_building(build_id) -> bool:
    return TemplateBuild.objects.filter(pk=build_id, status=B.BUILDING).exists()


def _took(build_id) -> str:
    started = TemplateBuild.objects.filter(pk=build_id).values_list("started_at", flat=True).first()
    if started is None:
        return ""
    seconds = int((timezone.now() - started).total_seconds())
    return f", took {seconds // 60}m{seconds % 60}s" if seconds >= 60 else f", took {seconds}s"


def finish(build_id, result: BuildResult | None = None, *, error: str | None = None,
           step: str | None = None) -> bool:
    """Ends the build: ``ready`` with ``result``, or ``error`` with ``error`` (the reason the
    SDK raises) and the ``step`` it happened in. False if the build was no longer
    building (cancelled meanwhile): whatever the builder made is then nobody's, remove it."""
    if (result is None) == (error is None):
        raise ValueError("finish() takes exactly one of result or error")
    now = timezone.now()
    if error is not None:
        message = str(error) or "Build failed"
        return transition_sync(build_id, "fail", reason_message=message, reason_step=str(step or "")[:32],
                               finished_at=now, logs=[Log("error", f"Build failed: {message}", step or "")])
    if not (result.snapshot_id or result.image):
        raise ValueError("a build result needs a snapshot_id or an image a create can start from")
    fields = dict(snapshot_id=result.snapshot_id or None, image=result.image or "", result=dict(result.details),
                  finished_at=now)
    if result.disk_size_mb:
        fields["disk_size_mb"] = int(result.disk_size_mb)
    if result.envd_version:
        fields["envd_version"] = result.envd_version
    return transition_sync(build_id, "succeed", logs=[Log("info", f"Build finished{_took(build_id)}")], **fields)
