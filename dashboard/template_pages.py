"""The dashboard's template pages: the templates a team can use, one template's builds and
tags, one build (facts, steps as sent, the layers it produced, its log).

Read-only. A team sees its own templates in full and the global or public ones (``base``)
by their facts only: builds, logs and tags are their owner's, so another team's template
or build is a 404 like every other page. The live log is ``dashboard.build_logs``."""
from __future__ import annotations

import json

from django.db.models import Count, OuterRef, Q, Subquery
from django.db.models.functions import Coalesce
from django.http import Http404
from django.shortcuts import render
from django.utils import timezone
from django.views.decorators.http import require_GET

from sandboxes.models import Template
from sandboxes.states import LIVE
from template_builds.models import BuildLogEntry, BuildStatus, TemplateBuild, TemplateTag

from dashboard.views import _base_context, team_page

BUILD_LIST_LIMIT = 200
# Entries rendered with the build page; the log socket sends the rest from there.
LOG_PAGE = 1000
FINISHED = (BuildStatus.READY, BuildStatus.ERROR)
KEY_SHOWN = 12  # hex digits of a layer key shown (the whole key is in the title)


# --------------------------------------------------------------------------- lookups
def visible_templates(team):
    """Live templates the team may start from: its own, the global ones, public ones."""
    return Template.objects.select_related("team").filter(
        Q(team=team) | Q(team__isnull=True) | Q(public=True), deleted_at__isnull=True)


def template_for_page(team, template_id: str) -> Template:
    """The team's own live template, or a global one (read-only); else 404."""
    template = (Template.objects.select_related("team")
                .filter(Q(team=team) | Q(team__isnull=True), pk=template_id, deleted_at__isnull=True).first())
    if template is None:
        raise Http404("no such template")
    return template


def own_build(team, template_id: str, build_id) -> TemplateBuild:
    """A build of one of the team's own live templates; else 404 (whoever owns it)."""
    build = (TemplateBuild.objects.select_related("template", "template__team", "node", "base_build", "snapshot")
             .filter(pk=build_id, template_id=template_id, template__team=team,
                     template__deleted_at__isnull=True).first())
    if build is None:
        raise Http404("no such build")
    return build


# --------------------------------------------------------------------------- formatting
def build_duration(build: TemplateBuild, now=None) -> float | None:
    """Seconds from hand-over to the end (or to now while it runs)."""
    if build.started_at is None:
        return None
    end = build.finished_at or (None if build.status in FINISHED else (now or timezone.now()))
    return (end - build.started_at).total_seconds() if end else None


def describe_step(number: int, step: dict) -> dict:
    """One stored step (``lifecycle.templates.start.normalised_steps``) for display:
    COPY/ADD as source → destination (with the owner and mode the SDK sends after them),
    RUN as its command (and user), ENV as ``KEY=value`` pairs, the rest as their args."""
    kind = str(step.get("type") or "?")
    args = [str(a) for a in step.get("args") or []]
    row = {"number": number, "type": kind, "args": args, "force": bool(step.get("force")),
           "files_hash": str(step.get("files_hash") or ""), "copy": None, "text": "", "user": ""}
    if kind in ("COPY", "ADD") and len(args) >= 2:
        row["copy"] = {"src": args[0], "dest": args[1], "user": args[2] if len(args) > 2 else "",
                       "mode": args[3] if len(args) > 3 else ""}
    elif kind == "RUN":
        row["text"] = args[0] if args else ""
        row["user"] = args[1] if len(args) > 1 else ""
    elif kind == "ENV":
        row["text"] = " ".join(f"{args[i]}={args[i + 1] if i + 1 < len(args) else ''}"
                               for i in range(0, len(args), 2))
    else:
        row["text"] = " ".join(args)
    return row


def step_prefix(step: str, message: str) -> str:
    """``[step]`` before a log line, unless the builder already wrote it there (E2B's
    builder starts its lines with it). Mirrors ``stepPrefix`` in build_detail.html."""
    prefix = f"[{step}]" if step else ""
    return "" if not prefix or message.startswith(prefix) else prefix


def short_key(key: str) -> str:
    """``sha256:<64 hex>`` or ``<64 hex>`` → the first few hex digits."""
    digest = key.split(":", 1)[1] if ":" in key else key
    return digest[:KEY_SHOWN]


def layer_rows(result) -> list[dict]:
    """``result["layers"]`` as the builder wrote it, defensively: items that are not
    objects are skipped, a size that is not a number is unknown."""
    layers = result.get("layers") if isinstance(result, dict) else None
    rows = []
    for item in layers if isinstance(layers, list) else []:
        if not isinstance(item, dict):
            continue
        key = str(item.get("key") or "")
        size = item.get("size_bytes")
        rows.append({
            "step": str(item.get("step") or ""),
            "type": str(item.get("type") or ""),
            "key": key,
            "short_key": short_key(key),
            "size_bytes": size if isinstance(size, (int, float)) and not isinstance(size, bool) else None,
            "cached": item.get("cached") is True,
        })
    return rows


