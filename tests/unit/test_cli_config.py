"""``aenv`` configuration and conventions without a server: where settings come from
(flags, AENV_*, E2B_*, the credentials file, defaults), the file itself (TOML, 0600,
atomic), ``--help`` on every command, usage errors, tables and JSON, exit statuses,
shell completion scripts, and a start that loads neither Django nor httpx for --help."""
import argparse
import os
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from aenv_cli import commands, config, errors, output
from aenv_cli.dockerfile import DEFAULT_READY_CMD

ROOT = Path(__file__).resolve().parents[2]
ENV_NAMES = [v for names in config.VARIABLES.values() for v in names]


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A config dir of our own and no aenv / E2B variables."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "xdg" / "aenv"


def run_aenv(*argv, env=None, input=None, timeout=60):
    base = {k: v for k, v in os.environ.items() if k not in ENV_NAMES}
    return subprocess.run([sys.executable, "-m", "aenv_cli", *argv], capture_output=True, text=True, cwd=ROOT,
                          env={**base, **(env or {})}, input=input, timeout=timeout)


# --------------------------------------------------------------------------- settings


def test_the_credentials_file_is_toml_private_and_replaced_whole(home):
    assert config.credentials_path() == home / "credentials"  # XDG on Linux
    path = config.write_credentials({"api_url": "http://h:3000", "api_key": 'k"ey\\é', "sandbox_url": "http://h:3001"})
    assert path == home / "credentials"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert tomllib.loads(path.read_text()) == {"url": "http://h:3000", "api_key": 'k"ey\\é', "sandbox_url": "http://h:3001"}
    config.write_credentials({"api_url": "http://other:3000", "api_key": "k2"})
    assert config.read_credentials() == {"api_url": "http://other:3000", "api_key": "k2"}
    assert sorted(p.name for p in home.iterdir()) == ["credentials"]  # no temporary file left
    assert config.remove_credentials() and not config.remove_credentials()
    assert config.read_credentials() == {}


def test_agentenvs_file_is_read_and_a_broken_one_named(home):
    home.mkdir(parents=True)
    (home / "credentials").write_text('url = "http://gw:8080"\napi_key = "abc"\nextra = 1\n')
    assert config.resolve() == config.Config("http://gw:8080", "http://gw:8080", "abc")
    (home / "credentials").write_text("url = \n")
    with pytest.raises(errors.CliError, match=r"parsing .*credentials"):
        config.resolve()


def test_flags_then_aenv_then_e2b_variables_then_the_file_then_defaults(home):
    config.write_credentials({"api_url": "http://file:3000", "api_key": "file-key", "sandbox_url": "http://file-dp"})
    got = config.resolve({}, {})
    assert (got.api_url, got.sandbox_url, got.api_key) == ("http://file:3000", "http://file-dp", "file-key")
    assert got.sources == {"api_url": "file", "sandbox_url": "file", "api_key": "file"}
    env = {"E2B_API_URL": "http://file:3000/", "E2B_API_KEY": "e2b-key", "AENV_API_KEY": "aenv-key"}
    got = config.resolve({}, env)
    assert (got.api_url, got.sandbox_url, got.api_key) == ("http://file:3000", "http://file-dp", "aenv-key")
    assert got.sources["api_key"] == "AENV_API_KEY"
    got = config.resolve({"api_key": "flag-key", "sandbox_url": "http://flag-dp/"}, env)
    assert (got.sandbox_url, got.api_key) == ("http://flag-dp", "flag-key")


def test_the_files_key_never_goes_to_another_server(home):
    config.write_credentials({"api_url": "http://file:3000", "api_key": "file-key", "sandbox_url": "http://file-dp"})
    got = config.resolve({}, {"E2B_API_URL": "http://elsewhere:3000"}, need_key=False)
    assert (got.api_url, got.sandbox_url, got.api_key) == ("http://elsewhere:3000", "http://elsewhere:3001", "")
    with pytest.raises(errors.CliError) as caught:
        config.resolve({}, {"E2B_API_URL": "http://elsewhere:3000"})
    assert caught.value.exit_code == errors.AUTH and "aenv auth" in caught.value.message


