"""The warm worker bench/rl.py starts inside a sandbox (uploaded as a file; stdlib only, so
it also runs on the host in the unit tests).

It imports the installed packages (``--import``) and the cloned environment repo
(``--repo``, package ``rlenv``) once, then serves rollout tasks without ever starting
Python again: tasks arrive as JSON lines on the FIFO ``<root>/in``; each answer goes to the
FIFO ``<root>/out-<task id>`` the client made before sending (``client_command``). The
worker blocks on the FIFO, so an idle worker costs no CPU, and a fork child inherits it
mid-read: the child's first task is served by the parent's process, already warm.

    python3 rl_guest.py --root /tmp/rl --repo /home/user/rlenv --import pytest
"""
from __future__ import annotations

import argparse
import errno
import importlib
import json
import os
import re
import shlex
import subprocess
import sys
import time

TASK_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
REPLY_WAIT_S = 10.0  # how long an answer waits for its client to open the reply FIFO


def client_command(root: str, task: dict) -> str:
    """The shell command that gives ``task`` to the warm worker under ``root`` and prints its
    JSON answer: a reply FIFO of its own, the task line into the worker's FIFO, then the
    answer (no Python started, no polling)."""
    task_id = str(task["id"])
    if not TASK_ID.match(task_id):
        raise ValueError(f"bad task id {task_id!r}")
    line = json.dumps(task, separators=(",", ":"))
    out = f"{root}/out-{task_id}"
    return (f"o={shlex.quote(out)}; rm -f \"$o\"; mkfifo \"$o\" && printf '%s\\n' {shlex.quote(line)} "
            f"> {shlex.quote(root + '/in')} && cat \"$o\"; rc=$?; rm -f \"$o\"; exit $rc")


def load(repo: str, imports: list[str]) -> dict:
    """Imports what a rollout needs (the warm part); what was loaded and from where."""
    t0 = time.perf_counter()
    sys.path.insert(0, repo)
    versions = {}
    for name in imports:
        mod = importlib.import_module(name)
        versions[name] = getattr(mod, "__version__", None) or _dist_version(name)
    env = importlib.import_module("rlenv")
    commit = ""
    try:
        commit = subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return {"env": env, "versions": versions, "commit": commit, "pid": os.getpid(), "started": time.time(),
            "load_ms": round((time.perf_counter() - t0) * 1e3, 1)}


def _dist_version(name: str) -> str:
    try:
        from importlib.metadata import version  # noqa: PLC0415

        return version(name)
    except Exception:  # noqa: BLE001 - a version is informative only
        return ""


def handle(line: str, state: dict) -> dict:
    """One task line → its answer (an ``error`` key instead of raising)."""
    t0 = time.perf_counter()
    try:
        task = json.loads(line)
        task_id = str(task["id"])
        if not TASK_ID.match(task_id):
            raise ValueError(f"bad task id {task_id!r}")
    except (ValueError, KeyError, TypeError) as exc:
        return {"id": None, "error": f"bad task: {exc}"}
    answer = {"id": task_id, "worker_pid": state["pid"], "worker_started": state["started"],
              "versions": state["versions"], "commit": state["commit"]}
    try:
        answer.update(state["env"].rollout(int(task["seed"]), int(task.get("steps", 1000))))
    except Exception as exc:  # noqa: BLE001 - reported to the client
        answer["error"] = f"{type(exc).__name__}: {exc}"
    answer["task_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
    return answer


def reply(root: str, answer: dict, wait_s: float = REPLY_WAIT_S) -> bool:
    """Writes the answer into its client's FIFO; False if no client is there to read it."""
    if not answer.get("id"):
        return False
    path = os.path.join(root, f"out-{answer['id']}")
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError as exc:
            if exc.errno == errno.ENOENT or time.monotonic() > deadline:
                return False
            if exc.errno != errno.ENXIO:  # ENXIO: the client has not opened it for reading yet
                raise
            time.sleep(0.005)
    try:
        os.set_blocking(fd, True)
        data = (json.dumps(answer) + "\n").encode()
        while data:
            data = data[os.write(fd, data):]
    except BrokenPipeError:
        return False
    finally:
        os.close(fd)
    return True


def serve(root: str, state: dict, max_tasks: int | None = None) -> int:
    """Answers tasks from ``<root>/in`` until ``max_tasks`` (forever if None); writes
    ``<root>/ready`` (the load's facts, JSON) once it is listening."""
    os.makedirs(root, exist_ok=True)
    fifo = os.path.join(root, "in")
    if not os.path.exists(fifo):
        os.mkfifo(fifo)
    fd = os.open(fifo, os.O_RDWR)  # a writer of its own: never EOF between clients
    ready = {k: state[k] for k in ("pid", "started", "versions", "commit", "load_ms")}
    tmp = os.path.join(root, "ready.tmp")
    with open(tmp, "w") as f:
        json.dump(ready, f)
    os.replace(tmp, os.path.join(root, "ready"))
    served = 0
    with os.fdopen(fd, "r", buffering=1) as stream:
        while max_tasks is None or served < max_tasks:
            line = stream.readline()
            if not line.strip():
                continue
            reply(root, handle(line, state))
            served += 1
    return served


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="warm rollout worker")
    parser.add_argument("--root", required=True)
    parser.add_argument("--repo", required=True)
    parser.add_argument("--import", dest="imports", action="append", default=[])
    parser.add_argument("--max-tasks", type=int)
    args = parser.parse_args(argv)
    serve(args.root, load(args.repo, args.imports), args.max_tasks)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
