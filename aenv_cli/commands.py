"""Every ``aenv`` command, flag and help text: the whole command line in one place.

Handlers are named, not imported (``"sandboxes:cmd_ls"``), and loaded only for the
command that runs, so ``aenv --help`` or a typo costs no httpx import. The sandbox id
arguments complete from the API (``aenv_cli.completion``)."""
from __future__ import annotations

import argparse

from . import __version__, completion

EXIT_CODES = """\
exit status:
  0    success
  1    failed (a build or fork child failed, a server error)
  2    bad usage: refused by the parser, or by the server (400)
  3    not authenticated: no API key, or the key was refused (401/403)
  4    not found (404): sandbox, template, snapshot, node, path
  5    conflict: wrong state for that (409), or a local file in the way (--force)
  6    unavailable: server or sandbox unreachable (connection, 502/503/504, 429)
  124  exec --timeout: the command ran out of time and was killed
  130  interrupted (Ctrl-C); a shell whose sandbox was paused, killed or lost
  exec, connect and an attached start exit with the remote command's status
  (128+N when signal N killed it)."""

DESCRIPTION = """\
Manage aenv sandboxes, snapshots and templates over the E2B API.

Configuration: `aenv auth` stores the API URL, data plane URL and key; the
AENV_API_URL / AENV_SANDBOX_URL / AENV_API_KEY and E2B_API_URL / E2B_SANDBOX_URL /
E2B_API_KEY variables win over it, and the global flags over both.
Lists print a table on a terminal and JSON when piped (-o table|json)."""

BUILD_HELP = """\
Builds a template from a Dockerfile, as the E2B SDK's Template.from_dockerfile does,
and prints its build log live. The file is read here:

  FROM image [AS name]   one stage only (no second FROM, no COPY --from)
  RUN                    shell or JSON form (--mount=type=cache, --network ignored);
                         no heredocs
  COPY / ADD             --chown=user[:group] --chmod=0755; one step per source;
                         .dockerignore of the context honoured; ADD never fetches URLs
                         or unpacks archives (refused)
  ENV, ARG k=default     ENV steps (an ARG without a default is skipped)
  WORKDIR, USER          steps (the build ends as USER user, WORKDIR /home/user
                         unless the file set them)
  CMD / ENTRYPOINT       the start command (ready command: sleep 20, or --ready-cmd)
  EXPOSE LABEL MAINTAINER STOPSIGNAL VOLUME   ignored with a warning
  SHELL HEALTHCHECK ONBUILD, anything else     refused, naming the line

Exit status: 0 ready, 1 failed (the reason and its step are printed), 130 interrupted
(the build keeps running on the server)."""

STATES = ("running", "paused")
LOG_LEVELS = ("debug", "info", "warn", "error")
DEFAULT_READY_CMD = "sleep 20"  # aenv_cli.dockerfile.DEFAULT_READY_CMD (a test keeps them equal)


# --------------------------------------------------------------------------- value types


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def seconds(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number of seconds: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError("must not be negative")
    return value


def page_size(text: str) -> int:
    value = positive(text)
    if value > 100:
        raise argparse.ArgumentTypeError("at most 100 (the API's largest page)")
    return value


def pair(text: str) -> tuple[str, str]:
    """``KEY=VALUE`` (the value may be empty or hold ``=``)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, not {text!r}")
    return key, value


def mount(text: str) -> dict:
    """``NAME:/path``: a volume mounted at an absolute path (E2B's ``volumeMounts`` entry)."""
    name, sep, path = text.partition(":")
    if not sep or not name or not path.startswith("/"):
        raise argparse.ArgumentTypeError(f"expected VOLUME:/absolute/path, not {text!r}")
    return {"name": name, "path": path}


def states(text: str) -> list[str]:
    """``running``, ``paused`` or both comma-joined."""
    values = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in values if s not in STATES]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"state must be running or paused, not {text!r}")
    return values


