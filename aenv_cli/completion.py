"""Shell completion (argcomplete): ``aenv completion bash|zsh|fish`` prints the script
that makes the shell call ``aenv`` back with ``_ARGCOMPLETE`` set; ``main`` then answers
with the candidates instead of running a command. Commands, flags and choices complete
from the parser; sandbox ids from the API (``SandboxIds``: one quick list call, nothing
on any error, never a hang)."""
from __future__ import annotations

import os
import sys

COMPLETION_TIMEOUT = 1.0  # seconds for the API list behind a sandbox id completion


def active() -> bool:
    """True when the shell is asking ``aenv`` for completions."""
    return "_ARGCOMPLETE" in os.environ


def complete(parser) -> None:
    """Answers the shell's completion request and exits (argcomplete's protocol)."""
    import argcomplete  # noqa: PLC0415 - only while completing

    argcomplete.autocomplete(parser, always_complete_options=False)


class SandboxIds:
    """Completer of sandbox id arguments: the team's sandboxes in ``states`` (any when
    empty), from ``GET /v2/sandboxes``."""

    def __init__(self, states=()):
        self.states = tuple(states)

    def __call__(self, prefix: str = "", parsed_args=None, **_) -> list[str]:
        try:
            import httpx  # noqa: PLC0415

            from .config import resolve  # noqa: PLC0415

            flags = {k: getattr(parsed_args, k, None) for k in ("api_url", "sandbox_url", "api_key")}
            config = resolve(flags)
            params = {"limit": 100, **({"state": ",".join(self.states)} if self.states else {})}
            resp = httpx.get(f"{config.api_url}/v2/sandboxes", params=params, timeout=COMPLETION_TIMEOUT,
                             headers={"X-API-Key": config.api_key})
            rows = resp.json() if resp.status_code == 200 else []
            return sorted(r["sandboxID"] for r in rows if str(r.get("sandboxID", "")).startswith(prefix))
        except Exception:  # noqa: BLE001 - a completion never fails loudly
            return []


def cmd_completion(args, config) -> int:
    import argcomplete  # noqa: PLC0415

    sys.stdout.write(argcomplete.shellcode(["aenv"], shell=args.shell))
    return 0
