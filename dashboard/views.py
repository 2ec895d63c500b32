"""Team dashboard pages, scoped to the signed-in user's current team (another team's
sandbox or key is a 404 on every page). Nothing here changes a sandbox: the actions that
do are in ``dashboard.actions``."""
from __future__ import annotations

import functools
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.db.models import Count, Q
from django.db.models.fields.json import KeyTransform
from django.http import Http404, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST

from nodes import join, summary
from nodes.models import Node
from sandboxes import key_cache
from sandboxes.models import ApiKey, Sandbox, SandboxEvent, Template
from sandboxes.states import LIVE, SandboxState, can_start
from lifecycle.snapshots import fork as fork_op
from snapshots.models import Snapshot

from dashboard.teams import current_team, set_current_team, user_teams
from dashboard.terminal import FINAL_CLOSE_CODES, TERMINAL_STATES, gone_reason

LIST_LIMIT = 200
TIMEOUT_CHOICES = [(300, "5 minutes"), (900, "15 minutes"), (3600, "1 hour"), (4 * 3600, "4 hours")]
JOIN_TOKEN_TTLS = [("1h", "1 hour"), ("24h", "24 hours"), ("7d", "7 days")]
JOIN_TOKEN_LIMIT = 100


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


def is_operator(user) -> bool:
    """Staff users are the platform's operators: they see every node's figures (the API's
    ``X-Admin-Token`` view); anyone else sees what a team's key sees (``api.nodes.views``)."""
    return bool(user.is_staff)


def _base_context(request, section: str, **extra) -> dict:
    return {"team": request.team, "teams": list(user_teams(request.user)), "section": section,
            "operator": is_operator(request.user), **extra}


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
    # Only local dashboard paths; a sandbox or volume page of the old team would 404, so go to the list.
    if not target.startswith("/dashboard/"):
        target = reverse("dashboard:overview")
    elif target.startswith("/dashboard/sandboxes/"):
        target = reverse("dashboard:sandboxes")
    elif target.startswith("/dashboard/volumes/"):
        target = reverse("dashboard:volumes")
    return redirect(target)


# --------------------------------------------------------------------------- overview
def _node_rows(request):
    """The nodes as ``GET /nodes`` shows them to the same person (``nodes.summary``, one
    computation for both): every figure to an operator, the team's own counts to others."""
    if is_operator(request.user):
        return summary.summarize(Node.objects.order_by("id"))
    return summary.for_team(request.team, Node.objects.order_by("id"))


def _host_chart(history: list, memory_total: int, width: int = 640, height: int = 120) -> dict | None:
    """A node's recent host samples ([unix time, CPU %, memory used bytes], one per heartbeat)
    as two SVG lines on a 0-100 % scale: CPU busy and memory used of ``memory_total``."""
    points = [p for p in history if isinstance(p, list) and len(p) >= 3]
    if len(points) < 2:
        return None
    pad = 24
    t0, t1 = points[0][0], points[-1][0]
    span = max(t1 - t0, 1)

    def xy(t, pct):
        pct = max(0.0, min(100.0, float(pct)))
        return f"{round(pad + (t - t0) * (width - 2 * pad) / span, 1)},{round(height - pad - pct * (height - 2 * pad) / 100, 1)}"

    memory = [100.0 * p[2] / memory_total if memory_total else 0.0 for p in points]
    return {"width": width, "height": height, "pad": pad, "baseline": height - pad, "top": pad, "right": width - pad,
            "cpu": " ".join(xy(p[0], p[1]) for p in points),
            "memory": " ".join(xy(p[0], m) for p, m in zip(points, memory)),
            "cpu_now": points[-1][1], "memory_now": round(memory[-1]), "minutes": round(span / 60),
            "start": datetime.fromtimestamp(t0, tz=dt_timezone.utc), "end": datetime.fromtimestamp(t1, tz=dt_timezone.utc)}


def _chunk_cache(host: dict) -> dict | None:
    """The node's chunk cache (lazy restores) from its last heartbeat, with the fill as a
    percentage of the bound; None when the node reported none (no chunkfs daemon runs)."""
    figures = host.get("chunkCache")
    if not isinstance(figures, dict) or not figures:
        return None
    limit = int(figures.get("limitBytes") or 0)
    size = int(figures.get("sizeBytes") or 0)
    return {"hit_percent": round(100.0 * float(figures.get("hitRatio") or 0.0), 1), "size_bytes": size,
            "limit_bytes": limit, "fill_percent": round(100.0 * size / limit) if limit else 0,
            "entries": int(figures.get("entries") or 0), "evictions": int(figures.get("evictions") or 0),
            "fetched_bytes": int(figures.get("fetchedBytes") or 0), "corrupt": int(figures.get("corrupt") or 0),
            "hits": int(figures.get("hits") or 0), "misses": int(figures.get("misses") or 0),
            "wire": _chunk_wire(figures)}