# --------------------------------------------------------------------------- helpers


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog):
        super().__init__(prog, max_help_position=30)


def _command(sub, name: str, handler: str, text: str, *, aliases=(), description: str | None = None,
             parents=(), epilog: str | None = None) -> argparse.ArgumentParser:
    p = sub.add_parser(name, aliases=list(aliases), help=text, description=description or text[:1].upper() + text[1:] + ".",
                       parents=list(parents), formatter_class=_Formatter, epilog=epilog)
    p.set_defaults(handler=handler)
    return p


def _sandbox_arg(p, *states_: str, nargs=None, help_text: str = "the sandbox's id"):
    arg = p.add_argument("sandbox_id" if nargs is None else "sandbox_ids", nargs=nargs, metavar="SANDBOX_ID",
                         help=help_text)
    arg.completer = completion.SandboxIds(states_)
    return arg


def _output_parent() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("-o", "--output", choices=("table", "json"),
                   help="table or json (default: a table on a terminal, JSON when piped)")
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # the old spelling of -o json
    return p


def _action_parent() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("-o", "--output", choices=("text", "json"), help="text lines (default) or the results as JSON")
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # the old spelling of -o json
    return p


def _filters(p, *, what: str) -> None:
    p.add_argument("-s", "--state", type=states, action="append", metavar="STATE",
                   help=f"only {what} in this state: running, paused (repeatable or comma-joined)")
    p.add_argument("-m", "--metadata", type=pair, action="append", metavar="KEY=VALUE",
                   help=f"only {what} with this metadata (repeatable: all must match)")
    p.add_argument("--template", metavar="TEMPLATE", help=f"only {what} of this template (id or name)")


