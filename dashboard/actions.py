"""Dashboard actions: the POSTs that change a sandbox or snapshot (kill, pause, resume,
timeout, snapshot, fork, create, delete a snapshot).

Why apart from the pages: each is a thin async wrapper that checks its form, calls the
lifecycle (``lifecycle.sandboxes`` / ``lifecycle.snapshots``, which write every state
change through ``sandboxes.transitions``) and shows the outcome inline (JSON) or as a
message; another team's sandbox or snapshot is a 404 like an unknown one."""
from __future__ import annotations

from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404, JsonResponse
from django.shortcuts import redirect
from django.urls import reverse
from django.views.decorators.http import require_POST

from api.errors import status_of
from lifecycle.sandboxes import create, kill, pause, ttl
from sandboxes.errors import LifecycleError
from lifecycle.sandboxes.options import SandboxOptions
from sandboxes.models import Sandbox
from lifecycle.snapshots import delete as snapshot_delete_op
from lifecycle.snapshots import fork as fork_op
from lifecycle.snapshots import snapshot as snapshot_op
from api.snapshots.serializers import SnapshotRequestSerializer

from dashboard.teams import current_team
from dashboard.views import _actor, parse_metadata_filter


def _action_team(request, sandbox_id):
    """Sync part of an action: the current team, and a 404 unless the sandbox is its."""
    team = current_team(request)
    if team is None or not Sandbox.objects.filter(pk=sandbox_id, team=team).exists():
        raise Http404("sandbox not found")
    return team


def _wants_json(request) -> bool:
    return "application/json" in request.headers.get("Accept", "")


def _action_result(request, sandbox_id, level: str, text: str, *, status: int = 200, **extra):
    """The outcome of an action: JSON ``{ok, level, message, ...}`` (with the API's
    status on errors) for the page's inline result, else a message + redirect."""
    if _wants_json(request):
        return JsonResponse({"ok": level != "error", "level": level, "message": text, **extra}, status=status)
    getattr(messages, level)(request, text)
    return redirect("dashboard:sandbox", sandbox_id=sandbox_id)


def _failed(request, sandbox_id, what: str, exc: LifecycleError):
    return _action_result(request, sandbox_id, "error", f"{what}: {exc.message}", status=status_of(exc))


def _seconds(raw, default: int | None = None) -> tuple[int | None, str]:
    """A timeout from a form: (seconds, "") or (None, what is wrong with it)."""
    try:
        seconds = int(raw) if raw not in (None, "") else default
    except ValueError:
        seconds = None
    if seconds is None or not 0 <= seconds <= settings.AENV_MAX_TIMEOUT:
        return None, f"Timeout must be a whole number of seconds from 0 to {settings.AENV_MAX_TIMEOUT}."
    return seconds, ""


@require_POST
@login_required
async def sandbox_kill(request, sandbox_id):
    # Async: a kill waits for the node (up to the service's deadline) without holding a thread.
    user = await request.auser()
    team = await sync_to_async(_action_team)(request, sandbox_id)
    try:
        sandbox = await kill.kill_sandbox(team, sandbox_id, actor=_actor(user))
    except LifecycleError as exc:
        return _failed(request, sandbox_id, "Kill failed", exc)
    if sandbox.error_reason:
        return _action_result(request, sandbox_id, "warning",
                              f"Sandbox {sandbox_id} killed, but: {sandbox.error_reason}", state=sandbox.state)
    return _action_result(request, sandbox_id, "success", f"Sandbox {sandbox_id} killed.", state=sandbox.state)


@require_POST
@login_required
async def sandbox_pause(request, sandbox_id):
    user = await request.auser()
    team = await sync_to_async(_action_team)(request, sandbox_id)
    try:
        sandbox = (await pause.pause_sandbox(team, sandbox_id, actor=_actor(user))).sandbox
    except LifecycleError as exc:
        return _failed(request, sandbox_id, "Pause failed", exc)
    return _action_result(request, sandbox_id, "success", f"Sandbox {sandbox_id} paused.", state=sandbox.state)


@require_POST
@login_required
async def sandbox_resume(request, sandbox_id):
    """Resume through ``connect_sandbox`` (like the SDK's connect): a paused sandbox is
    resumed with a fresh timeout; a running one only gets its timeout extended."""
    user = await request.auser()
    team = await sync_to_async(_action_team)(request, sandbox_id)
    seconds, error = _seconds(request.POST.get("seconds"), settings.AENV_DEFAULT_TIMEOUT)
    if error:
        return _action_result(request, sandbox_id, "error", error, status=400)
    try:
        resumed, result = await pause.connect_sandbox(team, sandbox_id, timeout=seconds, actor=_actor(user))
        sandbox = result.sandbox
    except LifecycleError as exc:
        return _failed(request, sandbox_id, "Resume failed", exc)
    text = f"Sandbox {sandbox_id} resumed." if resumed else f"Sandbox {sandbox_id} was already running."
    return _action_result(request, sandbox_id, "success" if resumed else "info", text, state=sandbox.state)