def test_defaults_and_the_data_plane_beside_the_api(home):
    got = config.resolve({}, {}, need_key=False)
    assert (got.api_url, got.sandbox_url) == ("http://127.0.0.1:3000", "http://127.0.0.1:3001")
    assert config.default_sandbox_url("https://aenv.example.com") == "https://aenv.example.com"
    assert config.default_sandbox_url("http://[::1]:3000/x") == "http://[::1]:3001/x"


def test_without_a_key_every_command_says_how_to_get_one(home):
    out = run_aenv("ls", env={"XDG_CONFIG_HOME": str(home.parent)})
    assert out.returncode == 3 and "not authenticated: run `aenv auth`" in out.stderr and "E2B_API_KEY" in out.stderr


# --------------------------------------------------------------------------- the command line


def _parsers(parser, prefix=()):
    yield prefix, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            seen = set()
            for name, sub in action.choices.items():
                if id(sub) not in seen:
                    seen.add(id(sub))
                    yield from _parsers(sub, (*prefix, name))


def test_help_on_every_command():
    every = [argv for argv, _ in _parsers(commands.build_parser())]
    assert len(every) >= 30 and ("snapshot", "create") in every and ("auth", "status") in every
    for argv in every:
        out = run_aenv(*argv, "--help")
        assert out.returncode == 0 and out.stdout.startswith(f"usage: aenv{' ' if argv else ''}{' '.join(argv)}"), argv
    top = run_aenv("--help").stdout
    assert "exit status:" in top and "E2B_API_KEY" in top
    assert run_aenv("--version").stdout == f"aenv {__import__('aenv_cli').__version__}\n"


def test_every_alias_of_agentenvs_cli_is_there():
    parser = commands.build_parser()
    for argv in (["list"], ["ls"], ["cn", "x"], ["delete", "x"], ["kill", "x"], ["snap", "ls"], ["templates", "ls"],
                 ["start", "-d", "base"], ["create"], ["timeout", "x", "5"], ["exec", "x", "--", "ls", "-la"],
                 ["pull", "ubuntu:24.04", "--probe", "80", "-d"], ["build", "Dockerfile", "--name", "x"],
                 ["template", "watch", "x"], ["completion", "zsh"], ["auth"], ["upload", "x", "a", "b"],
                 ["download", "x", "a"], ["resume", "x"], ["pause", "x"], ["snapshot", "create", "x"]):
        parser.parse_args(argv)


@pytest.mark.parametrize("argv, words", [
    ([], "required: COMMAND"),
    (["nope"], "invalid choice"),
    (["timeout", "x", "soon"], "not a whole number of seconds"),
    (["ls", "-s", "stopped"], "state must be running or paused"),
    (["create", "-m", "novalue"], "expected KEY=VALUE"),
    (["fork", "x", "-n", "0"], "must be at least 1"),
    (["completion", "tcsh"], "invalid choice"),
])
def test_usage_errors_exit_2(argv, words):
    out = run_aenv(*argv)
    assert out.returncode == 2 and words in out.stderr, out.stderr


def test_exec_passes_its_words_untouched():
    from aenv_cli.execute import command_of  # noqa: PLC0415

    args = commands.build_parser().parse_args(["exec", "sb", "--", "sh", "-c", "echo 'a  b'; exit 3", "--user"])
    assert command_of(args) == ("sh", ["-c", "echo 'a  b'; exit 3", "--user"]) and args.user is None
    args = commands.build_parser().parse_args(["exec", "--user", "root", "sb", "ls", "-la"])
    assert (args.user, command_of(args)) == ("root", ("ls", ["-la"]))

    assert command_of(argparse.Namespace(argv=["--", "ls", "-la", "a b"], shell=False)) == ("ls", ["-la", "a b"])
    assert command_of(argparse.Namespace(argv=["echo", "$HOME"], shell=True)) == ("/bin/bash", ["-l", "-c",
                                                                                                "echo $HOME"])
    with pytest.raises(errors.CliError) as caught:
        command_of(argparse.Namespace(argv=["--"], shell=False))
    assert caught.value.exit_code == errors.USAGE


