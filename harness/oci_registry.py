"""A local OCI registry for tests and manual runs: Debian's ``docker-registry`` on 127.0.0.1.

Why: the tests pull images the way a node pulls from Docker Hub or a private registry, but this
machine has no internet. A real registry (the CNCF distribution server packaged by Debian) speaks
the same Registry HTTP API v2, token-less basic auth included, so ``skopeo`` and the puller in
``vmm.oci`` run exactly the code paths they run against a remote registry.

Each registry lives in a directory of its own (storage, config, htpasswd, log, state):
``start()`` is idempotent (a registry already answering from that directory is returned as is),
``stop()`` ends it by its recorded pid. The default directory is under the ignored ``var/``.

    python -m harness.oci_registry start [--dir DIR] [--auth USER:PASSWORD]
    python -m harness.oci_registry status|stop [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from harness.ports import free_port as _free_port

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DIR = REPO / "var" / "oci-registry" / "default"
BINARY = "docker-registry"


class RegistryError(Exception):
    """The registry could not be started (binary missing, did not answer, ...)."""


@dataclass(frozen=True)
class Registry:
    """A running registry: where it answers and, if it requires them, its credentials."""

    root: Path
    port: int
    pid: int
    username: str | None = None
    password: str | None = None

    @property
    def host(self) -> str:
        """host:port, as it appears in image references (``127.0.0.1:5000/repo:tag``)."""
        return f"127.0.0.1:{self.port}"

    @property
    def credentials(self) -> tuple[str, str] | None:
        return (self.username, self.password) if self.username else None

    def ref(self, repository: str, tag: str = "latest") -> str:
        return f"{self.host}/{repository}:{tag}"


def available() -> str | None:
    """None if a registry can be started here, else why not (a skip reason for tests)."""
    for tool in (BINARY, "htpasswd"):
        if shutil.which(tool) is None:
            return f"{tool} not installed (scripts/setup.sh installs docker-registry and apache2-utils)"
    return None


def _answers(port: int, timeout: float = 1.0) -> bool:
    """The API base answers: 200 without auth, 401 with it; anything else is not a registry."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=timeout) as r:
            return r.status == 200
    except urllib.error.HTTPError as e:
        return e.code == 401
    except OSError:
        return False


def _alive(pid: int, marker: str) -> bool:
    """pid runs and is the registry of this directory (pids are reused)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return marker in cmdline


def _state_file(root: Path) -> Path:
    return root / "registry.json"


def status(root: Path = DEFAULT_DIR) -> Registry | None:
    """The registry running from `root`, or None."""
    root = Path(root).absolute()
    try:
        state = json.loads(_state_file(root).read_text())
    except (OSError, ValueError):
        return None
    if not _alive(state["pid"], str(root / "config.yml")) or not _answers(state["port"]):
        return None
    return Registry(root=root, port=state["port"], pid=state["pid"], username=state.get("username"),
                    password=state.get("password"))


def _htpasswd(path: Path, username: str, password: str) -> None:
    """The registry only accepts bcrypt entries."""
    proc = subprocess.run(["htpasswd", "-B", "-i", "-n", username], input=password, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RegistryError(f"htpasswd failed: {proc.stderr.strip()}")
    path.write_text(proc.stdout.strip() + "\n")
    path.chmod(0o600)


def start(root: Path = DEFAULT_DIR, auth: tuple[str, str] | None = None, timeout: float = 20.0) -> Registry:
    """Starts a registry storing under `root` on 127.0.0.1:<free port> (idempotent: the one
    already running from `root` is returned, whatever `auth` says). With `auth`, every request
    needs HTTP basic auth with that user and password (htpasswd)."""
    reason = available()
    if reason:
        raise RegistryError(reason)
    root = Path(root).absolute()
    running = status(root)
    if running is not None:
        return running
    root.mkdir(parents=True, exist_ok=True)
    (root / "data").mkdir(exist_ok=True)
    config_path = root / "config.yml"
    for attempt in range(3):  # another process may take the free port before the registry binds it
        port = _free_port()
        config = {
            "version": 0.1,
            "log": {"level": "warn", "accesslog": {"disabled": True}},
            "storage": {"filesystem": {"rootdirectory": str(root / "data")}, "delete": {"enabled": True}},
            "http": {"addr": f"127.0.0.1:{port}", "secret": secrets.token_hex(16)},
        }
        if auth:
            _htpasswd(root / "htpasswd", *auth)
            config["auth"] = {"htpasswd": {"realm": "aenv-test-registry", "path": str(root / "htpasswd")}}
        config_path.write_text(json.dumps(config, indent=2))  # YAML is a superset of JSON
        with open(root / "registry.log", "ab") as log:
            proc = subprocess.Popen([BINARY, "serve", str(config_path)], stdout=log, stderr=log,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None and not _answers(port, 0.5):
            time.sleep(0.05)
        if proc.poll() is None and _answers(port):
            state = {"pid": proc.pid, "port": port, "username": auth[0] if auth else None,
                     "password": auth[1] if auth else None}
            _state_file(root).write_text(json.dumps(state))
            _state_file(root).chmod(0o600)
            return Registry(root=root, port=port, pid=proc.pid, username=state["username"],
                            password=state["password"])
        if proc.poll() is None:
            _terminate(proc.pid, str(config_path))
        proc.wait()
    tail = (root / "registry.log").read_text(errors="replace")[-1500:]
    raise RegistryError(f"docker-registry did not answer on 127.0.0.1 after {timeout:.0f}s; log:\n{tail}")


def _terminate(pid: int, marker: str, timeout: float = 10.0) -> None:
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        if not _alive(pid, marker):
            return
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and _alive(pid, marker):
            try:  # our own child: reap it, else it stays a zombie (and "alive")
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    return
            except ChildProcessError:
                pass
            time.sleep(0.05)


def stop(root: Path = DEFAULT_DIR) -> bool:
    """Stops the registry of `root` (by its recorded pid); True if one was running."""
    root = Path(root).absolute()
    try:
        state = json.loads(_state_file(root).read_text())
    except (OSError, ValueError):
        return False
    was = _alive(state["pid"], str(root / "config.yml"))
    _terminate(state["pid"], str(root / "config.yml"))
    _state_file(root).unlink(missing_ok=True)
    return was


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.oci_registry", description=__doc__.splitlines()[0])
    parser.add_argument("cmd", choices=["start", "stop", "status"])
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--auth", help="USER:PASSWORD (start only)")
    args = parser.parse_args(argv)
    if args.cmd == "start":
        auth = tuple(args.auth.split(":", 1)) if args.auth else None
        reg = start(args.dir, auth=auth)
        print(json.dumps({"host": reg.host, "pid": reg.pid, "dir": str(reg.root), "auth": bool(auth)}))
        return 0
    if args.cmd == "stop":
        print("stopped" if stop(args.dir) else "not running")
        return 0
    reg = status(args.dir)
    print(json.dumps({"host": reg.host, "pid": reg.pid} if reg else None))
    return 0 if reg else 1


if __name__ == "__main__":
    sys.exit(main())
