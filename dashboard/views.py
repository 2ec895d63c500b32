"""Team dashboard: server-rendered pages scoped to the signed-in user's current team.

State never changes here directly: sandbox actions go through
``sandboxes.lifecycle`` / ``snapshots.lifecycle`` (which write every state change
through ``sandboxes.transitions``), and another team's sandbox or key is a 404 on every
page and action. Form input is checked here, like the API's serializers do."""
from __future__ import annotations

import functools
from datetime import timedelta

from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.db.models import Count, Q, Sum
from django.db.models.fields.json import KeyTransform
from django.http import Http404, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST

from nodes.models import Node
from sandboxes.errors import status_of
from sandboxes.lifecycle import create, kill, pause, ttl
from sandboxes.lifecycle.errors import LifecycleError
from sandboxes.lifecycle.options import SandboxOptions
from sandboxes.models import ApiKey, Sandbox, SandboxEvent, Template
from sandboxes.states import LIVE, RESERVING, SandboxState, can_start
from snapshots.lifecycle import delete as snapshot_delete_op
from snapshots.lifecycle import fork as fork_op
from snapshots.lifecycle import snapshot as snapshot_op
from snapshots.serializers import SnapshotRequestSerializer
from snapshots.models import Snapshot

from .teams import current_team, set_current_team, user_teams
from .terminal import TERMINAL_STATES, gone_reason

LIST_LIMIT = 200
TIMEOUT_CHOICES = [(300, "5 minutes"), (900, "15 minutes"), (3600, "1 hour"), (4 * 3600, "4 hours")]
# Node usage counts the sandboxes that hold a VM (or are about to).


def team_page(view):
    """``login_required`` + the current team as ``request.team`` (a page explaining
    what to do when the user belongs to no team)."""

    @login_required
    @functools.wraps(view)
    def wrapper(request, *args, **kwargs):
        team = current_team(request)
        if team is None:
            return render(request, "dashboard/no_team.html", status=403)
        request.team = team
        return view(request, *args, **kwargs)

    return wrapper


def _base_context(request, section: str, **extra) -> dict:
    return {"team": request.team, "teams": list(user_teams(request.user)), "section": section, **extra}


def _actor(user) -> str:
    return f"dashboard:{user.get_username()}"


# --------------------------------------------------------------------------- team switcher


@require_POST
@login_required
def switch_team(request):
    team = user_teams(request.user).filter(slug=request.POST.get("team", "")).first()
    if team is None:
        raise Http404("no such team")
    set_current_team(request, team)
    target = request.POST.get("next", "")
    # Only local dashboard paths; a sandbox page of the old team would 404, so go to the list.
    if not target.startswith("/dashboard/"):
        target = reverse("dashboard:overview")
    elif target.startswith("/dashboard/sandboxes/"):
        target = reverse("dashboard:sandboxes")
    return redirect(target)


# --------------------------------------------------------------------------- overview


def _node_rows():
    usage = {
        row["node_id"]: row
        for row in Sandbox.objects.filter(node__isnull=False, state__in=LIVE)
        .values("node_id")
        .annotate(
            vcpu=Sum("cpu_count", filter=Q(state__in=RESERVING)),
            memory=Sum("memory_mb", filter=Q(state__in=RESERVING)),
            running=Count("id", filter=Q(state__in=RESERVING)),
            paused=Count("id", filter=Q(state=SandboxState.PAUSED)),
        )
    }
    now = timezone.now()
    rows = []
    for node in Node.objects.all():
        u = usage.get(node.id, {})
        rows.append({
            "node": node,
            "alive": node.is_alive(now),
            "heartbeat_age": (now - node.last_heartbeat_at).total_seconds() if node.last_heartbeat_at else None,
            "vcpu_used": u.get("vcpu") or 0,
            "memory_used": u.get("memory") or 0,
            "running": u.get("running") or 0,
            "paused": u.get("paused") or 0,
        })
    return rows


