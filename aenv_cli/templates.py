"""``aenv template build | ls | rm | logs``: templates from a Dockerfile and their builds,
over E2B's template build API (spec e2b-templates.md §1–§3, §5) with httpx — the same
requests ``Template.build`` sends, in the same order, so what works here works with the
SDK and the other way round.

``build`` parses the Dockerfile (``aenv_cli.dockerfile``) and finds every COPY source in
the context (``aenv_cli.build_context``) *before* it registers anything, so a typo costs
no build; then: ``POST /v3/templates`` → per COPY ``GET …/files/{hash}`` and, when the
server lacks the archive, ``PUT`` it to the signed URL → ``POST /v2/…/builds/{id}`` →
poll the status, printing the log as it grows."""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Callable, TextIO

import httpx

from . import errors, output
from .api import check, client, error_message, message_of, segment
from .build_context import BuildContext, ContextError, Entry, files_hash, write_archive
from .config import Config
from .dockerfile import DEFAULT_READY_CMD, Recipe, parse
from .dockerfile_syntax import DockerfileError
from .errors import CliError

DOCKERFILE_NAMES = ("e2b.Dockerfile", "Dockerfile")
POLL_INTERVAL = 0.3  # seconds between status polls while a build runs (the SDK: 0.2)
PAGE = 100  # log entries per status call (the server's maximum)
UPLOAD_TIMEOUT = 3600.0  # seconds, as the SDK
LEVELS = ("debug", "info", "warn", "error")
TERMINAL = ("ready", "error")
COLOURS = {"debug": "\033[2m", "warn": "\033[33m", "error": "\033[31m"}

_sleep = time.sleep  # the poll's pause (a test interrupts it)


# --------------------------------------------------------------------------- printing


class LogPrinter:
    """Prints build log entries as ``HH:MM:SS LEVEL message`` (local time), coloured by
    level on a terminal unless ``NO_COLOR`` is set."""

    def __init__(self, stream: TextIO):
        self.stream = stream
        self.colour = stream.isatty() and not os.environ.get("NO_COLOR")

    def entry(self, entry: dict) -> None:
        self.line(entry.get("level", "info"), entry.get("message", ""), _clock(entry.get("timestamp")))

    def note(self, message: str) -> None:
        """A line of aenv's own (uploads, the ids), among the server's."""
        self.line("info", message, datetime.now().strftime("%H:%M:%S"))

    def line(self, level: str, message: str, clock: str) -> None:
        text = f"{clock} {level.upper():<5} {message}"
        if self.colour and level in COLOURS:
            text = f"{COLOURS[level]}{text}\033[0m"
        print(text, file=self.stream, flush=True)


def _clock(timestamp: str | None) -> str:
    try:
        return datetime.fromisoformat(str(timestamp).replace("Z", "+00:00")).astimezone().strftime("%H:%M:%S")
    except ValueError:
        return str(timestamp)


# --------------------------------------------------------------------------- polling


def follow_build(api: httpx.Client, template_id: str, build_id: str, on_entry: Callable[[dict], None], *,
                 until_done: bool = True, level: str | None = None) -> dict:
    """Reads the build's log from the start, passing each entry to ``on_entry``; returns
    the last ``TemplateBuildInfo``. ``until_done``: polls (every ``POLL_INTERVAL``) until
    the build is ready or failed and its log is read to the end, as the SDK does;
    otherwise stops at the end of the log as it is now."""
    offset = 0
    url = f"/templates/{segment(template_id)}/builds/{build_id}/status"
    while True:
        params = {"logsOffset": offset, "limit": PAGE, **({"level": level} if level else {})}
        info = check(api.get(url, params=params)).json()
        entries = info.get("logEntries") or []
        for entry in entries:
            on_entry(entry)
        offset += len(entries)
        if entries and len(entries) == PAGE:
            continue  # more is waiting: ask again at once
        if info["status"] in TERMINAL or not until_done:
            if not entries:
                return info
            continue
        _sleep(POLL_INTERVAL)


def _interrupted(template_id: str, build_id: str) -> CliError:
    return CliError(f"stopped following; build {build_id} keeps running on the server "
                    f"(aenv template logs {template_id} {build_id} -f)", exit_code=130)


def _outcome(info: dict) -> str:
    reason = info.get("reason") or {}
    step = f" (step {reason['step']})" if reason.get("step") else ""
    return f"{reason.get('message') or 'Build failed'}{step}"


# --------------------------------------------------------------------------- build


@dataclass
class Copy:
    """A COPY step with the files it sends and their key."""

    index: int  # in the steps
    src: str
    line: int
    entries: list[Entry]
    files_hash: str


