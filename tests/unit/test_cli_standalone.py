"""The CLI installs on its own: ``pip install ./packaging/aenv-cli`` into a fresh venv (packages from
PyPI only: the build backend and the CLI's few dependencies) gives a working ``aenv``
without Django or any server package; its help, version, completion and a real command
(which finds no server) run there."""
import json
import subprocess
import venv
from pathlib import Path

import pytest

from aenv_cli import __version__

ROOT = Path(__file__).resolve().parents[2]
DEPENDENCIES = {"aenv-cli", "httpx", "httpcore", "h11", "anyio", "idna", "certifi", "sniffio", "typing-extensions",
                "platformdirs", "argcomplete", "tqdm", "exceptiongroup", "tomli", "pip", "setuptools"}

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    where = tmp_path_factory.mktemp("standalone") / "venv"
    venv.create(where, with_pip=True)
    out = subprocess.run([str(where / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                          str(ROOT / "packaging" / "aenv-cli")], capture_output=True, text=True, timeout=540)
    assert out.returncode == 0, out.stderr
    return where


def test_only_the_clis_own_dependencies_are_installed(installed):
    out = subprocess.run([str(installed / "bin" / "python"), "-m", "pip", "list", "--format", "json",
                          "--disable-pip-version-check"], capture_output=True, text=True, check=True)
    names = {p["name"].lower().replace("_", "-") for p in json.loads(out.stdout)}
    assert "aenv-cli" in names and names <= DEPENDENCIES, names - DEPENDENCIES
    probe = "import importlib.util as u; print([m for m in ('django', 'rest_framework', 'google.protobuf', 'sandboxes')" \
            " if u.find_spec(m.split('.')[0])])"
    out = subprocess.run([str(installed / "bin" / "python"), "-c", probe], capture_output=True, text=True,
                         cwd="/", check=True)
    assert out.stdout.strip() == "[]"


def test_the_installed_aenv_runs(installed, tmp_path):
    aenv = str(installed / "bin" / "aenv")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "cfg")}

    def run(*argv):
        return subprocess.run([aenv, *argv], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60)

    out = run("--help")
    assert out.returncode == 0 and out.stdout.startswith("usage: aenv") and "connect" in out.stdout
    assert run("--version").stdout == f"aenv {__version__}\n"
    assert "complete" in run("completion", "bash").stdout
    out = run("--api-url", "http://127.0.0.1:9", "--api-key", "k", "ls")
    assert out.returncode == 6 and "cannot reach the server at http://127.0.0.1:9" in out.stderr
    out = run("auth", "--url", "http://127.0.0.1:9", "--api-key", "k", "--no-verify")
    assert out.returncode == 0 and (tmp_path / "cfg" / "aenv" / "credentials").is_file()
    out = run("ls")  # from the file now
    assert out.returncode == 6 and "127.0.0.1:9" in out.stderr


def test_the_package_version_is_the_clis(installed):
    out = subprocess.run([str(installed / "bin" / "python"), "-m", "pip", "show", "aenv-cli"], capture_output=True,
                         text=True, check=True)
    assert f"Version: {__version__}" in out.stdout