def _chart(team, hours: int = 24, width: int = 640, height: int = 160) -> dict:
    """Live sandboxes of the team at the end of each hour over the last ``hours``,
    as SVG coordinates (no library)."""
    now = timezone.now()
    start = now - timedelta(hours=hours)
    relevant = Sandbox.objects.filter(team=team).filter(
        Q(state__in=LIVE) | Q(killed_at__gte=start) | Q(updated_at__gte=start)
    ).values_list("created_at", "killed_at", "state", "updated_at")
    spans = []
    for created, killed, state, updated in relevant:
        end = killed or (updated if state == SandboxState.ERROR else None)
        spans.append((created, end))
    points = []
    for i in range(hours + 1):
        t = start + timedelta(hours=i)
        alive = sum(1 for created, end in spans if created <= t and (end is None or end > t))
        points.append((t, alive))
    peak = max((n for _, n in points), default=0)
    scale = max(peak, 1)
    pad = 24
    coords = []
    for i, (t, n) in enumerate(points):
        x = pad + i * (width - 2 * pad) / hours
        y = height - pad - n * (height - 2 * pad) / scale
        coords.append({"x": round(x, 1), "y": round(y, 1), "n": n, "t": t})
    line = " ".join(f"{c['x']},{c['y']}" for c in coords)
    area = f"{pad},{height - pad} {line} {width - pad},{height - pad}"
    return {"width": width, "height": height, "pad": pad, "points": coords, "line": line, "area": area,
            "peak": peak, "now": points[-1][1], "baseline": height - pad, "top": pad, "right": width - pad,
            "labels": [coords[0], coords[hours // 2], coords[-1]]}


@require_GET
@team_page
def overview(request):
    team = request.team
    counts = dict(Sandbox.objects.filter(team=team).values_list("state").annotate(n=Count("id")).values_list("state", "n"))
    state_counts = [(state, counts.get(state, 0)) for state in SandboxState.values]
    events = SandboxEvent.objects.filter(sandbox__team=team).order_by("-started_at", "-id")[:15]
    return render(request, "dashboard/overview.html", _base_context(
        request, "overview", nodes=_node_rows(), state_counts=state_counts,
        live_total=sum(counts.get(s, 0) for s in LIVE), events=events, chart=_chart(team),
    ))


# --------------------------------------------------------------------------- sandboxes


def parse_metadata_filter(raw: str) -> tuple[dict[str, str], str]:
    """``"env=prod, user=ann"`` (``,`` or ``&`` between pairs) → ``({...}, error)``."""
    pairs, bad = {}, []
    for part in raw.replace("&", ",").split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            bad.append(part)
            continue
        pairs[key.strip()] = value.strip()
    error = f"ignored {', '.join(repr(b) for b in bad)}: metadata filters look like key=value" if bad else ""
    return pairs, error


def _filtered_sandboxes(team, params):
    filters = {"state": params.get("state", ""), "template": params.get("template", ""),
               "metadata": params.get("metadata", "").strip()}
    qs = Sandbox.objects.filter(team=team).select_related("template", "node")
    if filters["state"] == "live":
        qs = qs.filter(state__in=LIVE)
    elif filters["state"] in SandboxState.values:
        qs = qs.filter(state=filters["state"])
    else:
        filters["state"] = ""
    if filters["template"]:
        qs = qs.filter(template_id=filters["template"])
    metadata, error = parse_metadata_filter(filters["metadata"])
    for i, (key, value) in enumerate(metadata.items()):
        alias = f"_meta_{i}"
        qs = qs.annotate(**{alias: KeyTransform(key, "metadata")}).filter(**{alias: value})
    return qs.order_by("-started_at", "-id"), filters, error


def _row(sandbox: Sandbox, now) -> dict:
    live = sandbox.state in LIVE
    return {
        "id": sandbox.id,
        "url": reverse("dashboard:sandbox", args=[sandbox.id]),
        "state": sandbox.state,
        "template": sandbox.template_id,
        "node": sandbox.node_id or "",
        "cpu_count": sandbox.cpu_count,
        "memory_mb": sandbox.memory_mb,
        "created_at": sandbox.created_at.isoformat(),
        "age_s": int((now - sandbox.created_at).total_seconds()),
        "end_at": sandbox.end_at.isoformat() if sandbox.end_at else None,
        "expires_in_s": int((sandbox.end_at - now).total_seconds()) if live and sandbox.end_at else None,
        "metadata": sandbox.metadata or {},
    }


@require_GET
@team_page
def sandbox_list(request):
    qs, filters, error = _filtered_sandboxes(request.team, request.GET)
    now = timezone.now()
    rows = [_row(s, now) for s in qs[:LIST_LIMIT]]
    templates = Template.objects.filter(Q(public=True) | Q(team=request.team)).order_by("id")
    return render(request, "dashboard/sandboxes.html", _base_context(
        request, "sandboxes", rows=rows, filters=filters, filter_error=error, templates=templates,
        states=SandboxState.values, limit=LIST_LIMIT, timeout_choices=TIMEOUT_CHOICES,
    ))


@require_GET
@team_page
def sandbox_list_json(request):
    qs, filters, error = _filtered_sandboxes(request.team, request.GET)
    now = timezone.now()
    rows = [_row(s, now) for s in qs[:LIST_LIMIT]]
    return JsonResponse({"sandboxes": rows, "count": len(rows), "limit": LIST_LIMIT, "filters": filters,
                         "error": error, "generated_at": now.isoformat()})


def _timeline(sandbox: Sandbox) -> list[dict]:
    events = list(sandbox.events.order_by("started_at", "id"))
    first = events[0].started_at if events else sandbox.created_at
    return [{"event": e, "offset_s": (e.started_at - first).total_seconds()} for e in events]




def allowed_actions(sandbox: Sandbox) -> dict[str, bool]:
    """Which lifecycle actions the sandbox's state allows, as the transition table says
    (the lifecycle code still decides)."""
    state = sandbox.state
    return {
        "pause": can_start("pause", state),
        "resume": can_start("resume", state),
        "snapshot": can_start("snapshot", state),
        "fork": can_start("fork", state),
        "timeout": state in (SandboxState.RUNNING, SandboxState.PAUSED),
        "kill": can_start("kill", state),
    }


def _actions_context(sandbox: Sandbox) -> dict:
    return {"actions": allowed_actions(sandbox), "timeout_choices": TIMEOUT_CHOICES,
            "fork_max": fork_op.fork_max_per_node(), "live": sandbox.state in LIVE}


@require_GET
@team_page
def sandbox_detail(request, sandbox_id):
    sandbox = get_object_or_404(Sandbox.objects.select_related("template", "node", "source_snapshot",
                                                                "forked_from"), pk=sandbox_id, team=request.team)
    now = timezone.now()
    live = sandbox.state in LIVE
    timeline = _timeline(sandbox)
    return render(request, "dashboard/sandbox_detail.html", _base_context(
        request, "sandboxes", sandbox=sandbox, timeline=timeline,
        last_event_id=max((item["event"].id for item in timeline), default=None),
        expires_in=(sandbox.end_at - now).total_seconds() if live else None,
        age=(now - sandbox.created_at).total_seconds(), **_actions_context(sandbox),
        terminal_path=f"/ws/sandboxes/{sandbox.id}/terminal", terminal_ready=sandbox.state in TERMINAL_STATES,
        terminal_unavailable=gone_reason(sandbox.state), forks=list(sandbox.forks.order_by("-created_at")[:50]),
        snapshots=list(sandbox.snapshots.order_by("-created_at")[:50]),
    ))


@require_GET
@team_page
def sandbox_detail_json(request, sandbox_id):
    """What the detail page polls: enough to notice that it must refresh."""
    sandbox = get_object_or_404(Sandbox, pk=sandbox_id, team=request.team)
    now = timezone.now()
    last = sandbox.events.order_by("-id").values_list("id", flat=True).first()
    row = _row(sandbox, now)
    row.update(error_reason=sandbox.error_reason, last_event_id=last, generated_at=now.isoformat())
    return JsonResponse(row)


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
    from .templatetags.dashboard_tags import human_seconds  # noqa: PLC0415

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
    fork_max = fork_op.fork_max_per_node()
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


# --------------------------------------------------------------------------- snapshots


def _lineage(team) -> list[dict]:
    """Template → its snapshots → sandboxes restored from each; forks hang under
    their parent sandbox. Only what the team can see, newest first."""
    snapshots = list(Snapshot.objects.filter(team=team).select_related("template", "source_sandbox", "node")
                     .order_by("-created_at", "-id")[:LIST_LIMIT])
    restored: dict[str, list] = {}
    for sb in (Sandbox.objects.filter(team=team, source_snapshot__in=[s.pk for s in snapshots])
               .order_by("-created_at")):
        restored.setdefault(sb.source_snapshot_id, []).append(sb)
    forks: dict[str, list] = {}
    for sb in Sandbox.objects.filter(team=team, forked_from__isnull=False).order_by("-created_at")[:LIST_LIMIT]:
        forks.setdefault(sb.forked_from_id, []).append(sb)
    by_template: dict[str, dict] = {}
    for snap in snapshots:
        entry = by_template.setdefault(snap.template_id, {"template": snap.template, "snapshots": []})
        entry["snapshots"].append({
            "snapshot": snap,
            "restored": [{"sandbox": sb, "forks": forks.get(sb.id, [])} for sb in restored.get(snap.pk, [])],
            "source_forks": forks.get(snap.source_sandbox_id, []) if snap.source_sandbox_id else [],
        })
    return list(by_template.values())


@require_GET
@team_page
def snapshot_list(request):
    rows = (Snapshot.objects.filter(team=request.team).select_related("template", "source_sandbox", "node")
            .annotate(restored=Count("sandboxes", filter=Q(sandboxes__state__in=LIVE)))
            .order_by("-created_at", "-id")[:LIST_LIMIT])
    fork_parents = (Sandbox.objects.filter(team=request.team, forks__isnull=False).distinct()
                    .prefetch_related("forks").order_by("-created_at")[:LIST_LIMIT])
    return render(request, "dashboard/snapshots.html", _base_context(
        request, "snapshots", snapshots=rows, lineage=_lineage(request.team),
        fork_parents=fork_parents, timeout_choices=TIMEOUT_CHOICES,
    ))


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


@require_GET
@team_page
def template_list(request):
    templates = (
        Template.objects.filter(Q(public=True) | Q(team=request.team))
        .annotate(live=Count("sandboxes", filter=Q(sandboxes__team=request.team, sandboxes__state__in=LIVE)),
                  total=Count("sandboxes", filter=Q(sandboxes__team=request.team)))
        .order_by("id")
    )
    return render(request, "dashboard/templates.html", _base_context(request, "templates", templates=templates))


@require_GET
@team_page
def node_list(request):
    return render(request, "dashboard/nodes.html", _base_context(request, "nodes", nodes=_node_rows()))


# --------------------------------------------------------------------------- API keys


@require_GET
@team_page
def api_key_list(request):
    keys = ApiKey.objects.filter(team=request.team).select_related("created_by").order_by("-created_at")
    return render(request, "dashboard/api_keys.html", _base_context(request, "api-keys", keys=keys))


@require_POST
@team_page
def api_key_create(request):
    name = (request.POST.get("name") or "").strip()[:128] or "dashboard"
    key, raw = ApiKey.generate(request.team, name=name, created_by=request.user)
    response = render(request, "dashboard/api_key_created.html",
                      _base_context(request, "api-keys", key=key, raw_key=raw))
    response["Cache-Control"] = "no-store"  # the only time the raw key is ever shown
    return response


@require_POST
@team_page
def api_key_revoke(request, key_id):
    key = get_object_or_404(ApiKey, pk=key_id, team=request.team)
    if ApiKey.objects.filter(pk=key.pk, revoked_at__isnull=True).update(revoked_at=timezone.now()):
        messages.success(request, f"Key {key.prefix}… revoked.")
    else:
        messages.info(request, f"Key {key.prefix}… was already revoked.")
    return redirect("dashboard:api-keys")
