"""Starts the data plane as deployed: uvicorn serving ``config.dataplane_asgi`` on the
public address and, where HAProxy is installed, the hot path beside it.

    python -m dataplane.serve --host 0.0.0.0 --port 3001 [--hotpath auto|on|off] [-- uvicorn options]

Why a launcher: the hot path needs the two processes wired together before either starts — a
socketpair whose ends they inherit (the data plane passes keep-alive connections over it:
``dataplane.handoff``; HAProxy accepts them: ``bind sockpair@``), HAProxy's configuration
(``dataplane.hotpath_config``) and its admin socket, which the data plane's steering uses
(``dataplane.steer``). Clients only ever connect to uvicorn; HAProxy listens on no port.
The two live and die together: when either exits, the other is stopped and the launcher
exits with the first one's status (systemd, Compose, Kubernetes restart the pair).

``--hotpath`` (default ``AENV_DATAPLANE_HOTPATH``, else ``auto``): ``auto`` uses HAProxy when
``haproxy`` is on PATH; ``on`` refuses to start without it; ``off`` runs uvicorn alone (the
data plane then serves every request itself, as before the hot path).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dataplane.handoff import ENV_ADMIN, ENV_FD, ENV_MAPS
from dataplane.hotpath_config import PORTS_MAP, TOKENS_MAP, render

APP = "config.dataplane_asgi:application"
MODES = ("auto", "on", "off")


def uvicorn_argv(host: str, port: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "uvicorn", APP, "--host", host, "--port", str(port), *extra]


def local_address(host: str) -> str:
    """Where HAProxy reaches uvicorn bound to ``host``."""
    return "127.0.0.1" if host in ("", "0.0.0.0", "localhost") else ("::1" if host == "::" else host)


def max_connections(wanted: int = 20000) -> int:
    """HAProxy's maxconn within this process's descriptor limit (two per relayed
    connection, a third as slack)."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return wanted if hard == resource.RLIM_INFINITY else max(64, min(wanted, (hard - 200) // 3))


# A Unix socket's path has room for ~100 bytes (HAProxy: 97).
SOCKET_PATH_MAX = 90


def run_dir(port: int) -> Path:
    """A private directory for HAProxy's configuration, maps and admin socket: under
    ``AENV_HOME``, or in the temporary directory when that path is too long for the socket,
    with ``AENV_HOME/dataplane-hotpath-<port>`` linking to it (operators and tests find it
    there)."""
    home = Path(os.environ.get("AENV_HOME") or tempfile.gettempdir())
    base = home if home.is_dir() and len(str(home)) + 40 < SOCKET_PATH_MAX else None
    if base is not None:
        remove_stale(base)
    path = Path(tempfile.mkdtemp(prefix="dataplane-hotpath-" if base else "aenv-hotpath-", dir=base))
    path.chmod(0o700)
    link = home / f"dataplane-hotpath-{port}"
    if base is None and home.is_dir():
        link.unlink(missing_ok=True)
        link.symlink_to(path)
    return path


def remove_stale(base: Path, grace: float = 60.0) -> None:
    """Run directories of launchers that died without cleaning up (SIGKILL): no HAProxy answers
    on their admin socket and they are older than ``grace`` s (a starting one has no socket yet)."""
    for path in base.glob("dataplane-hotpath-*"):
        if path.is_symlink() or not path.is_dir() or time.time() - path.stat().st_mtime < grace:
            continue
        with socket.socket(socket.AF_UNIX) as probe:
            try:
                probe.connect(str(path / "admin.sock"))
                continue  # alive
            except OSError:
                pass
        shutil.rmtree(path, ignore_errors=True)


def start_hotpath(args, extra: list[str], haproxy: str) -> tuple[list[subprocess.Popen], Path]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    where = run_dir(args.port)
    admin = where / "admin.sock"
    for name in (PORTS_MAP, TOKENS_MAP):
        (where / name).write_text("")
    cfg = where / "haproxy.cfg"
    cfg.write_text(render(handoff_fd=theirs.fileno(), admin_socket=str(admin), maps_dir=str(where),
                          dataplane=(local_address(args.host), args.port), nbthread=args.haproxy_threads,
                          maxconn=max_connections()))
    proxy = subprocess.Popen([haproxy, "-f", str(cfg), "-db"], pass_fds=(theirs.fileno(),), preexec_fn=_die_with_parent)
    theirs.close()
    deadline = time.monotonic() + 20
    while not admin.exists():
        if proxy.poll() is not None or time.monotonic() > deadline:
            proxy.kill()
            raise SystemExit(f"dataplane.serve: haproxy did not start (exit {proxy.poll()})")
        time.sleep(0.05)
    env = {**os.environ, ENV_FD: str(ours.fileno()), ENV_ADMIN: str(admin), ENV_MAPS: str(where)}
    app = subprocess.Popen(uvicorn_argv(args.host, args.port, extra), env=env, pass_fds=(ours.fileno(),),
                           preexec_fn=_die_with_parent)
    ours.close()
    return [app, proxy], where


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the launcher dies, even by SIGKILL (no orphan
    HAProxy or uvicorn holding the port)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def supervise(procs: list[subprocess.Popen]) -> int:
    """Waits for the first of ``procs`` to exit, stops the others, returns its status."""
    def stop(signum, _frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while all(p.poll() is None for p in procs):
        time.sleep(0.2)
    first = next(p for p in procs if p.poll() is not None)
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return first.returncode or 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=3001)
    parser.add_argument("--hotpath", choices=MODES, default=os.environ.get("AENV_DATAPLANE_HOTPATH") or "auto")
    parser.add_argument("--haproxy-threads", type=int, default=1, help="HAProxy's nbthread (default 1)")
    args = parser.parse_args(argv)
    if args.hotpath not in MODES:
        parser.error(f"AENV_DATAPLANE_HOTPATH must be one of {', '.join(MODES)}, not {args.hotpath!r}")
    haproxy = shutil.which("haproxy")
    if args.hotpath == "on" and haproxy is None:
        raise SystemExit("dataplane.serve: --hotpath on, but haproxy is not installed")
    if args.hotpath == "off" or haproxy is None or "--workers" in extra or "--uds" in extra:
        os.execv(sys.executable, uvicorn_argv(args.host, args.port, extra))
    procs, where = start_hotpath(args, extra, haproxy)
    try:
        return supervise(procs)
    finally:
        shutil.rmtree(where, ignore_errors=True)
        link = Path(os.environ.get("AENV_HOME") or tempfile.gettempdir()) / f"dataplane-hotpath-{args.port}"
        if link.is_symlink():
            link.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