def find_dockerfile(path: str) -> Path:
    """``path`` itself, or the ``e2b.Dockerfile`` (else ``Dockerfile``) in that directory."""
    p = Path(path)
    if p.is_dir():
        for name in DOCKERFILE_NAMES:
            if (p / name).is_file():
                return p / name
        raise CliError(f"no {' or '.join(DOCKERFILE_NAMES)} in {p}")
    if not p.is_file():
        raise CliError(f"{p}: no such file or directory")
    return p


def plan(dockerfile: Path, context_dir: Path) -> tuple[Recipe, list[Copy]]:
    """The parsed Dockerfile and its COPY steps' files; CliError naming the line."""
    try:
        recipe = parse(dockerfile.read_text(encoding="utf-8"))
    except (DockerfileError, UnicodeDecodeError) as exc:
        raise CliError(f"{dockerfile}: {exc}") from None
    try:
        context = BuildContext(context_dir)
        copies = []
        for index, step in enumerate(recipe.steps):
            if step.type != "COPY":
                continue
            src, dest = step.args[0], step.args[1]
            try:
                entries = context.entries(src)
            except ContextError as exc:
                raise CliError(f"{dockerfile}: line {step.line}: {exc}") from None
            copies.append(Copy(index, src, step.line, entries, files_hash(src, dest, entries)))
    except OSError as exc:
        raise CliError(f"cannot read the build context: {exc}") from None
    return recipe, copies


def start_body(recipe: Recipe, copies: list[Copy], args) -> dict:
    """``TemplateBuildStartV2`` (spec §3)."""
    hashes = {c.index: c.files_hash for c in copies}
    steps = []
    for index, step in enumerate(recipe.steps):
        item = {"type": step.type, "args": step.args, "force": False}
        if index in hashes:
            item["filesHash"] = hashes[index]
        steps.append(item)
    body = {"fromImage": recipe.from_image, "force": bool(args.no_cache), "steps": steps}
    start_cmd = args.start_cmd or recipe.start_cmd
    ready_cmd = args.ready_cmd or (DEFAULT_READY_CMD if start_cmd else None)
    if start_cmd:
        body["startCmd"] = start_cmd
    if ready_cmd:
        body["readyCmd"] = ready_cmd
    return body


def upload(api: httpx.Client, template_id: str, copy: Copy, log: LogPrinter) -> None:
    """Sends the archive of ``copy`` unless the server has it (the SDK's flow: ask, then
    PUT to the signed URL with an exact length and no API key)."""
    link = api.get(f"/templates/{segment(template_id)}/files/{copy.files_hash}")
    if link.status_code != 201:
        raise CliError(f"files of COPY {copy.src}: {error_message(link)}")
    link = link.json()
    if link.get("present"):
        log.note(f"Skipping upload of '{copy.src}', already cached")
        return
    if not link.get("url"):
        raise CliError(f"files of COPY {copy.src}: the server gave no upload URL")
    with tempfile.TemporaryFile() as archive:
        write_archive(copy.entries, archive)
        size = archive.tell()
        archive.seek(0)
        resp = httpx.put(link["url"], content=archive, headers={"Content-Length": str(size)},
                         timeout=UPLOAD_TIMEOUT, follow_redirects=False)
    if not resp.is_success:
        raise CliError(f"upload of COPY {copy.src} failed: {error_message(resp)}")
    log.note(f"Uploaded '{copy.src}' ({size} bytes)")


def register_request(args) -> dict:
    """``POST /v3/templates``'s body: the name, tags and the sandboxes' size."""
    return {"name": args.name, **({"tags": args.tag} if args.tag else {}),
            **({"cpuCount": args.cpu} if args.cpu is not None else {}),
            **({"memoryMB": args.memory_mb} if args.memory_mb is not None else {})}


def run_build(config: Config, args, request: dict, body_of: Callable[[], dict], copies: list[Copy] = ()) -> int:
    """Registers the template, sends the COPY archives the server lacks, starts the build
    with ``body_of()`` and (unless ``args.detach``) prints its log until it ends."""
    log = LogPrinter(sys.stderr if args.json else sys.stdout)
    with client(config) as api:
        registered = check(api.post("/v3/templates", json=request))
        if registered.status_code != 202:
            raise CliError(f"{registered.status_code}: unexpected answer to the build request")
        registered = registered.json()
        template_id, build_id = registered["templateID"], registered["buildID"]
        log.note(f"Template created with ID: {template_id}, Build ID: {build_id}")
        for copy in copies:
            upload(api, template_id, copy, log)
        check(api.post(f"/v2/templates/{segment(template_id)}/builds/{build_id}", json=body_of()))
        if getattr(args, "detach", False):
            result = {"templateID": template_id, "buildID": build_id, "names": registered.get("names", []),
                      "status": "building"}
            if args.json:
                print(json.dumps(result, indent=2))
            else:
                print(f"Build started: template {template_id}, build {build_id} "
                      f"(`aenv template logs {args.name} -f` follows it)")
            return 0
        try:
            info = follow_build(api, template_id, build_id, log.entry)
        except KeyboardInterrupt:
            raise _interrupted(template_id, build_id) from None
    result = {"templateID": template_id, "buildID": build_id, "names": registered.get("names", []),
              "tags": registered.get("tags", []), "status": info["status"],
              **({"reason": info["reason"]} if info.get("reason") else {})}
    if args.json:
        print(json.dumps(result, indent=2))
    elif info["status"] == "ready":
        print(f"Built {args.name}: template {template_id}, build {build_id}, names {', '.join(result['names'])}, "
              f"tags {', '.join(sorted(result['tags']))}")
    if info["status"] != "ready":
        print(f"aenv: build {build_id} failed: {_outcome(info)}", file=sys.stderr)
        return 1
    return 0


