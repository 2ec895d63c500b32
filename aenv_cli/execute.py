"""``aenv exec``: one command in a sandbox, its argv passed exactly (``Process/Start``
with ``cmd`` and ``args``; ``--shell`` makes it one ``bash -l -c`` line), stdout and
stderr streamed to ours as they come, a piped stdin streamed to it (``SendInput``, then
``CloseStdin`` at its end), and its exit status as ours. Ctrl-C kills the remote
command: a foreground command should not outlive its terminal."""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import uuid

from envd_client import EnvdClient, EnvdError

from . import errors
from .api import check, client, segment
from .config import Config
from .errors import CliError

STREAM_IDLE = 120.0  # seconds: the data plane may first resume an auto-resuming sandbox
STDIN_CHUNK = 64 * 1024


def command_of(args) -> tuple[str, list[str]]:
    argv = list(args.argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        raise CliError("exec: a COMMAND is required (aenv exec <id> -- cmd args...)", errors.USAGE)
    if args.shell:
        return "/bin/bash", ["-l", "-c", " ".join(argv)]
    return argv[0], argv[1:]


def _feed_stdin(envd: EnvdClient, pid: int, stdin_fd: int) -> None:
    """Sends our stdin to the process's until it ends, then closes it (errors: the
    process is gone, and its end tells the rest)."""
    try:
        while data := os.read(stdin_fd, STDIN_CHUNK):
            envd.send_input(pid, data, pty=False)
        envd.close_stdin(pid)
    except (EnvdError, OSError):
        pass


def cmd_exec(args, config: Config) -> int:
    cmd, cmd_args = command_of(args)
    with client(config) as api:
        token = check(api.get(f"/sandboxes/{segment(args.sandbox_id)}")).json().get("envdAccessToken")
    send_stdin = not args.no_stdin and not os.isatty(0)

    def envd() -> EnvdClient:
        return EnvdClient.through_proxy(config.sandbox_url, args.sandbox_id, token, stream_idle_timeout=STREAM_IDLE)

    # A tag of its own: a Ctrl-C that comes before the start event (the pid) still finds the command.
    tag = f"aenv-exec-{uuid.uuid4().hex}"
    with envd() as stream_envd, envd() as control_envd:
        events = stream_envd.start(cmd, cmd_args, envs=dict(args.env or []), cwd=args.cwd, user=args.user,
                                   stdin=send_stdin, deadline=args.timeout, tag=tag)
        pid = None
        try:
            with contextlib.closing(events):
                for event in events:
                    if event.kind == "start":
                        pid = event.pid
                        if send_stdin:
                            threading.Thread(target=_feed_stdin, args=(control_envd, pid, 0), daemon=True).start()
                    elif event.kind == "data" and event.stream in ("stdout", "stderr"):
                        out = sys.stdout if event.stream == "stdout" else sys.stderr
                        out.buffer.write(event.data)
                        out.flush()
                    elif event.kind == "end":
                        return errors.remote_exit_status(event.exit_code, event.status)
        except KeyboardInterrupt:
            with contextlib.suppress(EnvdError):
                control_envd.kill(pid, tag=tag)
            raise CliError("interrupted: the command was killed", errors.INTERRUPTED) from None
        except EnvdError as exc:
            if exc.code == "deadline_exceeded" and args.timeout:
                raise CliError(f"timed out after {args.timeout}s: the command was killed", errors.TIMED_OUT) from None
            raise
    raise CliError("the command's stream ended without its exit status", errors.UNAVAILABLE)
