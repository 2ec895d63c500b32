"""What each envd call sends, without any I/O.

Why a module of its own: the sync and the async client differ only in how bytes move
(``httpx.Client`` vs ``httpx.AsyncClient``). Request construction (paths, headers, JSON
bodies, the ``/init`` body the node sends) and the calls' timeouts live here once, and
how each answer is read (stream decoding, result types) in ``answers``, so the two
clients stay thin mirrors of each other and cannot drift apart.
"""
from __future__ import annotations

import base64
import dataclasses
import os
import ssl
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import lru_cache

from envd.wire import STREAM_CONTENT_TYPE, UNARY_CONTENT_TYPE, encode_json, envelope

from . import limits

# envd sends a keepalive event after this much silence (seconds) on our streams...
KEEPALIVE_INTERVAL = 10
# ...so a stream silent for longer than this is dead (VM frozen, network gone).
STREAM_IDLE_TIMEOUT = 3 * KEEPALIVE_INTERVAL
CONNECT_TIMEOUT = 5.0
UNARY_TIMEOUT = 10.0
HEALTH_TIMEOUT = 1.0
INIT_TIMEOUT = 10.0   # what the node allows a fresh VM's /init
METRICS_TIMEOUT = 2.0  # a sampler asks every few seconds; a guest this slow is skipped once
SYNC_TIMEOUT = 120.0  # guest sync(2) of a dirty page cache under TCG
SYNC_PATH = "/aenv/sync"
TRUST_PATH = "/aenv/trust"
TRUST_TIMEOUT = 30.0  # rewrites a few trust bundles (hundreds of KiB each) under TCG
ENTROPY_SEED_BYTES = 64

# The E2B SDK's PTY shell (spec §4.3).
SHELL = {"cmd": "/bin/bash", "args": ["-i", "-l"],
         "envs": {"TERM": "xterm-256color", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}}


@dataclass(frozen=True)
class Request:
    """One HTTP request to envd: ``expect`` lists the statuses that mean success."""

    method: str
    path: str
    headers: dict = field(default_factory=dict)
    content: bytes | None = None
    params: dict | None = None
    timeout: float | None = None  # the call's total deadline (None: the client's default)
    expect: tuple = (200,)
    max_bytes: int = limits.ANSWER_BYTES  # the most of the answer's body that is read
    total: bool = True  # False: ``timeout`` bounds each socket operation only (an upload the caller sized)


# ------------------------------------------------------------------ requests

def basic_auth(user: str) -> str:
    """envd's way of naming the user a call runs as (no password)."""
    return "Basic " + base64.b64encode(f"{user}:".encode()).decode()


def _user_headers(user: str | None) -> dict:
    return {"Authorization": basic_auth(user)} if user else {}


def unary(method: str, message: dict, *, user: str | None = None, timeout: float | None = None) -> Request:
    """A unary Connect call, e.g. ``unary("process.Process/List", {})``."""
    return Request("POST", f"/{method}", {"Content-Type": UNARY_CONTENT_TYPE, **_user_headers(user)},
                   encode_json(message), timeout=timeout)


def stream(method: str, message: dict, *, user: str | None = None, deadline: float | None = None,
           keepalive: float = KEEPALIVE_INTERVAL) -> Request:
    """A server-streaming Connect call: one request envelope. ``deadline`` (seconds)
    becomes ``connect-timeout-ms``, which envd applies to the process's lifetime."""
    headers = {"Content-Type": STREAM_CONTENT_TYPE, "Keepalive-Ping-Interval": str(int(keepalive)),
               **_user_headers(user)}
    if deadline:
        headers["Connect-Timeout-Ms"] = str(max(1, int(deadline * 1000)))
    return Request("POST", f"/{method}", headers, envelope(encode_json(message)))


def init_body(env_vars: dict | None = None, *, access_token: str | None = None, timestamp: datetime | None = None,
              default_user: str | None = None, default_workdir: str | None = None,
              entropy_seed: bytes | None = None) -> dict:
    """The body of the node's ``POST /init``: env vars, the host's clock, fresh kernel
    entropy (restored and forked guests share RNG state) and, when given, the sandbox's
    access token and a default user and workdir. The node sends no defaults: envd keeps
    ``user`` and the user's home unless the template's disk says otherwise
    (``envd.state.TEMPLATE_DEFAULTS``, written by the template builder)."""
    now = timestamp or datetime.now(timezone.utc)
    body = {
        "envVars": dict(env_vars or {}),
        "timestamp": now.astimezone(timezone.utc).isoformat().replace("+00:00", "Z"),
        "entropySeed": base64.b64encode(entropy_seed if entropy_seed is not None
                                        else os.urandom(ENTROPY_SEED_BYTES)).decode(),
    }
    if access_token is not None:
        body["accessToken"] = access_token
    if default_user:
        body["defaultUser"] = default_user
    if default_workdir:
        body["defaultWorkdir"] = default_workdir
    return body


def init(body: dict, *, timeout: float | None = INIT_TIMEOUT) -> Request:
    return Request("POST", "/init", {"Content-Type": "application/json"}, encode_json(body),
                   timeout=timeout, expect=(200, 204))


def sync(*, timeout: float | None = SYNC_TIMEOUT) -> Request:
    return Request("POST", SYNC_PATH, timeout=timeout, expect=(204,))


