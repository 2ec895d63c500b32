"""Docker's daemon, running on this host, for the tests that need one.

Why: some tests check aenv next to a real Docker (a node on a host whose firewall Docker
rewrites; the compose deployment). ``ensure_dockerd()`` makes sure a daemon answers
``docker info``: it returns at once if one does, else starts one (systemd's unit where
systemd runs, else ``dockerd`` detached, logging to ``/tmp/aenv-dockerd.log``) and waits.
Several test processes may call it at once: a file lock lets one of them start it. The
daemon is left running (starting it is the slow part; every caller wants it up).
"""
from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import time
from pathlib import Path

LOCK = Path("/tmp/aenv-dockerd.lock")
LOG = Path("/tmp/aenv-dockerd.log")


class DockerUnavailable(Exception):
    """No Docker daemon here and none could be started (the message says why)."""


def _answers() -> bool:
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _start() -> subprocess.Popen | None:
    """Starts the daemon: the process started, or None if systemd runs it."""
    if Path("/run/systemd/system").is_dir() and shutil.which("systemctl"):
        if subprocess.run(["systemctl", "start", "docker"], capture_output=True, timeout=120).returncode == 0:
            return None
    with open(LOG, "ab") as log:
        return subprocess.Popen(["dockerd"], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                start_new_session=True)


def ensure_dockerd(timeout: float = 90.0) -> None:
    """A Docker daemon answers ``docker info`` when this returns; DockerUnavailable if there
    is no ``dockerd``/``docker`` (``apt-get install docker.io``), this is not root, or the
    daemon did not answer within ``timeout`` seconds."""
    if _answers():
        return
    missing = [tool for tool in ("dockerd", "docker") if shutil.which(tool) is None]
    if missing:
        raise DockerUnavailable(f"{' and '.join(missing)} not installed (apt-get install docker.io)")
    if os.geteuid() != 0:
        raise DockerUnavailable("starting dockerd needs root")
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _answers():
            return
        daemon = _start()
        deadline = time.monotonic() + timeout
        while not _answers():
            if daemon is not None and daemon.poll() is not None:
                raise DockerUnavailable(f"dockerd exited with {daemon.returncode} (see {LOG})")
            if time.monotonic() > deadline:
                raise DockerUnavailable(f"dockerd did not answer 'docker info' within {timeout:.0f} s (see {LOG})")
            time.sleep(0.5)
