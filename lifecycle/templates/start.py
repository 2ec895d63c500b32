"""``POST /v2/templates/{id}/builds/{buildID}``: start a registered build.

The start body is normalised and stored with the build; what can be judged without a
node is judged here and ends the build at once, as E2B's builder would, with the step
it concerns (an unknown step type, a COPY whose archive was never uploaded, a
``fromTemplate`` that names nothing ready: step ``base``) — the answer is still 202 and
the SDK reads the reason from the status. Otherwise placement picks a node
(``nodes.placement.place``, the build VM's shape), the build becomes ``building`` on it
(durable, with a log line) and the task goes to the node's queue
(``nodes.client.build_template``). No node with room: 503 and the build stays ``waiting``
(start it again later); the node's queue unreachable: the same, after putting the build
back to ``waiting``."""
from __future__ import annotations

import logging

from django.utils import timezone

from lifecycle.sandboxes import core
from sandboxes.errors import Invalid, LifecycleError, NoRoom, NotFound, Unavailable
from sandboxes.models import Team

from lifecycle import resolve
from template_builds.models import BuildStatus as B, TemplateBuild, TemplateFile
from template_builds.transitions import Log, transition, transition_sync
from lifecycle.templates.common import FORBID, build_uuid, team_template

log = logging.getLogger(__name__)

# What the SDKs send (COPY, RUN, ENV, WORKDIR, USER) and the aliases E2B's builder takes.
STEP_TYPES = {"COPY", "ADD", "RUN", "ENV", "ARG", "WORKDIR", "USER"}


def normalised_steps(steps: list[dict]) -> list[dict]:
    """The body's steps as stored and sent to the node: ``type`` upper-cased, ``args``,
    ``force``, and for COPY ``files_hash`` / ``force_upload``."""
    out = []
    for step in steps:
        item = {"type": step["type"].strip().upper(), "args": list(step.get("args") or []),
                "force": bool(step.get("force"))}
        if step.get("filesHash") is not None:
            item["files_hash"] = step["filesHash"]
        if step.get("forceUpload"):
            item["force_upload"] = True
        out.append(item)
    return out


def step_problem(step: dict) -> str | None:
    """Why the builder could not run ``step`` (normalised), or None."""
    kind, args = step["type"], step["args"]
    if kind not in STEP_TYPES:
        return f"command type {kind} is not implemented"
    if kind in ("COPY", "ADD"):
        if len(args) < 2 or not args[0] or not args[1]:
            return f"{kind} needs a source and a destination"
        if not step.get("files_hash"):
            return f"{kind} {args[0]} has no filesHash (the files were never uploaded)"
    if kind == "RUN" and (not args or not args[0].strip()):
        return "RUN needs a command"
    if kind == "ENV" and (len(args) < 2 or len(args) % 2):
        return "ENV needs key and value pairs"
    if kind in ("ARG", "WORKDIR", "USER") and (not args or not args[0].strip()):
        return f"{kind} needs an argument"
    return None


def node_spec(team: Team, build: TemplateBuild, body: dict, steps: list[dict], base: resolve.Source | None,
              files: dict) -> dict:
    """What the node's builder gets (``nodes.client.build_template``'s ``spec``)."""
    return {
        "team_id": str(team.pk),
        "from_image": body.get("from_image") or None,
        "from_image_registry": body.get("from_image_registry") or None,
        "from_template": None if base is None else {
            "ref": body["from_template"], "template_id": base.template.pk,
            "build_id": str(base.build.pk) if base.build is not None else None,
            "snapshot_id": base.snapshot.pk if base.snapshot is not None else None,
            "image": base.image or None,
        },
        "force": bool(body.get("force")),
        "steps": steps,
        "start_cmd": body.get("start_cmd") or None,
        "ready_cmd": body.get("ready_cmd") or None,
        "min_free_disk_mb": build.min_free_disk_mb,
        "envd_version": build.envd_version,
        "files": files,  # files hash → {"gzip": bool}, for every COPY step
    }


async def _fail_now(build: TemplateBuild, fields: dict, message: str, step: str) -> TemplateBuild:
    await transition(build.pk, "fail", reason_message=message, reason_step=step, finished_at=timezone.now(),
                     logs=[Log("error", f"Build failed: {message}", step)], **fields)
    return await TemplateBuild.objects.select_related("template").aget(pk=build.pk)


