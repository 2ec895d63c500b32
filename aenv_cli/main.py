"""`aenv` command: manage sandboxes from a shell over the same HTTP APIs the E2B SDK
uses (no SDK dependency). Reads E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY (or the
AENV_* spellings) so one set of exports serves the SDK and the CLI."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import httpx

from envd_client import EnvdClient, EnvdError, EnvdUnavailable


class CliError(Exception):
    pass


def _config() -> tuple[str, str, str]:
    api = os.environ.get("AENV_API_URL") or os.environ.get("E2B_API_URL") or "http://127.0.0.1:3000"
    sandbox = os.environ.get("AENV_SANDBOX_URL") or os.environ.get("E2B_SANDBOX_URL") or "http://127.0.0.1:3001"
    key = os.environ.get("AENV_API_KEY") or os.environ.get("E2B_API_KEY") or ""
    if not key:
        raise CliError("set E2B_API_KEY (or AENV_API_KEY); scripts/up.sh prints one")
    return api.rstrip("/"), sandbox.rstrip("/"), key


def _check(resp: httpx.Response) -> httpx.Response:
    if resp.status_code >= 400:
        try:
            message = resp.json().get("message", resp.text)
        except ValueError:
            message = resp.text
        raise CliError(f"{resp.status_code}: {message}")
    return resp


def cmd_list(args, api, _sandbox, key):
    params = {"state": ",".join(args.state)} if args.state else {}
    rows = _check(httpx.get(f"{api}/v2/sandboxes", params=params, headers={"X-API-Key": key})).json()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'SANDBOX ID':22} {'TEMPLATE':12} {'STATE':8} {'CPU':>3} {'MEM MB':>6}  {'STARTED':25} ENDS")
    for r in rows:
        print(f"{r['sandboxID']:22} {r['templateID']:12} {r['state']:8} {r['cpuCount']:>3} {r['memoryMB']:>6}  "
              f"{r['startedAt']:25} {r['endAt']}")
    return 0


def cmd_create(args, api, _sandbox, key):
    body = {"templateID": args.template, "timeout": args.timeout, "metadata": dict(args.metadata or [])}
    resp = _check(httpx.post(f"{api}/v2/sandboxes", json=body, headers={"X-API-Key": key}, timeout=args.wait))
    print(resp.json()["sandboxID"] if not args.json else json.dumps(resp.json(), indent=2))
    return 0


def cmd_kill(args, api, _sandbox, key):
    status = 0
    for sid in args.ids:
        resp = httpx.delete(f"{api}/sandboxes/{sid}", headers={"X-API-Key": key}, timeout=120)
        if resp.status_code == 204:
            print(f"killed {sid}")
        else:
            status = 1
            print(f"{sid}: {resp.status_code} {resp.json().get('message', '')}", file=sys.stderr)
    return status


def cmd_exec(args, api, sandbox, key):
    info = _check(httpx.get(f"{api}/sandboxes/{args.id}", headers={"X-API-Key": key})).json()
    exit_code = 1
    # No idle limit on the stream (as ever): the data plane may first resume a paused sandbox.
    with EnvdClient.through_proxy(sandbox, args.id, info.get("envdAccessToken"), stream_idle_timeout=None) as envd:
        events = envd.start("/bin/bash", ["-l", "-c", " ".join(args.command)], cwd=args.cwd, user=args.user,
                            stdin=False)
        with contextlib.closing(events):
            for event in events:
                if event.kind == "data" and event.stream in ("stdout", "stderr"):
                    out = sys.stdout if event.stream == "stdout" else sys.stderr
                    out.buffer.write(event.data)
                    out.flush()
                elif event.kind == "end":
                    exit_code = event.exit_code
    return exit_code if exit_code >= 0 else 128


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aenv", description="Manage aenv sandboxes.")
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("list", help="list sandboxes")
    p.add_argument("--state", action="append", choices=["running", "paused"])
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_list)
    p = sub.add_parser("create", help="create a sandbox and print its id")
    p.add_argument("--template", default="base")
    p.add_argument("--timeout", type=int, default=300, help="seconds until the sandbox expires")
    p.add_argument("--metadata", action="append", type=lambda s: tuple(s.split("=", 1)), metavar="KEY=VALUE")
    p.add_argument("--wait", type=float, default=300, help="seconds to wait for the API")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_create)
    p = sub.add_parser("kill", help="kill sandboxes")
    p.add_argument("ids", nargs="+")
    p.set_defaults(func=cmd_kill)
    p = sub.add_parser("exec", help="run a command in a sandbox, streaming its output")
    p.add_argument("id")
    p.add_argument("--user", help="root or user (default: the sandbox's default user)")
    p.add_argument("--cwd")
    p.add_argument("command", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_exec)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.action == "exec" and args.command[:1] == ["--"]:
        args.command = args.command[1:]
    try:
        return args.func(args, *_config())
    except CliError as exc:
        print(f"aenv: {exc}", file=sys.stderr)
        return 1
    except EnvdUnavailable as exc:
        print(f"aenv: cannot reach the sandbox: {exc.message}", file=sys.stderr)
        return 1
    except EnvdError as exc:  # an HTTP answer says its status, as the API's errors do
        print(f"aenv: {exc.status or exc.code}: {exc.message}", file=sys.stderr)
        return 1
    except httpx.HTTPError as exc:
        print(f"aenv: cannot reach the server: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