def _chunk_wire(figures: dict) -> dict:
    """Where the cache's chunks came from (peer nodes, the store) and what crossed the wire:
    the store's chunks as stored (compressed) against their plain bytes; a peer's are plain.
    With what this node served its peers (from its cache or its own snapshot files)."""
    def n(key: str) -> int:
        value = figures.get(key)
        return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0

    store_plain, store_wire = n("storeBytes"), n("storeWireBytes")
    return {"peer_chunks": n("peerChunks"), "peer_bytes": n("peerBytes"), "peer_errors": n("peerErrors"),
            "peer_corrupt": n("peerCorrupt"), "store_chunks": n("storeChunks"), "store_bytes": store_plain,
            "store_wire_bytes": store_wire,
            "store_wire_percent": round(100.0 * store_wire / store_plain) if store_plain else None,
            "wire_bytes": n("peerBytes") + store_wire, "plain_bytes": n("peerBytes") + store_plain,
            "served_chunks": n("servedChunks"), "served_bytes": n("servedBytes"),
            "served_file_chunks": n("servedFileChunks"), "served_refused": n("servedRefused")}


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
        request, "overview", nodes=_node_rows(request), state_counts=state_counts,
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
    templates = Template.objects.filter(Q(public=True) | Q(team=request.team), deleted_at__isnull=True).order_by("id")
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
            "fork_max": fork_op.fork_max_count(), "live": sandbox.state in LIVE}


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
        terminal_unavailable=gone_reason(sandbox.state),
        terminal_final_codes=" ".join(str(code) for code in sorted(FINAL_CLOSE_CODES)),
        forks=list(sandbox.forks.order_by("-created_at")[:50]),
        snapshots=list(sandbox.snapshots.filter(fork_capture=False).order_by("-created_at")[:50]),
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


# --------------------------------------------------------------------------- snapshots
def _lineage(team) -> list[dict]:
    """Template → its snapshots → sandboxes restored from each; forks hang under
    their parent sandbox. Only what the team can see, newest first."""
    snapshots = list(Snapshot.objects.filter(team=team, build_result=False, fork_capture=False)
                     .select_related("template", "source_sandbox", "node")
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
    rows = (Snapshot.objects.filter(team=request.team, build_result=False, fork_capture=False)
            .select_related("template", "source_sandbox", "node")
            .annotate(restored=Count("sandboxes", filter=Q(sandboxes__state__in=LIVE)))
            .order_by("-created_at", "-id")[:LIST_LIMIT])
    fork_parents = (Sandbox.objects.filter(team=request.team, forks__isnull=False).distinct()
                    .prefetch_related("forks").order_by("-created_at")[:LIST_LIMIT])
    return render(request, "dashboard/snapshots.html", _base_context(
        request, "snapshots", snapshots=rows, lineage=_lineage(request.team),
        fork_parents=fork_parents, timeout_choices=TIMEOUT_CHOICES,
    ))


@require_GET
@team_page
def node_list(request):
    nodes = _node_rows(request)
    for row in nodes:  # the host's history and chunk cache: an operator's figures
        row.chart = (_host_chart(row.node.host_history or [], int(row.host.get("memoryTotalBytes") or 0))
                     if is_operator(request.user) else None)
        row.chunk_cache = _chunk_cache(row.host) if is_operator(request.user) else None
    extra = {}
    if is_operator(request.user):  # the operators' section: join tokens (its actions: dashboard.node_tokens)
        extra = {"join_tokens": join.listed_tokens(JOIN_TOKEN_LIMIT), "ttl_choices": JOIN_TOKEN_TTLS}
    return render(request, "dashboard/nodes.html", _base_context(request, "nodes", nodes=nodes, **extra))


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
        key_cache.forget(key.key_hash)  # refused at once by this process's API
        messages.success(request, f"Key {key.prefix}… revoked.")
    else:
        messages.info(request, f"Key {key.prefix}… was already revoked.")
    return redirect("dashboard:api-keys")
