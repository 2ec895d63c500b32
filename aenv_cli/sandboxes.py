"""Sandbox lifecycle commands: ``ls``, ``info``, ``start`` / ``create``, ``pause``,
``resume``, ``timeout``, ``rm``, ``fork`` — each one or a few calls of the E2B REST API
(spec e2b-compat.md §2), printed by ``aenv_cli.output``'s conventions."""
from __future__ import annotations

import sys

import httpx

from . import errors, output
from .api import check, client, message_of, metadata_filter, pages, segment
from .config import Config
from .errors import CliError

CREATE_PATH = "/v2/sandboxes"
LIST_COLUMNS = ["SANDBOX ID", "TEMPLATE", "STATE", "CPU", "MEM (MiB)", "STARTED", "ENDS", "METADATA"]


# --------------------------------------------------------------------------- listing


def list_params(args) -> dict:
    """The ``GET /v2/sandboxes`` filters of ``-s``, ``-m`` and ``--template``."""
    params = {}
    chosen = [s for group in (args.state or []) for s in group]
    if chosen:
        params["state"] = ",".join(dict.fromkeys(chosen))
    if args.metadata:
        params["metadata"] = metadata_filter(dict(args.metadata))
    if args.template:
        params["template"] = args.template
    return params


def list_sandboxes(api: httpx.Client, args, *, page_size: int = 100, max_items: int | None = None) -> list[dict]:
    return list(pages(api, "/v2/sandboxes", list_params(args), page_size=page_size, max_items=max_items))


def list_row(r: dict) -> list:
    return [r.get("sandboxID"), r.get("alias") or r.get("templateID"), r.get("state"), r.get("cpuCount"),
            r.get("memoryMB"), output.local_time(r.get("startedAt")), output.local_time(r.get("endAt")),
            r.get("metadata")]


def cmd_ls(args, config: Config) -> int:
    with client(config) as api:
        rows = list_sandboxes(api, args, page_size=args.limit, max_items=args.max)
    if output.wants_json(args):
        output.print_json(rows)
    else:
        output.print_table(LIST_COLUMNS, [list_row(r) for r in rows])
    return 0


def cmd_info(args, config: Config) -> int:
    with client(config) as api:
        info = check(api.get(f"/sandboxes/{segment(args.sandbox_id)}")).json()
    if output.wants_json(args):
        output.print_json(info)
        return 0
    info = {k: v for k, v in info.items() if k not in ("envdAccessToken", "trafficAccessToken")}
    for time_key in ("startedAt", "endAt"):
        if time_key in info:
            info[time_key] = output.local_time(info[time_key])
    output.print_table(["FIELD", "VALUE"], [[k, output.cell(v)] for k, v in info.items()])
    return 0


# --------------------------------------------------------------------------- start


def create_body(args, template: str) -> dict:
    """``NewSandboxV2`` of the start flags (only what was asked; the server's defaults
    otherwise)."""
    body: dict = {"templateID": template, "timeout": args.timeout}
    if args.metadata:
        body["metadata"] = dict(args.metadata)
    if args.env:
        body["envVars"] = dict(args.env)
    if args.secure is not None:
        body["secure"] = args.secure
    if args.auto_pause is not None:
        body["autoPause"] = args.auto_pause
    if args.auto_resume:
        body["autoResume"] = {"enabled": True}
    if args.no_internet:
        body["allow_internet_access"] = False
    network = {**({"allowOut": args.allow_out} if args.allow_out else {}),
               **({"denyOut": args.deny_out} if args.deny_out else {})}
    if network:
        body["network"] = network
    if getattr(args, "volume", None):
        body["volumeMounts"] = args.volume
    return body


def check_resources(api: httpx.Client, sandbox_id: str, template: str, cpu: int | None, memory: int | None) -> None:
    """A template fixes its sandboxes' vCPUs and memory (a create restores its booted
    snapshot), so ``--cpu`` / ``--memory`` may only restate them. The API shows a sandbox's
    size, not a public template's, so the new sandbox is checked, and killed if it is not
    what was asked: refused, never silently different."""
    if cpu is None and memory is None:
        return
    info = check(api.get(f"/sandboxes/{segment(sandbox_id)}")).json()
    have_cpu, have_mem = info.get("cpuCount"), info.get("memoryMB")
    if (cpu is not None and cpu != have_cpu) or (memory is not None and memory != have_mem):
        api.delete(f"/sandboxes/{segment(sandbox_id)}")
        raise CliError(f"template {template} runs its sandboxes with {have_cpu} vCPU and {have_mem} MiB; a sandbox "
                       f"cannot change that (build a template with `aenv template build --cpu N --memory-mb MIB`)",
                       errors.USAGE)


