"""``aenv auth``: store the API URL, the data plane URL and the API key in the
credentials file (``aenv_cli.config``) after checking the key against the API;
``auth status`` shows the settings in force and where each comes from; ``auth logout``
removes the file. Every value may be given as a flag (or the key on stdin) for scripts;
missing ones are asked for on the terminal, the key without echo."""
from __future__ import annotations

import getpass
import sys
import time

import httpx

from . import errors, output
from .api import check, client
from .config import Config, credentials_path, default_sandbox_url, remove_credentials, resolve, write_credentials
from .errors import CliError


def _ask(prompt: str, default: str) -> str:
    if not sys.stdin.isatty():
        return default
    try:
        answer = input(f"{prompt} [{default}]: ").strip()
    except EOFError:
        return default
    return answer or default


def _key(args) -> str:
    if args.auth_api_key:
        return args.auth_api_key.strip()
    if args.api_key_stdin:
        return sys.stdin.readline().strip()
    try:
        return getpass.getpass("API key: ").strip()  # reads the terminal, without echo
    except (EOFError, OSError):
        raise CliError("no terminal to ask for the API key: give --api-key-stdin or --api-key", errors.USAGE) from None


def verify(config: Config) -> float:
    """Seconds one authenticated list call took; ApiError / transport error otherwise."""
    started = time.monotonic()
    with client(config, timeout=10) as api:
        check(api.get("/v2/sandboxes", params={"limit": 1}))
    return time.monotonic() - started


def cmd_login(args, config: Config) -> int:
    url = (args.url or _ask("aenv API URL", config.api_url)).rstrip("/")
    sandbox_url = (args.auth_sandbox_url
                   or _ask("Data plane URL", config.sandbox_url if url == config.api_url
                           else default_sandbox_url(url))).rstrip("/")
    key = _key(args)
    if not key:
        raise CliError("the API key cannot be empty", errors.USAGE)
    if not args.no_verify:
        try:
            verify(Config(url, sandbox_url, key))
        except httpx.TransportError as exc:
            raise CliError(f"cannot reach {url}: {exc} (--no-verify stores it anyway)", errors.UNAVAILABLE) from None
    path = write_credentials({"api_url": url, "sandbox_url": sandbox_url, "api_key": key})
    print(f"Credentials saved to {path}", flush=True)
    now = resolve({}, need_key=False)
    overridden = [f"{name} ({source})" for name, source in now.sources.items() if source not in ("file", "default")]
    if overridden:
        output.warn("the environment overrides the file for: " + ", ".join(overridden))
    return 0


def _masked(key: str) -> str:
    return f"{key[:8]}…{key[-4:]}" if len(key) > 16 else ("…" if key else "")


def cmd_status(args, config: Config) -> int:
    report = {"credentialsFile": str(credentials_path()),
              "apiUrl": config.api_url, "sandboxUrl": config.sandbox_url, "apiKey": _masked(config.api_key),
              "sources": config.sources}
    status = 0
    if not config.api_key:
        report["api"], status = "no API key", errors.AUTH
    else:
        try:
            report["api"] = f"ok ({verify(config) * 1000:.0f} ms)"
        except errors.CliError as exc:
            report["api"], status = exc.message, exc.exit_code
        except httpx.TransportError as exc:
            report["api"], status = f"unreachable: {exc}", errors.UNAVAILABLE
    try:
        httpx.get(config.sandbox_url + "/", timeout=5)
        report["dataPlane"] = "reachable"
    except httpx.TransportError as exc:
        report["dataPlane"] = f"unreachable: {exc}"
        status = status or errors.UNAVAILABLE
    if args.output == "json":
        output.print_json(report)
        return status
    src = config.sources
    print(f"credentials file  {report['credentialsFile']}")
    print(f"API URL           {config.api_url}  ({src.get('api_url')})")
    print(f"data plane URL    {config.sandbox_url}  ({src.get('sandbox_url')})")
    print(f"API key           {report['apiKey'] or '-'}  ({src.get('api_key', 'none')})")
    print(f"API               {report['api']}")
    print(f"data plane        {report['dataPlane']}", flush=True)
    return status


def cmd_logout(args, config: Config) -> int:
    path = credentials_path()
    print(f"Removed {path}" if remove_credentials(path) else f"No credentials at {path}", flush=True)
    return 0