# --------------------------------------------------------------------------- the parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aenv", description=DESCRIPTION, epilog=EXIT_CODES,
                                     formatter_class=_Formatter)
    parser.add_argument("-V", "--version", action="version", version=f"aenv {__version__}")
    parser.add_argument("--api-url", metavar="URL", help="the API (default: from the environment or `aenv auth`)")
    parser.add_argument("--sandbox-url", metavar="URL", help="the data plane that reaches sandboxes")
    parser.add_argument("--api-key", metavar="KEY", help="the API key (visible to other local users: prefer "
                                                         "E2B_API_KEY or `aenv auth`)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    out, act = _output_parent(), _action_parent()
    _auth(sub)
    _sandboxes(sub, out, act)
    _processes(sub)
    _files(sub)
    _snapshots(sub, out, act)
    _volumes(sub, out, act)
    _observe(sub, out)
    _templates(sub, out, act)
    _build_command(sub, "build")  # AgentENV's spelling of template build
    p = _command(sub, "pull", "templates:cmd_pull", "make a template of an OCI image (template pull)")
    _pull_flags(p)
    p = _command(sub, "completion", "completion:cmd_completion", "print a shell completion script",
                 description="Prints the completion script of a shell. Install it with e.g.\n"
                             "  bash: aenv completion bash > ~/.local/share/bash-completion/completions/aenv\n"
                             "  zsh:  aenv completion zsh > \"${fpath[1]}/_aenv\"\n"
                             "  fish: aenv completion fish > ~/.config/fish/completions/aenv.fish\n"
                             "Sandbox ids complete from the API.")
    p.add_argument("shell", choices=("bash", "zsh", "fish"))
    return parser


def _auth(sub) -> None:
    p = _command(sub, "auth", "auth:cmd_login", "store the API URL and key (status, logout)",
                 description="Stores the API URL, the data plane URL and the API key in the credentials file\n"
                             "(asked for unless given; the key is read without echo, or from stdin with\n"
                             "--api-key-stdin) after checking them against the API.\n"
                             "`aenv auth status` shows what is in force and where it comes from;\n"
                             "`aenv auth logout` removes the file.")
    p.add_argument("--url", metavar="URL", help="the API URL (e.g. http://127.0.0.1:3000)")
    p.add_argument("--sandbox-url", dest="auth_sandbox_url", metavar="URL",
                   help="the data plane URL (default: port 3001 next to an API on 3000, else the API URL)")
    p.add_argument("--api-key", dest="auth_api_key", metavar="KEY", help="the API key")
    p.add_argument("--api-key-stdin", action="store_true", help="read the API key from stdin")
    p.add_argument("--no-verify", action="store_true", help="store without asking the API whether the key works")
    asub = p.add_subparsers(dest="auth_action", metavar="{status,logout}")
    s = _command(asub, "status", "auth:cmd_status", "show the settings in force and check them")
    s.add_argument("-o", "--output", choices=("table", "json"), help="text or json")
    _command(asub, "logout", "auth:cmd_logout", "remove the credentials file")


def _sandboxes(sub, out, act) -> None:
    p = _command(sub, "ls", "sandboxes:cmd_ls", "list sandboxes (all pages)", aliases=["list"], parents=[out],
                 description="Lists the team's sandboxes, newest first, following the API's pages to the end.")
    _filters(p, what="sandboxes")
    p.add_argument("--limit", type=page_size, default=100, metavar="N",
                   help="sandboxes per request (1-100; every page is read)")
    p.add_argument("--max", type=positive, metavar="N", help="stop after N sandboxes")

    p = _command(sub, "info", "sandboxes:cmd_info", "show one sandbox", parents=[out])
    _sandbox_arg(p)

    for name, detach in (("start", False), ("create", True)):
        text = ("start a sandbox and open a shell in it (-d: print its id)" if not detach
                else "start a sandbox and print its id (start -d)")
        p = _command(sub, name, "sandboxes:cmd_start", text, parents=[act], description=(
            "Starts a sandbox from a template or snapshot (id or name; default: base).\n"
            + ("Opens a shell in it unless -d; the sandbox keeps running when the shell ends\n"
               "(--rm kills it then)." if not detach else "Prints its id (start -d).")))
        p.set_defaults(detach=detach)
        p.add_argument("template_ref", nargs="?", metavar="TEMPLATE", help="template or snapshot id or name")
        p.add_argument("-t", "--template", dest="template_opt", metavar="TEMPLATE", help=argparse.SUPPRESS)
        p.add_argument("--timeout", type=seconds, default=300, metavar="SECONDS",
                       help="time to live; then it pauses (or is killed with --no-auto-pause); default 300")
        p.add_argument("-m", "--metadata", type=pair, action="append", metavar="KEY=VALUE", help="metadata (repeatable)")
        p.add_argument("-e", "--env", type=pair, action="append", metavar="KEY=VALUE",
                       help="environment variable of every process in it (repeatable)")
        p.add_argument("--cpu", type=positive, metavar="N",
                       help="vCPUs: must be the template's (a template fixes them: aenv template build --cpu)")
        p.add_argument("--memory", "--memory-mb", dest="memory", type=positive, metavar="MIB",
                       help="memory in MiB: must be the template's (aenv template build --memory-mb)")
        p.add_argument("--secure", action=argparse.BooleanOptionalAction, default=None,
                       help="require the sandbox's access token for envd (default: yes)")
        p.add_argument("--auto-pause", action=argparse.BooleanOptionalAction, default=None,
                       help="pause at the end of the timeout (default), or kill it (--no-auto-pause)")
        p.add_argument("--auto-resume", action="store_true", help="resume it when traffic reaches it while paused")
        p.add_argument("--no-internet", action="store_true", help="no outbound network at all")
        p.add_argument("--allow-out", action="append", metavar="CIDR", help="allowed outbound destination (repeatable)")
        p.add_argument("--deny-out", action="append", metavar="CIDR", help="denied outbound destination (repeatable)")
        p.add_argument("-v", "--volume", type=mount, action="append", metavar="VOLUME:PATH",
                       help="mount a volume (name) at an absolute path (repeatable)")
        if not detach:
            p.add_argument("-d", "--detach", action="store_true", help="print the id and return (no shell)")
            p.add_argument("--rm", action="store_true", help="kill the sandbox when the shell exits")
            _shell_flags(p)
        p.add_argument("--wait", type=float, default=300, metavar="SECONDS", help=argparse.SUPPRESS)

    p = _command(sub, "pause", "sandboxes:cmd_pause", "pause sandboxes (memory and processes kept)", parents=[act])
    _sandbox_arg(p, "running", nargs="+")
    p.add_argument("--no-memory", action="store_true",
                   help="keep only the disk (processes restart on resume); faster, smaller")

    p = _command(sub, "resume", "sandboxes:cmd_resume", "resume paused sandboxes", parents=[act])
    _sandbox_arg(p, "paused", nargs="+")
    p.add_argument("--timeout", type=seconds, default=300, metavar="SECONDS", help="time to live from now (default 300)")

    p = _command(sub, "timeout", "sandboxes:cmd_timeout", "set a sandbox's time to live from now", parents=[act])
    _sandbox_arg(p, "running")
    p.add_argument("seconds", type=seconds, metavar="SECONDS")

    p = _command(sub, "rm", "sandboxes:cmd_rm", "kill sandboxes (by id, or --all with filters)",
                 aliases=["kill", "delete"], parents=[act],
                 description="Kills sandboxes by id, or every sandbox that --all with the filters selects.\n"
                             "Exit 0 when all are gone, else the status of the first failure.")
    _sandbox_arg(p, nargs="*")
    p.add_argument("-a", "--all", action="store_true", help="every sandbox the filters select (all without filters)")
    _filters(p, what="sandboxes")
    p.add_argument("-y", "--yes", action="store_true", help="do not ask on a terminal before --all")

    p = _command(sub, "fork", "sandboxes:cmd_fork", "fork a running sandbox into N children, printing their ids",
                 parents=[act], description="Forks a running sandbox: N children with its memory, processes and "
                                            "files.\nPrints one child id per line; exit 1 if any child failed.")
    _sandbox_arg(p, "running")
    p.add_argument("-n", "--count", type=positive, default=1, metavar="N", help="children (default 1)")
    p.add_argument("--timeout", type=seconds, metavar="SECONDS", help="the children's time to live")


def _shell_flags(p) -> None:
    p.add_argument("--shell", metavar="PATH", help="the shell (default: bash as a login shell, else sh)")
    p.add_argument("--user", metavar="USER", help="run as this user (default: the template's)")
    p.add_argument("--cwd", metavar="DIR", help="start in this directory")


def _processes(sub) -> None:
    p = _command(sub, "connect", "shell:cmd_connect", "open an interactive shell in a sandbox", aliases=["cn"],
                 description="Opens a shell on a terminal in the sandbox (resuming it if paused). Ctrl-C goes to\n"
                             "the remote shell; the window size follows yours; a broken connection is\n"
                             "re-established. Exits with the shell's status, or 130 when the sandbox is\n"
                             "paused, killed or lost.")
    _sandbox_arg(p)
    _shell_flags(p)
    p.add_argument("--timeout", type=seconds, default=300, metavar="SECONDS",
                   help="time to live to set on connecting, extended while the shell is used (default 300)")

    p = _command(sub, "exec", "execute:cmd_exec", "run a command in a sandbox",
                 description="Runs COMMAND with its arguments exactly as given (no shell; --shell joins them\n"
                             "into one bash -l -c line), streaming stdout and stderr. A piped stdin is sent to it.\n"
                             "Exits with the command's status (128+N if signal N killed it); Ctrl-C kills it.\n"
                             "  aenv exec <id> -- ls -la /tmp")
    _sandbox_arg(p, "running")
    p.add_argument("--user", metavar="USER", help="run as this user (default: the template's)")
    p.add_argument("--cwd", metavar="DIR", help="working directory")
    p.add_argument("-e", "--env", type=pair, action="append", metavar="KEY=VALUE", help="environment (repeatable)")
    p.add_argument("--shell", action="store_true", help="run the words as one line of bash -l -c")
    p.add_argument("--timeout", type=seconds, metavar="SECONDS", help="kill the command after this long (exit 124)")
    p.add_argument("-n", "--no-stdin", action="store_true", help="do not send stdin even when it is piped")
    p.add_argument("argv", nargs=argparse.REMAINDER, metavar="COMMAND ...")


def _files(sub) -> None:
    p = _command(sub, "upload", "transfer:cmd_upload", "copy a file or directory into a sandbox",
                 description="Copies a local file or directory into a sandbox. A REMOTE_PATH ending in / or an\n"
                             "existing remote directory receives LOCAL_PATH under its own name. Each file\n"
                             "appears under its name only once complete. Symlinks and special files are refused.")
    _sandbox_arg(p, "running")
    p.add_argument("local_path", metavar="LOCAL_PATH")
    p.add_argument("remote_path", metavar="REMOTE_PATH", help="absolute, or relative to the user's home")
    p.add_argument("--user", metavar="USER", help="write as this user (default: the template's)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")

    p = _command(sub, "download", "transfer:cmd_download", "copy a file or directory out of a sandbox",
                 description="Copies a file or directory out of a sandbox into LOCAL_PATH (default: .). An existing\n"
                             "local directory receives it under its own name; directories merge. Nothing is\n"
                             "replaced without --force; each file appears under its name only once complete.")
    _sandbox_arg(p, "running")
    p.add_argument("remote_path", metavar="REMOTE_PATH")
    p.add_argument("local_path", nargs="?", default=".", metavar="LOCAL_PATH")
    p.add_argument("--user", metavar="USER", help="read as this user (default: the template's)")
    p.add_argument("-f", "--force", action="store_true", help="replace local files that are in the way")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def _snapshots(sub, out, act) -> None:
    p = _command(sub, "snapshot", "snapshots:cmd_ls", "create, list and delete snapshots", aliases=["snap"],
                 description="Snapshots: a sandbox's memory, processes and disk, to start sandboxes from\n"
                             "(aenv start <snapshot>).")
    ssub = p.add_subparsers(dest="snapshot_action", required=True, metavar="{create,ls,rm}")
    c = _command(ssub, "create", "snapshots:cmd_create", "snapshot a running sandbox (it keeps running)",
                 parents=[act])
    _sandbox_arg(c, "running")
    c.add_argument("--name", metavar="NAME", help="a name to start sandboxes from")
    c.add_argument("--no-memory", action="store_true", help="disk only (sandboxes from it boot afresh)")
    c = _command(ssub, "ls", "snapshots:cmd_ls", "list snapshots (all pages)", aliases=["list"], parents=[out])
    c.add_argument("--sandbox", metavar="SANDBOX_ID", help="only snapshots of this sandbox")
    c.add_argument("--name", metavar="NAME", help="only the snapshot with this name")
    c.add_argument("--limit", type=page_size, default=100, metavar="N", help="snapshots per request (1-100)")
    c = _command(ssub, "rm", "snapshots:cmd_rm", "delete snapshots", aliases=["delete"], parents=[act],
                 description="Deletes snapshots by id or name (refused while sandboxes still use their files).")
    c.add_argument("snapshots", nargs="+", metavar="SNAPSHOT")


def _volumes(sub, out, act) -> None:
    p = _command(sub, "volume", "volumes:cmd_ls", "create, list and delete volumes; their files",
                 aliases=["volumes", "vol"],
                 description="Volumes: persistent team storage that sandboxes mount (aenv start -v NAME:/path),\n"
                             "kept when they end. A volume is named by its name or id; its files are reached\n"
                             "without a sandbox through the volume content API.")
    vsub = p.add_subparsers(dest="volume_action", required=True, metavar="{ls,create,rm,mkdir,put,get}")
    c = _command(vsub, "ls", "volumes:cmd_ls", "list volumes, or the files of one", aliases=["list"], parents=[out],
                 description="Without VOLUME: the team's volumes. With VOLUME: the files under PATH (default /).")
    c.add_argument("volume", nargs="?", metavar="VOLUME", help="a volume's name or id")
    c.add_argument("path", nargs="?", default="/", metavar="PATH", help="a directory of the volume (default /)")
    c.add_argument("-d", "--depth", type=positive, default=1, metavar="N", help="levels listed (1-32, default 1)")
    c = _command(vsub, "create", "volumes:cmd_create", "create a volume (prints its id)", parents=[act])
    c.add_argument("name", metavar="NAME", help="letters, digits, _ and -; unique in the team")
    c = _command(vsub, "rm", "volumes:cmd_rm", "delete volumes and their files", aliases=["delete"], parents=[act],
                 description="Deletes volumes by name or id with every file in them (refused, exit 5, while a\n"
                             "live sandbox or a snapshot mounts one).")
    c.add_argument("volumes", nargs="+", metavar="VOLUME")
    c = _command(vsub, "mkdir", "volumes:cmd_mkdir", "make a directory in a volume")
    c.add_argument("volume", metavar="VOLUME")
    c.add_argument("path", metavar="PATH")
    c.add_argument("-p", "--parents", action="store_true", help="make missing parents too")
    c = _command(vsub, "put", "volumes:cmd_put", "copy a file or directory into a volume",
                 description="Copies a local file or directory into a volume. A REMOTE_PATH ending in / or an\n"
                             "existing directory receives LOCAL_PATH under its own name. Each file is written\n"
                             "whole (replacing one of the same name). Symlinks and special files are refused.")
    c.add_argument("volume", metavar="VOLUME")
    c.add_argument("local_path", metavar="LOCAL_PATH")
    c.add_argument("remote_path", nargs="?", default="/", metavar="REMOTE_PATH", help="default: the volume's root")
    c.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    c = _command(vsub, "get", "volumes:cmd_get", "copy a file or directory out of a volume",
                 description="Copies a file or directory of a volume into LOCAL_PATH (default: .). An existing\n"
                             "local directory receives it under its own name. Nothing is replaced without\n"
                             "--force; each file appears under its name only once complete.")
    c.add_argument("volume", metavar="VOLUME")
    c.add_argument("remote_path", metavar="REMOTE_PATH")
    c.add_argument("local_path", nargs="?", default=".", metavar="LOCAL_PATH")
    c.add_argument("-f", "--force", action="store_true", help="replace local files that are in the way")
    c.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def _observe(sub, out) -> None:
    p = _command(sub, "logs", "observe:cmd_logs", "print a sandbox's logs",
                 description="Prints a sandbox's logs (its console and envd), oldest first. -o json prints one\n"
                             "JSON object per line.")
    _sandbox_arg(p)
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines (until Ctrl-C or the "
                                                                "sandbox is gone)")
    p.add_argument("--limit", type=positive, default=1000, metavar="N", help="lines per request (default 1000)")
    p.add_argument("--level", choices=LOG_LEVELS, help="only lines at this level or above")
    p.add_argument("-o", "--output", choices=("text", "json"), help="text (default) or json lines")

    p = _command(sub, "metrics", "observe:cmd_metrics", "show a sandbox's CPU, memory and disk use", parents=[out])
    _sandbox_arg(p)
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new samples")
    p.add_argument("--since", type=seconds, metavar="SECONDS", help="only samples from the last SECONDS")

    p = _command(sub, "nodes", "observe:cmd_nodes",
                 "list the cluster's nodes (or show one; every figure with AENV_ADMIN_TOKEN)", parents=[out])
    p.add_argument("node_id", nargs="?", metavar="NODE_ID")


def _templates(sub, out, act) -> None:
    p = _command(sub, "template", "templates:cmd_ls", "build, list, delete templates and read build logs",
                 aliases=["templates"],
                 description="Templates: build one from a Dockerfile, list, delete, read build logs.")
    tsub = p.add_subparsers(dest="template_action", required=True, metavar="{build,pull,ls,rm,logs,watch}")

    _build_command(tsub, "build")

    p = _command(tsub, "pull", "templates:cmd_pull", "make a template of an OCI image as it is",
                 description="Makes a template of an OCI image as it is (no steps) and prints its build log\n"
                             "live. Public images need nothing; see docs/templates.md for private registries.")
    _pull_flags(p)
    _command(tsub, "ls", "templates:cmd_ls", "list the team's templates", aliases=["list"], parents=[out])

    p = _command(tsub, "rm", "templates:cmd_rm", "delete templates", aliases=["delete"], parents=[act],
                 description="Deletes templates by id or name (refused while sandboxes use them).")
    p.add_argument("templates", nargs="+", metavar="ID_OR_NAME")

    for name, follow in (("logs", False), ("watch", True)):
        text = "print a build's log" if not follow else "follow a build to its end (logs -f)"
        p = _command(tsub, name, "templates:cmd_logs", text,
                     description=text[:1].upper() + text[1:] + " (default: the template's newest build).")
        p.add_argument("template", metavar="ID_OR_NAME")
        p.add_argument("build_id", nargs="?", metavar="BUILD_ID")
        p.add_argument("--follow", "-f", action="store_true", default=follow,
                       help="keep printing until the build ends (exit 1 if it failed)")
        p.add_argument("--level", choices=LOG_LEVELS, help="only entries at this level or above")


def _build_command(sub, name: str) -> None:
    p = _command(sub, name, "templates:cmd_build", "build a template from a Dockerfile", description=BUILD_HELP)
    p.add_argument("path", help="an e2b.Dockerfile / Dockerfile, or a directory holding one (e2b.Dockerfile first)")
    p.add_argument("--name", "-n", required=True, metavar="NAME[:TAG]", help="the template's name, with a tag")
    _size_flags(p)
    p.add_argument("--start-cmd", help="the start command (instead of the Dockerfile's CMD / ENTRYPOINT)")
    p.add_argument("--ready-cmd", help=f"the ready check, a shell command (default with a start command: "
                                       f"{DEFAULT_READY_CMD})")
    p.add_argument("--context", metavar="DIR", help="the directory COPY sources are relative to "
                                                    "(default: the Dockerfile's)")


def _size_flags(p) -> None:
    p.add_argument("--tag", action="append", metavar="TAG", help="an extra tag for this build (repeatable)")
    p.add_argument("--cpu", type=positive, help="vCPUs of the template's sandboxes (1 or even; default 2)")
    p.add_argument("--memory-mb", "--memory", dest="memory_mb", type=positive,
                   help="memory of the template's sandboxes in MiB (default 1024)")
    p.add_argument("--no-cache", action="store_true", help="rebuild every layer (the build's force flag)")
    p.add_argument("-d", "--detach", action="store_true", help="start the build and return (template logs -f "
                                                                "follows it)")
    p.add_argument("--json", action="store_true", help="print the result as JSON (the log goes to stderr)")


def _pull_flags(p) -> None:
    p.add_argument("image", metavar="IMAGE", help="e.g. docker.io/library/python:3.12-slim")
    p.add_argument("--name", "-n", metavar="NAME[:TAG]", help="the template's name (default: the image's, e.g. python)")
    _size_flags(p)
    p.add_argument("--start-cmd", help="a command started in every sandbox of it (e.g. a server)")
    ready = p.add_mutually_exclusive_group()
    ready.add_argument("--ready-cmd", help=f"the ready check, a shell command (default with a start command: "
                                           f"{DEFAULT_READY_CMD})")
    ready.add_argument("--probe", type=positive, metavar="PORT", help="ready once PORT accepts connections "
                                                                       "(needs bash in the image)")
