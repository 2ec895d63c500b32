"""The chunkfs daemon's control-socket client (what the node agent uses), and
``ensure_daemon``: start the node's daemon if its socket does not answer."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from .errors import ChunkError


class ChunkfsError(ChunkError):
    """The daemon refused a request (``code``: bad_request, exists, not_found, ...) or could not be reached."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class ChunkfsClient:
    def __init__(self, control_path: str | Path, timeout: float = 30.0):
        self.control_path = str(control_path)
        self.timeout = timeout

    def request(self, payload: dict) -> dict:
        """One request on a fresh connection; the reply without ``ok``, or ``ChunkfsError``."""
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(self.timeout)
                sock.connect(self.control_path)
                sock.sendall(json.dumps(payload, separators=(",", ":")).encode() + b"\n")
                buf = bytearray()
                while not buf.endswith(b"\n"):
                    data = sock.recv(1 << 16)
                    if not data:
                        break
                    buf += data
        except OSError as exc:
            raise ChunkfsError("unreachable", f"chunkfs control socket {self.control_path}: {exc}") from exc
        try:
            reply = json.loads(buf)
        except ValueError:
            raise ChunkfsError("bad_reply", f"chunkfs answered {bytes(buf[:200])!r}") from None
        if not reply.get("ok"):
            error = reply.get("error") or {}
            raise ChunkfsError(str(error.get("code", "error")), str(error.get("message", "")))
        reply.pop("ok")
        return reply

    def ping(self) -> dict:
        return self.request({"op": "ping"})

    def mount(self, mount_id: str, chunk_size: int, files: dict, *, prefetch: list | None = None,
              record: bool = False, writable: bool = False, local: dict | None = None,
              pieces: list | None = None, store_wait: float = 0.0) -> Path:
        """Mounts ``files`` ({name: {size, chunks}}, as in a snapshot manifest); returns the
        directory that holds them. ``local``: {sha: [path, offset]} of chunks this node's own
        files hold, read from there (verified) before the store. ``pieces``: the prefetch
        list's pieces (``chunkfs.pieces``). ``store_wait`` (s): a chunk that no source has is
        asked for again until then (a capture handed over while it still uploads)."""
        payload = {"op": "mount", "mount_id": mount_id, "chunk_size": chunk_size, "files": files,
                   "prefetch": prefetch or [], "record": record, "writable": writable}
        if local:
            payload["local"] = local
        if pieces:
            payload["pieces"] = pieces
        if store_wait:
            payload["store_wait"] = float(store_wait)
        reply = self.request(payload)
        return Path(reply["path"])

    def pin(self, mount_id: str, timeout: float = 600.0) -> dict:
        """Fetches every chunk of the mount and pins them until its unmount (waits up to ``timeout``)."""
        return ChunkfsClient(self.control_path, timeout=timeout).request({"op": "pin", "mount_id": mount_id})

    def copy_out(self, mount_id: str, name: str, dest: str | Path, timeout: float = 600.0) -> dict:
        """Has the daemon write the mounted file ``name`` into ``dest`` (an existing file of its
        size); returns ``{"written", "ms"}``. Errors: ``ChunkfsError`` (``unavailable``: a chunk
        could not be had)."""
        return ChunkfsClient(self.control_path, timeout=timeout).request(
            {"op": "copy_out", "mount_id": mount_id, "name": name, "dest": str(dest)})

    def unmount(self, mount_id: str) -> dict:
        """Returns the mount's last stats (reads, bytes fetched, recorded order)."""
        return self.request({"op": "unmount", "mount_id": mount_id})["stats"]

    def list(self) -> list[dict]:
        return self.request({"op": "list"})["mounts"]

    def stats(self, mount_id: str | None = None) -> dict:
        payload = {"op": "stats"}
        if mount_id is not None:
            payload["mount_id"] = mount_id
        return self.request(payload)


def ensure_daemon(control_path: str | Path, *, mountpoint: str | Path, cache_dir: str | Path,
                  limit_mb: int | None = None, log_path: str | Path, dir_source: str | Path | None = None,
                  extra_args: list[str] | None = None, env: dict | None = None, timeout: float = 30.0,
                  python: str | None = None) -> ChunkfsClient:
    """A client of the node's daemon: the running one, or one started now, detached (its
    own session, so it outlives the caller; output appended to ``log_path``). Waits until
    it answers, at most ``timeout`` seconds; raises ``ChunkfsError`` (with the log's tail)
    if it does not."""
    client = ChunkfsClient(control_path, timeout=5.0)
    try:
        client.ping()
        return client
    except ChunkfsError:
        pass
    cmd = [python or sys.executable, "-m", "chunkfs", "serve", "--mountpoint", str(mountpoint),
           "--cache", str(cache_dir), "--control", str(control_path)]
    if limit_mb is not None:
        cmd += ["--limit-mb", str(int(limit_mb))]
    if dir_source is not None:
        cmd += ["--dir-source", str(dir_source)]
    cmd += list(extra_args or [])
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    root = str(Path(__file__).resolve().parents[1])  # the checkout, so -m chunkfs imports this package
    run_env = dict(os.environ if env is None else env)
    run_env["PYTHONPATH"] = root + (os.pathsep + run_env["PYTHONPATH"] if run_env.get("PYTHONPATH") else "")
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                                env=run_env, close_fds=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            client.ping()
            return client
        except ChunkfsError:
            pass
        code = proc.poll()
        if code is not None and code != 3:  # 3: another daemon holds the pidfile (it may still be starting)
            break
        time.sleep(0.05)
    tail = log_path.read_bytes()[-2000:].decode(errors="replace")
    raise ChunkfsError("not_started", f"the chunkfs daemon did not answer on {control_path} within {timeout:g} s "
                                      f"(exit {proc.poll()}); log {log_path}:\n{tail}")
