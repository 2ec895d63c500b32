"""What the chaos bench breaks that a test stack normally shares with the machine, made private:
a Redis of its own on its own port (the machine's 127.0.0.1:6379 serves other stacks), a
PostgreSQL cluster of its own (initdb in a temporary directory: the machine's is never
restarted), a small loop-mounted filesystem for the node's AENV_HOME and a small tmpfs for its
guest RAM (AENV_SHM_DIR), both filled on purpose without touching the host's disk or /dev/shm.

Each has ``env()`` (what a stack's processes need to use it), a fault (``kill9`` / ``restart``
/ ``fill``) and ``close()``; all need root (mounts, running postgres as its own user)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

from harness.polling import until
from harness.stack import free_port


class PrivateRedis:
    """redis-server on a free port with its data (an append-only file, as a deployment keeps
    its broker) under ``root``; ``kill9`` and ``start`` again on the same port."""

    def __init__(self, root: Path):
        self.dir = Path(root) / "redis"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    def start(self) -> "PrivateRedis":
        log = open(self.dir / "redis.log", "ab")
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--save", "", "--appendonly", "yes", "--appendfsync", "everysec", "--protected-mode", "no"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        until(self._pong, "the private redis to answer", 30)
        return self

    def _pong(self) -> bool:
        out = subprocess.run(["redis-cli", "-p", str(self.port), "ping"], capture_output=True, text=True)
        return out.stdout.strip() == "PONG"

    def url(self, db: int) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def env(self) -> dict:
        return {"CELERY_BROKER_URL": self.url(0), "CELERY_RESULT_BACKEND": self.url(1),
                "AENV_CHANNEL_LAYER_URL": self.url(2)}

    def kill9(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def close(self) -> None:
        self.kill9()


class PrivatePostgres:
    """A PostgreSQL cluster of its own: initdb under ``root`` (owned by the ``postgres`` user:
    the server refuses to run as root), listening on 127.0.0.1 on a free port, trust auth for
    local connections only. ``restart`` stops it as a crash would (``-m immediate``: no
    checkpoint, the next start replays the WAL) and starts it again."""

    USER = "postgres"

    def __init__(self, root: Path):
        self.dir = Path(root) / "pg"
        self.data = self.dir / "data"
        self.port = free_port()

    def _as_pg(self, *argv: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(["runuser", "-u", self.USER, "--", *argv], capture_output=True, text=True,
                              check=check, timeout=timeout, cwd="/")

    def start(self) -> "PrivatePostgres":
        if not self.data.exists():
            self.dir.mkdir(parents=True, exist_ok=True)
            shutil.chown(self.dir, self.USER, self.USER)
            self._as_pg("initdb", "-D", str(self.data), "-U", self.USER, "--auth=trust", "-E", "UTF8")
        self._as_pg("pg_ctl", "-D", str(self.data), "-l", str(self.dir / "pg.log"), "-w", "-t", "60", "-o",
                    f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c max_connections=300", "start")
        until(lambda: self._as_pg("pg_isready", "-h", "127.0.0.1", "-p", str(self.port), check=False).returncode == 0,
              "the private postgres to accept connections", 60)
        self._as_pg("psql", "-h", "127.0.0.1", "-p", str(self.port), "-c", "CREATE DATABASE aenv", check=False)
        return self

    def url(self) -> str:
        return f"postgres://{self.USER}@127.0.0.1:{self.port}/aenv"

    def env(self) -> dict:
        return {"DATABASE_URL": self.url()}

    def stop(self, mode: str = "immediate") -> None:
        self._as_pg("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop", check=False)

    def restart(self) -> None:
        """A crash and a start: what a restarted database server does to the clients' connections."""
        self.stop("immediate")
        self.start()

    def close(self) -> None:
        self.stop("immediate")


def _mounted(path: Path) -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(len(line.split()) > 4 and line.split()[4] == str(path) for line in f)


class _Fillable:
    """A mounted filesystem of this run's that ``fill`` takes (nearly) all the free space of
    with one file, and ``unfill`` gives back."""

    mnt: Path

    @property
    def filler(self) -> Path:
        return self.mnt / ".chaos-filler"

    def free_mib(self) -> int:
        return shutil.disk_usage(self.mnt).free >> 20

    def fill(self, leave_mib: int = 0) -> int:
        """Takes all but ``leave_mib`` of the free space (fallocate, then plain writes for
        what a tmpfs's fallocate leaves); returns the MiB taken."""
        taken = max(0, self.free_mib() - leave_mib)
        subprocess.run(["fallocate", "-l", f"{taken}M", str(self.filler)], check=False, capture_output=True)
        if leave_mib == 0:  # the last blocks fallocate could not reserve
            subprocess.run(["dd", "if=/dev/zero", f"of={self.filler}", "bs=1M", "oflag=append", "conv=notrunc"],
                           check=False, capture_output=True)
        return taken

    def unfill(self) -> None:
        self.filler.unlink(missing_ok=True)


class LoopFs(_Fillable):
    """A sparse ext4 image of ``size_mib`` loop-mounted at ``mnt``: a node home whose disk a
    fault may fill without filling the machine's."""

    def __init__(self, image: Path, mnt: Path, size_mib: int):
        self.image, self.mnt, self.size_mib = Path(image), Path(mnt), size_mib

    def mount(self) -> "LoopFs":
        self.mnt.mkdir(parents=True, exist_ok=True)
        subprocess.run(["truncate", "-s", f"{self.size_mib}M", str(self.image)], check=True)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(self.image)], check=True)
        subprocess.run(["mount", "-o", "loop", str(self.image), str(self.mnt)], check=True)
        return self

    def close(self) -> None:
        if _mounted(self.mnt):
            subprocess.run(["umount", "-l", str(self.mnt)], check=False)
        self.image.unlink(missing_ok=True)


class PrivateTmpfs(_Fillable):
    """A tmpfs of ``size_mib`` at ``mnt``: the node's AENV_SHM_DIR, filled instead of /dev/shm."""

    def __init__(self, mnt: Path, size_mib: int):
        self.mnt, self.size_mib = Path(mnt), size_mib

    def mount(self) -> "PrivateTmpfs":
        self.mnt.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size_mib}M,mode=1777", "chaos-shm",
                        str(self.mnt)], check=True)
        return self

    def close(self) -> None:
        if _mounted(self.mnt):
            subprocess.run(["umount", "-l", str(self.mnt)], check=False)