def trust(pem: str, *, timeout: float | None = TRUST_TIMEOUT) -> Request:
    """aenv's ``POST /aenv/trust``: the guest trusts this CA certificate (``envd.trust``)."""
    return Request("POST", TRUST_PATH, {"Content-Type": "application/json"}, encode_json({"pem": pem}),
                   timeout=timeout, max_bytes=limits.METRICS_BYTES)


def metrics(*, timeout: float | None = METRICS_TIMEOUT) -> Request:
    return Request("GET", "/metrics", timeout=timeout, max_bytes=limits.METRICS_BYTES)


def health(*, timeout: float | None = HEALTH_TIMEOUT) -> Request:
    return Request("GET", "/health", timeout=timeout, expect=(200, 204))


def process_config(cmd: str, args=(), *, envs: dict | None = None, cwd: str | None = None) -> dict:
    config = {"cmd": cmd, "args": list(args)}
    if envs:
        config["envs"] = dict(envs)
    if cwd:
        config["cwd"] = cwd
    return config


def start(config: dict, *, pty: tuple[int, int] | None = None, tag: str | None = None, stdin: bool | None = None,
          user: str | None = None, deadline: float | None = None, keepalive: float = KEEPALIVE_INTERVAL) -> Request:
    """``Process/Start`` of ``config``; ``pty`` is (cols, rows); ``keepalive``: envd's ping
    interval on a quiet stream (seconds)."""
    message: dict = {"process": config}
    if pty is not None:
        message["pty"] = {"size": {"cols": int(pty[0]), "rows": int(pty[1])}}
    if tag is not None:
        message["tag"] = tag
    if stdin is not None:
        message["stdin"] = bool(stdin)
    return stream("process.Process/Start", message, user=user, deadline=deadline, keepalive=keepalive)


def shell_config(*, envs: dict | None = None, cwd: str | None = None) -> dict:
    """The login shell of a PTY (the SDK's), with extra ``envs``."""
    return process_config(SHELL["cmd"], SHELL["args"], envs={**SHELL["envs"], **(envs or {})}, cwd=cwd)


def command_config(command: str, *, envs: dict | None = None, cwd: str | None = None) -> dict:
    """``bash -l -c <command>``, as the SDK runs every command."""
    return process_config("/bin/bash", ["-l", "-c", command], envs=envs, cwd=cwd)


def connect(pid: int) -> Request:
    return stream("process.Process/Connect", {"process": {"pid": int(pid)}})


def send_input(pid: int, data: bytes, *, pty: bool = True) -> Request:
    kind = "pty" if pty else "stdin"
    return unary("process.Process/SendInput", {"process": {"pid": int(pid)},
                                               "input": {kind: base64.b64encode(data).decode()}})


def resize(pid: int, cols: int, rows: int) -> Request:
    return unary("process.Process/Update", {"process": {"pid": int(pid)},
                                            "pty": {"size": {"cols": int(cols), "rows": int(rows)}}})


def send_signal(pid: int | None, signal: str = "SIGKILL", *, tag: str | None = None) -> Request:
    """To ``pid``, or (``pid`` None) to the process started with ``tag``."""
    name = signal if signal.startswith("SIGNAL_") else f"SIGNAL_{signal}"
    selector = {"pid": int(pid)} if pid is not None else {"tag": str(tag)}
    return unary("process.Process/SendSignal", {"process": selector, "signal": name})


def list_processes() -> Request:
    return unary("process.Process/List", {})


def close_stdin(pid: int) -> Request:
    return unary("process.Process/CloseStdin", {"process": {"pid": int(pid)}})


def stat(path: str, *, user: str | None = None) -> Request:
    return unary("filesystem.Filesystem/Stat", {"path": path}, user=user)


def list_dir(path: str, depth: int = 1, *, user: str | None = None) -> Request:
    req = unary("filesystem.Filesystem/ListDir", {"path": path, "depth": int(depth)}, user=user)
    return dataclasses.replace(req, max_bytes=limits.LISTING_BYTES)


def make_dir(path: str, *, user: str | None = None) -> Request:
    return unary("filesystem.Filesystem/MakeDir", {"path": path}, user=user)


def move(source: str, destination: str, *, user: str | None = None) -> Request:
    return unary("filesystem.Filesystem/Move", {"source": source, "destination": destination}, user=user)


def remove(path: str, *, user: str | None = None) -> Request:
    return unary("filesystem.Filesystem/Remove", {"path": path}, user=user)


def read_file(path: str, *, user: str | None = None, max_bytes: int = limits.FILE_BYTES) -> Request:
    return Request("GET", "/files", params={"path": path, **({"username": user} if user else {})},
                   max_bytes=max_bytes)


def write_file(path: str, data: bytes, *, user: str | None = None) -> Request:
    return Request("POST", "/files", {"Content-Type": "application/octet-stream"}, bytes(data),
                   params={"path": path, **({"username": user} if user else {})}, total=False)


FILE_CHUNK = 256 * 1024


def file_chunks(f, on_chunk=None):
    """The bytes of the open file ``f`` in chunks, reporting each chunk's length."""
    while chunk := f.read(FILE_CHUNK):
        yield chunk
        if on_chunk is not None:
            on_chunk(len(chunk))


@lru_cache(maxsize=1)
def _default_tls() -> ssl.SSLContext:
    return ssl.create_default_context()


def tls_for(base_url: str):
    """httpx's ``verify`` for ``base_url``: no TLS context for plain http (building
    httpx's default costs ~20 ms per client, which a health poll cannot afford), one
    shared verifying context for https (e.g. the CLI through a TLS data plane)."""
    return _default_tls() if base_url.lower().startswith("https:") else False