@require_POST
@login_required
async def sandbox_timeout(request, sandbox_id):
    user = await request.auser()
    team = await sync_to_async(_action_team)(request, sandbox_id)
    seconds, error = _seconds(request.POST.get("seconds"))
    if error:
        return _action_result(request, sandbox_id, "error", f"Timeout not changed: {error}", status=400)
    try:
        sandbox = await ttl.set_timeout(team, sandbox_id, seconds, actor=_actor(user))
    except LifecycleError as exc:
        return _failed(request, sandbox_id, "Timeout not changed", exc)
    from dashboard.templatetags.dashboard_tags import human_seconds  # noqa: PLC0415

    return _action_result(request, sandbox_id, "success",
                          f"Sandbox {sandbox_id} now ends in {human_seconds(seconds)}.", state=sandbox.state)


@require_POST
@login_required
async def sandbox_snapshot(request, sandbox_id):
    user = await request.auser()
    team = await sync_to_async(_action_team)(request, sandbox_id)
    form = SnapshotRequestSerializer(data={"name": (request.POST.get("name") or "").strip() or None})
    if not form.is_valid():
        return _action_result(request, sandbox_id, "error", f"Snapshot not taken: {form.errors['name'][0]}",
                              status=400)
    try:
        snapshot = (await snapshot_op.create_snapshot(team, sandbox_id, name=form.validated_data["name"],
                                                      actor=_actor(user))).snapshot
    except LifecycleError as exc:
        return _failed(request, sandbox_id, "Snapshot failed", exc)
    return _action_result(request, sandbox_id, "success", f"Snapshot {snapshot.pk} of {sandbox_id} taken.",
                          snapshot=str(snapshot.pk))


@require_POST
@login_required
async def sandbox_fork(request, sandbox_id):
    user = await request.auser()
    team = await sync_to_async(_action_team)(request, sandbox_id)
    try:
        count = int(request.POST.get("count", "1"))
    except ValueError:
        count = 0
    fork_max = fork_op.fork_max_count()
    if not 1 <= count <= fork_max:
        return _action_result(request, sandbox_id, "error", f"Fork count must be 1 to {fork_max}.", status=400)
    try:
        results = await fork_op.fork_sandbox(team, sandbox_id, count=count, actor=_actor(user))
    except LifecycleError as exc:
        return _failed(request, sandbox_id, "Fork failed", exc)
    forks = [r.sandbox for r in results if not isinstance(r, LifecycleError)]
    errors = [r.message for r in results if isinstance(r, LifecycleError)]
    text = f"Forked {sandbox_id} into {len(forks)}: {', '.join(f.id for f in forks) or 'none'}."
    if errors:
        text += f" {len(errors)} failed: {'; '.join(errors)}"
    level = "success" if not errors else ("warning" if forks else "error")
    return _action_result(request, sandbox_id, level, text, status=200 if forks or not errors else 500,
                          forks=[f.id for f in forks])


@require_POST
@login_required
async def sandbox_create(request):
    """New sandbox from a template or a snapshot (``template`` is either id, as in the
    API's ``templateID``). Waits for the boot; on success goes to the sandbox page."""
    user = await request.auser()
    team = await sync_to_async(current_team)(request)
    if team is None:
        raise Http404("no team")
    back = request.POST.get("back") or reverse("dashboard:sandboxes")
    if not back.startswith("/dashboard/"):
        back = reverse("dashboard:sandboxes")
    ref = (request.POST.get("template") or "").strip()
    metadata, error = parse_metadata_filter(request.POST.get("metadata", ""))
    seconds, timeout_error = _seconds(request.POST.get("seconds"), settings.AENV_DEFAULT_TIMEOUT)
    error = error or timeout_error
    if not ref:
        error = "Choose a template or snapshot."
    if error:
        return _create_result(request, back, "error", error, status=400)
    try:
        sandbox = (await create.create_sandbox(team, ref, SandboxOptions(metadata=metadata), timeout=seconds,
                                               actor=_actor(user))).sandbox
    except LifecycleError as exc:
        return _create_result(request, back, "error", f"Create failed: {exc.message}", status=status_of(exc))
    url = reverse("dashboard:sandbox", args=[sandbox.id])
    return _create_result(request, url, "success", f"Sandbox {sandbox.id} created from {ref}.", status=201,
                          sandbox=sandbox.id, redirect=url)


def _create_result(request, target: str, level: str, text: str, *, status: int, **extra):
    if _wants_json(request):
        return JsonResponse({"ok": level != "error", "level": level, "message": text, **extra}, status=status)
    getattr(messages, level)(request, text)
    return redirect(target)


@require_POST
@login_required
async def snapshot_delete(request, snapshot_id):
    """Deletes a snapshot and its files; refused (the API's 409) while sandboxes started
    from it still run. Another team's snapshot is a 404 like an unknown one."""
    user = await request.auser()
    team = await sync_to_async(current_team)(request)
    if team is None:
        raise Http404("snapshot not found")
    back = reverse("dashboard:snapshots")
    try:
        await snapshot_delete_op.delete_snapshot(team, snapshot_id, actor=_actor(user))
    except LifecycleError as exc:
        return _create_result(request, back, "error", f"Delete failed: {exc.message}", status=status_of(exc))
    return _create_result(request, back, "success", f"Snapshot {snapshot_id} deleted.", status=200, redirect=back)


# --------------------------------------------------------------------------- templates, nodes