def cmd_start(args, config: Config) -> int:
    template = args.template_opt or args.template_ref or "base"
    as_json = args.output == "json" or args.json
    with client(config, timeout=args.wait) as api:
        try:
            sandbox = check(api.post(CREATE_PATH, json=create_body(args, template))).json()
        except KeyboardInterrupt:
            raise CliError("interrupted while the sandbox was being created; if it was, `aenv ls` shows it",
                           errors.INTERRUPTED) from None
        sandbox_id = sandbox["sandboxID"]
        check_resources(api, sandbox_id, template, args.cpu, args.memory)
    if args.detach:
        if as_json:
            output.print_json(sandbox)
        else:
            print(sandbox_id, flush=True)
        return 0
    from .shell import ShellOptions, open_session  # noqa: PLC0415

    print(f"Started sandbox {sandbox_id}", file=sys.stderr, flush=True)
    try:
        return open_session(config, sandbox_id, sandbox.get("envdAccessToken"),
                            ShellOptions(shell=args.shell, user=args.user, cwd=args.cwd, timeout=args.timeout))
    finally:
        if args.rm:
            kill_after_session(config, sandbox_id)
        else:
            print(f"aenv: sandbox {sandbox_id} keeps running (`aenv connect {sandbox_id}` opens a shell again, "
                  f"`aenv rm {sandbox_id}` kills it)", file=sys.stderr, flush=True)


def kill_after_session(config: Config, sandbox_id: str) -> None:
    with client(config, timeout=120) as api:
        resp = api.delete(f"/sandboxes/{segment(sandbox_id)}")
    if resp.status_code in (204, 404):
        print(f"Killed sandbox {sandbox_id}", file=sys.stderr, flush=True)
    else:
        output.warn(f"could not kill {sandbox_id}: {resp.status_code}: {message_of(resp)}")


# --------------------------------------------------------------------------- actions on ids


def cmd_pause(args, config: Config) -> int:
    outcomes = output.Outcomes(args)
    body = {"memory": False} if args.no_memory else None
    with client(config, timeout=300) as api:
        for sid in args.sandbox_ids:
            resp = api.post(f"/sandboxes/{segment(sid)}/pause", json=body)
            if resp.status_code == 204:
                outcomes.ok(sid, f"Paused {sid}")
            else:
                outcomes.failed(sid, resp.status_code, message_of(resp))
    return outcomes.finish()


def cmd_resume(args, config: Config) -> int:
    outcomes = output.Outcomes(args)
    with client(config, timeout=300) as api:
        for sid in args.sandbox_ids:
            resp = api.post(f"/sandboxes/{segment(sid)}/connect", json={"timeout": args.timeout})
            if resp.status_code in (200, 201):
                outcomes.ok(sid, f"Resumed {sid}" if resp.status_code == 201 else f"{sid} is running",
                            resumed=resp.status_code == 201)
            else:
                outcomes.failed(sid, resp.status_code, message_of(resp))
    return outcomes.finish()


def cmd_timeout(args, config: Config) -> int:
    outcomes = output.Outcomes(args)
    with client(config) as api:
        resp = api.post(f"/sandboxes/{segment(args.sandbox_id)}/timeout", json={"timeout": args.seconds})
    if resp.status_code == 204:
        outcomes.ok(args.sandbox_id, f"Timeout for {args.sandbox_id} set to {args.seconds}s", timeout=args.seconds)
    else:
        outcomes.failed(args.sandbox_id, resp.status_code, message_of(resp))
    return outcomes.finish()


def _confirm(count: int) -> bool:
    if not sys.stdin.isatty():
        return True
    try:
        answer = input(f"Kill {count} sandbox{'es' if count != 1 else ''}? [y/N] ")
    except EOFError:
        return False
    return answer.strip().lower() in ("y", "yes")


def cmd_rm(args, config: Config) -> int:
    filtered = bool(args.state or args.metadata or args.template)
    if args.all and args.sandbox_ids:
        raise CliError("give sandbox ids or --all, not both", errors.USAGE)
    if not args.all and not args.sandbox_ids:
        raise CliError("give sandbox ids, or --all (with -s / -m / --template filters)", errors.USAGE)
    if filtered and not args.all:
        raise CliError("-s, -m and --template select sandboxes for --all", errors.USAGE)
    outcomes = output.Outcomes(args)
    with client(config, timeout=120) as api:
        ids = args.sandbox_ids
        if args.all:
            ids = [r["sandboxID"] for r in list_sandboxes(api, args)]
            if ids and not args.yes and not _confirm(len(ids)):
                raise CliError("nothing killed", errors.INTERRUPTED)
        for sid in ids:
            resp = api.delete(f"/sandboxes/{segment(sid)}")
            if resp.status_code == 204:
                outcomes.ok(sid, f"Killed {sid}")
            else:
                outcomes.failed(sid, resp.status_code, message_of(resp))
    return outcomes.finish()


def cmd_fork(args, config: Config) -> int:
    body = {"count": args.count, **({"timeout": args.timeout} if args.timeout is not None else {})}
    with client(config, timeout=600) as api:
        results = check(api.post(f"/sandboxes/{segment(args.sandbox_id)}/fork", json=body)).json()
    failed = [r["error"] for r in results if r.get("error")]
    if args.output == "json" or args.json:
        output.print_json(results)
    else:
        for r in results:
            if r.get("sandbox"):
                print(r["sandbox"]["sandboxID"], flush=True)
    for error in failed:
        output.warn(f"a child failed: {error.get('code')}: {error.get('message')}")
    return errors.FAILED if failed else 0