def cmd_build(args, config: Config) -> int:
    dockerfile = find_dockerfile(args.path)
    recipe, copies = plan(dockerfile, Path(args.context) if args.context else dockerfile.parent)
    for warning in recipe.warnings:
        print(f"aenv: warning: {dockerfile}: {warning}", file=sys.stderr)
    return run_build(config, args, register_request(args), lambda: start_body(recipe, copies, args), copies)


def image_name(image: str) -> str:
    """A template name from an image reference, as AgentENV's ``pull`` makes it: the last
    path segment without its digest or tag (``docker.io/library/ubuntu:24.04`` → ``ubuntu``)."""
    last = image.rstrip("/").rsplit("/", 1)[-1]
    return last.split("@", 1)[0].split(":", 1)[0]


def pull_body(args) -> dict:
    """``TemplateBuildStartV2`` of an image as it is: no steps, its start and ready commands."""
    body = {"fromImage": args.image, "force": bool(args.no_cache), "steps": []}
    ready_cmd = args.ready_cmd or (f": >/dev/tcp/127.0.0.1/{args.probe}" if args.probe else None)
    if args.start_cmd:
        body["startCmd"] = args.start_cmd
    if ready_cmd or args.start_cmd:
        body["readyCmd"] = ready_cmd or DEFAULT_READY_CMD
    return body


def cmd_pull(args, config: Config) -> int:
    args.name = args.name or image_name(args.image)
    if not args.name:
        raise CliError(f"no template name in {args.image!r}: give --name", errors.USAGE)
    return run_build(config, args, register_request(args), lambda: pull_body(args))


# --------------------------------------------------------------------------- ls, rm, logs


def cmd_ls(args, config: Config) -> int:
    with client(config) as api:
        rows = check(api.get("/templates")).json()
    if output.wants_json(args):
        output.print_json(rows)
        return 0
    output.print_table(["TEMPLATE ID", "NAMES", "STATUS", "CPU", "MEM (MiB)", "UPDATED"],
                       [[r["templateID"], r.get("names") or r.get("aliases"), r["buildStatus"], r["cpuCount"],
                         r["memoryMB"], output.local_time(r["updatedAt"])] for r in rows])
    return 0


def delete_each(config: Config, refs, outcomes, done_line) -> int:
    """``DELETE /templates/{ref}`` for each ref (templates and snapshots share the route):
    ``done_line(ref)`` for each deleted, the API's message for each refused."""
    with client(config, timeout=120) as api:
        for ref in refs:
            resp = api.delete(f"/templates/{segment(ref)}")
            if resp.status_code == 204:
                outcomes.ok(ref, done_line(ref))
            else:
                outcomes.failed(ref, resp.status_code, message_of(resp))
    return outcomes.finish()


def cmd_rm(args, config: Config) -> int:
    return delete_each(config, args.templates, output.Outcomes(args, key="template"), lambda ref: f"deleted {ref}")


def cmd_logs(args, config: Config) -> int:
    log = LogPrinter(sys.stdout)
    with client(config) as api:
        template = check(api.get(f"/templates/{segment(args.template)}")).json()
        template_id, build_id = template["templateID"], args.build_id
        if not build_id:
            if not template.get("builds"):
                raise CliError(f"template {args.template} has no builds")
            build_id = template["builds"][0]["buildID"]  # newest first
        try:
            info = follow_build(api, template_id, build_id, log.entry, until_done=args.follow, level=args.level)
        except KeyboardInterrupt:
            raise _interrupted(template_id, build_id) from None
    state = info["status"] if info["status"] != "error" else f"error: {_outcome(info)}"
    print(f"aenv: build {build_id}: {state}", file=sys.stderr, flush=True)
    return 1 if args.follow and info["status"] == "error" else 0