def result_facts(result) -> list[dict]:
    """The result's other keys (user, workdir, image, …): plain values as text, nested
    ones as indented JSON."""
    if not isinstance(result, dict):
        return []
    facts = []
    for key in sorted(k for k in result if k != "layers"):
        value = result[key]
        nested = isinstance(value, (dict, list))
        facts.append({"key": str(key), "nested": nested,
                      "value": json.dumps(value, indent=2, sort_keys=True, default=str) if nested else value})
    return facts


def _current_tags(template) -> dict[str, dict]:
    """tag → its newest assignment's build and the build it resolves to (the newest
    assignment whose build is ready, what a create uses)."""
    tags: dict[str, dict] = {}
    for tag, build_id, status in (TemplateTag.objects.filter(template=template)
                                  .order_by("tag", "-created_at", "-id")
                                  .values_list("tag", "build_id", "build__status")):
        entry = tags.setdefault(tag, {"tag": tag, "newest": build_id, "newest_status": status, "resolves": None})
        if entry["resolves"] is None and status == BuildStatus.READY:
            entry["resolves"] = build_id
    return tags


# --------------------------------------------------------------------------- pages
@require_GET
@team_page
def template_list(request):
    team = request.team
    newest = TemplateBuild.objects.filter(template=OuterRef("pk")).order_by("-created_at")
    templates = list(
        visible_templates(team)
        .annotate(live=Count("sandboxes", filter=Q(sandboxes__team=team, sandboxes__state__in=LIVE), distinct=True),
                  total=Count("sandboxes", filter=Q(sandboxes__team=team), distinct=True),
                  newest_status=Subquery(newest.values("status")[:1]),
                  newest_build=Subquery(newest.values("pk")[:1]),
                  newest_at=Subquery(newest.annotate(at=Coalesce("finished_at", "started_at", "created_at"))
                                     .values("at")[:1]))
        .order_by("id")
    )
    own = [t.pk for t in templates if t.team_id == team.pk]
    tags: dict[str, list[str]] = {}
    for template_id, tag in (TemplateTag.objects.filter(template_id__in=own).values_list("template_id", "tag")
                             .distinct().order_by("template_id", "tag")):
        tags.setdefault(template_id, []).append(tag)
    rows = [{"template": t, "own": t.team_id == team.pk, "global": t.team_id is None,
             "linked": t.team_id in (team.pk, None), "tags": tags.get(t.pk, []),
             # another team's public template: its builds are theirs
             "newest_status": t.newest_status if t.team_id == team.pk else None,
             "newest_build": t.newest_build if t.team_id == team.pk else None,
             "newest_at": t.newest_at if t.team_id == team.pk else None} for t in templates]
    return render(request, "dashboard/templates.html", _base_context(request, "templates", rows=rows))


@require_GET
@team_page
def template_detail(request, template_id):
    template = template_for_page(request.team, template_id)
    own = template.team_id == request.team.pk
    now = timezone.now()
    builds, tags = [], []
    if own:
        current = _current_tags(template)
        tags_of: dict = {}
        for entry in current.values():
            tags_of.setdefault(entry["newest"], []).append(entry["tag"])
        for build in (TemplateBuild.objects.filter(template=template).select_related("node")
                      .order_by("-created_at", "-id")[:BUILD_LIST_LIMIT]):
            builds.append({"build": build, "duration": build_duration(build, now), "steps": len(build.steps or []),
                           "tags": tags_of.get(build.pk, [])})
        tags = sorted(current.values(), key=lambda e: e["tag"])
    return render(request, "dashboard/template_detail.html", _base_context(
        request, "templates", template=template, own=own, builds=builds, tags=tags,
        build_count=TemplateBuild.objects.filter(template=template).count() if own else 0,
        limit=BUILD_LIST_LIMIT,
    ))


@require_GET
@team_page
def build_detail(request, template_id, build_id):
    build = own_build(request.team, template_id, build_id)
    steps = [describe_step(i, s) for i, s in enumerate(build.steps or [], start=1) if isinstance(s, dict)]
    entries = list(BuildLogEntry.objects.filter(build=build).order_by("index")[:LOG_PAGE])
    for entry in entries:
        entry.prefix = step_prefix(entry.step, entry.message)
    next_index = entries[-1].index + 1 if entries else 0
    tags = sorted(tag for tag, entry in _current_tags(build.template).items() if entry["newest"] == build.pk)
    return render(request, "dashboard/build_detail.html", _base_context(
        request, "templates", template=build.template, build=build, steps=steps, tags=tags,
        duration=build_duration(build), finished=build.status in FINISHED,
        layers=layer_rows(build.result), result_facts=result_facts(build.result), entries=entries,
        next_index=next_index,
        ws_path=f"/ws/templates/{build.template_id}/builds/{build.pk}/logs",
    ))
