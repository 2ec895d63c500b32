"""``aenv``: parse the command line (``aenv_cli.commands``), load the one handler it
names, resolve the configuration (``aenv_cli.config``) and turn whatever the handler
raises into a message on stderr and an exit status (``aenv_cli.errors``)."""
from __future__ import annotations

import importlib
import os
import sys

from . import commands, completion, errors
from .config import resolve

# Handlers that run without an API key (they configure it, or need no server).
NO_KEY = {"completion:cmd_completion", "auth:cmd_login", "auth:cmd_status", "auth:cmd_logout"}


def handler_of(name: str):
    module, func = name.split(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), func)


def main(argv: list[str] | None = None) -> int:
    parser = commands.build_parser()
    if completion.active():
        completion.complete(parser)  # answers the shell and exits
    args = parser.parse_args(argv)
    try:
        handler = handler_of(args.handler)
        flags = {"api_url": args.api_url, "sandbox_url": args.sandbox_url, "api_key": args.api_key}
        config = resolve(flags, need_key=args.handler not in NO_KEY)
        return handler(args, config)
    except errors.CliError as exc:
        print(f"aenv: {exc.message}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("aenv: interrupted", file=sys.stderr)
        return errors.INTERRUPTED
    except BrokenPipeError:  # `aenv ls | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as exc:
        described = errors.describe(exc)
        if described is None:
            raise
        message, code = described
        print(f"aenv: {message}", file=sys.stderr)
        return code


if __name__ == "__main__":
    raise SystemExit(main())