def test_the_ready_command_in_the_help_is_the_builds():
    assert commands.DEFAULT_READY_CMD == DEFAULT_READY_CMD


def test_help_loads_neither_django_nor_httpx():
    code = ("import sys\nfrom aenv_cli.main import main\ntry:\n    main(['ls', '--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'django', 'httpx', 'tqdm', 'argcomplete'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0 and out.stdout.strip().endswith("[]"), out.stderr
    code = "import sys, aenv_cli.main, aenv_cli.shell, aenv_cli.transfer, aenv_cli.sandboxes, aenv_cli.observe, " \
           "aenv_cli.auth, aenv_cli.snapshots, aenv_cli.execute; print('django' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT).stdout == "False\n"


# --------------------------------------------------------------------------- output and exit statuses


def test_tables_are_boxed_with_a_dash_for_missing_cells():
    assert output.table(["ID", "NAMES"], [["a", ["x", "y"]], ["bb", None]]) == "\n".join([
        "┌────┬───────┐",
        "│ ID │ NAMES │",
        "├────┼───────┤",
        "│ a  │ x,y   │",
        "│ bb │ -     │",
        "└────┴───────┘"])
    assert output.table(["EMPTY"], []).count("\n") == 3  # the header even without rows
    assert [output.size(n) for n in (0, 1536, 20 * 2**20)] == ["0 B", "1.5 KiB", "20.0 MiB"]


def test_json_when_piped_or_asked_tables_on_a_terminal(monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert not output.wants_json(argparse.Namespace(output=None))
    assert output.wants_json(argparse.Namespace(output="json")) and output.wants_json(argparse.Namespace(json=True))
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)
    assert output.wants_json(argparse.Namespace(output=None))
    assert not output.wants_json(argparse.Namespace(output="table"))


def test_exit_statuses_by_cause():
    assert [errors.exit_code_for_status(s) for s in (400, 401, 403, 404, 409, 429, 500, 502, 503, 504)] == [
        2, 3, 3, 4, 5, 6, 1, 6, 6, 6]
    assert errors.remote_exit_status(0) == 0 and errors.remote_exit_status(7, "exit status 7") == 7
    assert errors.remote_exit_status(-1, "signal: killed") == 137
    assert errors.remote_exit_status(-1, "signal: terminated") == 143
    assert errors.remote_exit_status(-1, "signal: segmentation fault") == 139
    assert errors.remote_exit_status(-1, "signal: signal 34") == 162
    assert errors.remote_exit_status(-1, "something else") == 255
    assert "aenv auth" in errors.ApiError(401, "bad key").message and errors.ApiError(401, "x").exit_code == 3


# --------------------------------------------------------------------------- completion


@pytest.mark.parametrize("shell, marker", [("bash", "complete "), ("zsh", "#compdef aenv"), ("fish", "complete ")])
def test_completion_scripts(shell, marker):
    out = run_aenv("completion", shell)
    assert out.returncode == 0 and marker in out.stdout and "aenv" in out.stdout


def _complete(line: str, tmp_path, env=None) -> list[str]:
    answer = tmp_path / "completions"
    out = run_aenv(env={"_ARGCOMPLETE": "1", "_ARGCOMPLETE_IFS": "\n", "COMP_LINE": line,
                        "COMP_POINT": str(len(line)), "_ARGCOMPLETE_STDOUT_FILENAME": str(answer), **(env or {})})
    assert out.returncode == 0, out.stderr
    return answer.read_text().split()


def test_commands_and_flags_complete(tmp_path):
    assert {"snapshot", "start", "connect"} <= set(_complete("aenv ", tmp_path))
    assert set(_complete("aenv snapshot ", tmp_path)) >= {"create", "ls", "rm"}
    assert "--detach" in _complete("aenv start --de", tmp_path)
    assert _complete("aenv completion f", tmp_path) == ["fish"]
    # No server: a sandbox id completes to nothing, quickly, and without an error.
    assert _complete("aenv pause ", tmp_path, {"E2B_API_URL": "http://127.0.0.1:9", "E2B_API_KEY": "k"}) == []
