"""The cluster's long-running processes, tracked by pid files so that ``up``, ``status``
and ``down`` may run from different shells (or a test) and still find them.

Each process is its own session (its process group is its pid), logs to
``<state>/logs/<name>.log`` and is named in ``<state>/run/<name>.pid`` by its pid and its
start time, so a recycled pid is never mistaken for it. A node worker runs in its node's
network namespace through ``nsenter`` (which execs it: the pid is the worker's).
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from cluster.hostnet import in_netns
from cluster.layout import ROOT


@dataclass(frozen=True)
class Spec:
    name: str
    argv: tuple[str, ...]
    env: dict
    netns: str | None = None


def qemu_pids(*needles: str) -> list[int]:
    """The QEMU processes whose command line holds every one of ``needles`` (a node home, a
    sandbox id): found in /proc, since daemonized VMs are in no process group of ours."""
    found = []
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            cmdline = (pid_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "qemu-system" in cmdline and all(n in cmdline for n in needles):
            found.append(int(pid_dir.name))
    return found


def _start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot), None if it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] == "Z":
        try:
            os.waitpid(pid, os.WNOHANG)  # ours (a test started it): reap it
        except ChildProcessError:
            pass
        return None
    return fields[19]


class Processes:
    def __init__(self, state_dir: Path):
        self.run_dir, self.logs_dir = state_dir / "run", state_dir / "logs"
        self._children: dict[str, subprocess.Popen] = {}

    def _pidfile(self, name: str) -> Path:
        return self.run_dir / f"{name}.pid"

    def pid(self, name: str) -> int | None:
        """The pid of ``name`` if it runs, else None."""
        try:
            pid, started = self._pidfile(name).read_text().split()
        except (OSError, ValueError):
            return None
        return int(pid) if _start_time(int(pid)) == started else None

    def log_path(self, name: str) -> Path:
        return self.logs_dir / f"{name}.log"

    def start(self, spec: Spec) -> int:
        """Starts ``spec`` unless it runs; its pid either way."""
        running = self.pid(spec.name)
        if running is not None:
            return running
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        argv = in_netns(spec.netns, *spec.argv) if spec.netns else list(spec.argv)
        with open(self.log_path(spec.name), "ab") as log:
            proc = subprocess.Popen(argv, cwd=ROOT, env=spec.env, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        started = None
        for _ in range(100):  # /proc/<pid>/stat exists as soon as fork returns; be safe anyway
            started = _start_time(proc.pid)
            if started is not None or proc.poll() is not None:
                break
            time.sleep(0.01)
        self._pidfile(spec.name).write_text(f"{proc.pid} {started}\n")
        self._children[spec.name] = proc  # kept while this process lives (tracked by the pid file)
        return proc.pid

    def stop(self, names: list[str], timeout: float, progress=print) -> None:
        """SIGTERM to each process group, then SIGKILL after ``timeout`` s; all at once."""
        pids = {n: self.pid(n) for n in names}
        for name, pid in pids.items():
            if pid is not None:
                os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while any(self.pid(n) is not None for n in names) and time.monotonic() < deadline:
            time.sleep(0.2)
        for name, pid in pids.items():
            if self.pid(name) is not None:
                progress(f"{name} did not stop within {timeout:.0f} s: killing it")
                os.killpg(pid, signal.SIGKILL)
                for _ in range(50):
                    if self.pid(name) is None:
                        break
                    time.sleep(0.1)
            self._pidfile(name).unlink(missing_ok=True)