async def start_build(team: Team, template_ref: str, build_id: str, body: dict, actor: str = "") -> TemplateBuild:
    """Starts build ``build_id`` of the team's template ``template_ref`` with the start body
    ``body`` (``serializers.BuildStartSerializer``'s snake_case form). Returns the build:
    ``building``, or ``error`` when the body names something impossible."""
    bid = build_uuid(build_id)
    template = await team_template(team, template_ref, others=FORBID)
    build = await TemplateBuild.objects.select_related("template").filter(pk=bid, template=template).afirst()
    if build is None:
        raise NotFound(f"Build '{bid}' not found")
    return await start_waiting_build(team, build, body, actor)


async def start_waiting_build(team: Team, build: TemplateBuild, body: dict, actor: str = "") -> TemplateBuild:
    """``start_build`` once the build is found: ``team`` is whose COPY archives and base
    template the build uses (the template's owner, or aenv's system team for a global
    template: ``template_builds.system``)."""
    bid = build.pk
    if build.status != B.WAITING:
        raise Invalid(f"build '{bid}' cannot be started: it is {build.status}, not waiting")

    steps = normalised_steps(body.get("steps") or [])
    registry = body.get("from_image_registry") or None
    fields = dict(from_image=body.get("from_image") or "", from_template=body.get("from_template") or "",
                  from_image_registry_type=(registry or {}).get("type", ""), steps=steps,
                  start_cmd=body.get("start_cmd") or "", ready_cmd=body.get("ready_cmd") or "",
                  force=bool(body.get("force")))
    for index, step in enumerate(steps, start=1):
        problem = step_problem(step)
        if problem:
            return await _fail_now(build, fields, problem, str(index))

    base = None
    if body.get("from_template"):
        try:
            base = await resolve.resolve_source(team, body["from_template"])
        except LifecycleError as exc:
            return await _fail_now(build, fields, f"error getting base template: {exc.message}", "base")
        fields["base_build"] = base.build

    hashes = {s["files_hash"] for s in steps if s.get("files_hash")}
    uploaded = {row["hash"]: {"gzip": row["gzip"]} async for row in
                TemplateFile.objects.filter(team=team, hash__in=hashes).values("hash", "gzip")}
    for index, step in enumerate(steps, start=1):
        if step.get("files_hash") and step["files_hash"] not in uploaded:
            return await _fail_now(build, fields, f"the files of {step['type']} {step['args'][0]} were not uploaded "
                                   f"(hash {step['files_hash']})", str(index))

    client, placement = core.node_api()

    def claim(node) -> None:  # building on the node is the build VM's reservation, made under its lock
        if not transition_sync(build.pk, "start", node=node, started_at=timezone.now(),
                               logs=[Log("info", f"Build started on node {node.pk}", "base")], **fields):
            raise Invalid(f"build '{bid}' cannot be started: it was started or ended meanwhile")

    async def place_and_dispatch() -> None:
        try:
            node = await placement.place(build.cpu_count, build.memory_mb, claim=claim)
        except placement.NoNodeAvailable as exc:
            raise NoRoom(f"no node can build the template now ({exc}); start the build again later") from exc
        await _dispatch(client, node, build, node_spec(team, build, body, steps, base, uploaded), actor)

    # Shielded from the claim on: a client gone mid-way never leaves a build "building" on a
    # node (its room reserved) that was never handed it.
    await core.shielded(place_and_dispatch())
    return await TemplateBuild.objects.select_related("template").aget(pk=build.pk)


async def _dispatch(client, node, build: TemplateBuild, spec: dict, actor: str) -> None:
    try:
        await client.build_template(node, build_id=str(build.pk), template_id=build.template_id, spec=spec,
                                    cpu_count=build.cpu_count, memory_mb=build.memory_mb,
                                    disk_size_mb=build.disk_size_mb)
    except Exception as exc:  # the node never got it: the build may be started again
        reason = f"could not hand the build to node {node.pk}: {exc}"
        await transition(build.pk, "requeue", node=None, started_at=None,
                         logs=[Log("warn", f"{reason}; start the build again", "base")])
        if not isinstance(exc, client.NodeError):
            log.exception("template build %s: unexpected dispatch error", build.pk)
        raise Unavailable(reason) from exc
    log.info("template build %s of %s handed to node %s by %s", build.pk, build.template_id, node.pk, actor)
