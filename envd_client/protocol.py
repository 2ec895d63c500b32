"""What each envd call sends and how its answer is read, without any I/O.

Why a module of its own: the sync and the async client differ only in how bytes move
(``httpx.Client`` vs ``httpx.AsyncClient``). Request construction (paths, headers, JSON
bodies, the ``/init`` body the node sends), stream decoding (envelopes → events, the
end-of-stream error) and result types live here once, so the two clients stay thin
mirrors of each other and cannot drift apart.
"""
from __future__ import annotations

import base64
import dataclasses
import os
import ssl
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import lru_cache

from envd.wire import (
    FLAG_END_STREAM,
    STREAM_CONTENT_TYPE,
    UNARY_CONTENT_TYPE,
    ConnectError,
    EnvelopeReader,
    decode_json,
    encode_json,
    envelope,
    parse_end_stream,
)

from . import limits
from .errors import EnvdError, EnvdUnavailable

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


@dataclass(frozen=True)
class Event:
    """One process event: ``kind`` is start | data | end | keepalive. ``data`` events
    say which ``stream`` (stdout, stderr or pty) the bytes came from."""

    kind: str
    pid: int | None = None
    stream: str = ""
    data: bytes = b""
    exit_code: int | None = None
    exited: bool = False
    status: str = ""
    error: str = ""


@dataclass(frozen=True)
class RunResult:
    """A finished command: exit code (-1 if killed by a signal), output, envd's status
    (``exit status 3``, ``signal: killed``) and error text."""

    pid: int
    exit_code: int
    stdout: bytes = b""
    stderr: bytes = b""
    status: str = ""
    error: str = ""
    truncated: bool = False  # more output came than ``limits.RUN_OUTPUT_BYTES`` per stream: the rest is not kept

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


@dataclass(frozen=True)
class GuestMetrics:
    """envd's ``GET /metrics``: the guest's clock (unix s), vCPUs, CPU busy % since the
    previous call, memory (total, used, page cache) and root filesystem, in bytes."""

    ts: int
    cpu_count: int
    cpu_used_pct: float
    mem_total: int
    mem_used: int
    mem_cache: int
    disk_used: int
    disk_total: int


@dataclass(frozen=True)
class EntryInfo:
    """A filesystem entry as ``Filesystem/Stat`` / ``ListDir`` describe it. ``type`` is
    file | dir | other; for a symlink it is the target's type (``other`` if dangling) and
    ``is_symlink`` is set. ``path`` is absolute (envd resolves relative paths in the
    user's home)."""

    name: str
    type: str
    path: str
    size: int = 0
    mode: int = 0
    is_symlink: bool = False
    symlink_target: str | None = None


@dataclass(frozen=True)
class ProcessInfo:
    """A running process as ``Process/List`` reports it."""

    pid: int
    tag: str | None
    cmd: str
    args: list
    envs: dict
    cwd: str | None


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


def metrics(*, timeout: float | None = METRICS_TIMEOUT) -> Request:
    return Request("GET", "/metrics", timeout=timeout, max_bytes=limits.METRICS_BYTES)


def guest_metrics(answer) -> GuestMetrics:
    """envd's ``GET /metrics`` answer (E2B's envd ``Metrics``) as GuestMetrics, every
    field checked (a guest may send anything): integers in 0..the range of the column they
    are stored in, a finite CPU % in 0..100. Anything else is an ``internal`` error."""
    if not isinstance(answer, dict):
        raise EnvdError("internal", f"unexpected /metrics answer: {answer!r:.200}")

    def number(name: str, maximum: int = limits.BYTES_MAX, default=None) -> int:
        return limits.guest_int(answer[name] if default is None else answer.get(name, default), name, maximum)

    try:
        return GuestMetrics(ts=number("ts"), cpu_count=number("cpu_count", limits.COUNT_MAX),
                            cpu_used_pct=limits.guest_percent(answer["cpu_used_pct"], "cpu_used_pct"),
                            mem_total=number("mem_total"), mem_used=number("mem_used"),
                            mem_cache=number("mem_cache", default=0), disk_used=number("disk_used", default=0),
                            disk_total=number("disk_total", default=0))
    except (KeyError, ValueError) as exc:
        raise EnvdError("internal", f"unexpected /metrics answer ({exc}): {answer!r:.200}") from None


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


def send_signal(pid: int, signal: str = "SIGKILL") -> Request:
    name = signal if signal.startswith("SIGNAL_") else f"SIGNAL_{signal}"
    return unary("process.Process/SendSignal", {"process": {"pid": int(pid)}, "signal": name})


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


# ------------------------------------------------------------------ answers

def json_answer(body: bytes) -> dict:
    """A unary answer's JSON object; anything else is an ``internal`` error."""
    try:
        data = decode_json(body)
    except (ValueError, UnicodeDecodeError):
        raise EnvdError("internal", f"undecodable answer: {body[:200]!r}") from None
    if not isinstance(data, (dict, list)):
        raise EnvdError("internal", f"unexpected answer: {body[:200]!r}")
    return data


@contextmanager
def _guest_answer(what: str, value):
    """A malformed answer (a guest may send any JSON) is an ``internal`` EnvdError, never a
    TypeError or an OverflowError in the caller."""
    try:
        yield
    except (AttributeError, KeyError, TypeError, ValueError, OverflowError) as exc:
        raise EnvdError("internal", f"unexpected {what} ({type(exc).__name__}): {value!r:.200}") from None


def event(message) -> Event:
    """A ``StartResponse`` / ``ConnectResponse`` message as an Event."""
    with _guest_answer("process event", message):
        return _event(message)


def _event(message: dict) -> Event:
    ev = message.get("event") or {}
    if "start" in ev:
        return Event("start", pid=int(ev["start"].get("pid", 0)))
    if "data" in ev:
        data = ev["data"] or {}
        for name in ("pty", "stdout", "stderr"):
            if name in data:
                return Event("data", stream=name, data=base64.b64decode(data[name] or ""))
        return Event("data")
    if "end" in ev:
        end = ev["end"] or {}
        return Event("end", exit_code=int(end.get("exitCode", end.get("exit_code", 0))),
                     exited=bool(end.get("exited", False)), status=str(end.get("status", "")),
                     error=str(end.get("error", "")))
    return Event("keepalive")


_FILE_TYPES = {"FILE_TYPE_FILE": "file", "FILE_TYPE_DIRECTORY": "dir"}


def entry_info(message) -> EntryInfo:
    """An ``EntryInfo`` message (proto3 JSON: defaults omitted, int64 as a string)."""
    if not isinstance(message, dict) or "path" not in message:
        raise EnvdError("internal", f"unexpected entry: {message!r:.200}")
    with _guest_answer("entry", message):
        return EntryInfo(name=str(message.get("name", "")), type=_FILE_TYPES.get(message.get("type", ""), "other"),
                         path=str(message["path"]), size=int(message.get("size", 0) or 0),
                         mode=int(message.get("mode", 0) or 0), is_symlink=bool(message.get("isSymlink", False)),
                         symlink_target=message.get("symlinkTarget"))


def entry_answer(answer) -> EntryInfo:
    """The ``entry`` of a Stat / MakeDir / Move answer."""
    return entry_info(answer.get("entry") if isinstance(answer, dict) else answer)


def entry_infos(answer) -> list[EntryInfo]:
    """The ``entries`` of a ListDir answer."""
    entries = answer.get("entries", []) if isinstance(answer, dict) else None
    if not isinstance(entries, list):
        raise EnvdError("internal", f"unexpected ListDir answer: {answer!r:.200}")
    return [entry_info(e) for e in entries]


def process_infos(answer) -> list[ProcessInfo]:
    out = []
    with _guest_answer("process list", answer):
        for proc in answer.get("processes", []):
            config = proc.get("config") or {}
            out.append(ProcessInfo(pid=int(proc.get("pid", 0)), tag=proc.get("tag"), cmd=config.get("cmd", ""),
                                   args=list(config.get("args", [])), envs=dict(config.get("envs", {})),
                                   cwd=config.get("cwd")))
    return out


class StreamDecoder:
    """Turns a streaming answer's byte chunks into messages; ``done`` once the
    end-of-stream envelope arrived, whose error ``check()`` raises."""

    def __init__(self):
        self._reader = EnvelopeReader(limits.STREAM_MESSAGE_BYTES)
        self.done = False
        self.error: dict | None = None
        self.metadata: dict = {}

    def feed(self, chunk: bytes) -> list[dict]:
        """The complete messages in ``chunk`` (nothing after the end of the stream)."""
        if self.done:
            return []
        try:
            frames = self._reader.feed(chunk)
        except ConnectError as exc:
            raise EnvdError(exc.code, exc.message) from None
        out = []
        for flags, payload in frames:
            if flags & FLAG_END_STREAM:
                self.done = True
                self.error, self.metadata = parse_end_stream(payload)
                break
            try:
                out.append(decode_json(payload))
            except (ValueError, UnicodeDecodeError):
                raise EnvdError("internal", f"undecodable stream message: {payload[:200]!r}") from None
        return out

    def check(self) -> None:
        if self.error is not None:
            raise EnvdError.from_dict(self.error)


def unterminated() -> EnvdUnavailable:
    return EnvdUnavailable("the stream ended without an end-of-stream message")


class RunCollector:
    """Builds a RunResult from a command's events, passing output to callbacks. It keeps
    the first ``max_bytes`` of each stream (a guest may print without end); the callbacks
    see all of it."""

    def __init__(self, on_stdout=None, on_stderr=None, max_bytes: int = limits.RUN_OUTPUT_BYTES):
        self._callbacks = {"stdout": on_stdout, "stderr": on_stderr}
        self._out = {"stdout": bytearray(), "stderr": bytearray()}
        self._max = max_bytes
        self.truncated = False
        self.pid = 0
        self.end: Event | None = None

    def add(self, ev: Event) -> None:
        if ev.kind == "start":
            self.pid = ev.pid or 0
        elif ev.kind == "data" and ev.stream in self._out:
            out = self._out[ev.stream]
            room = self._max - len(out)
            if len(ev.data) > room:
                self.truncated = True
            out += ev.data[:max(0, room)]
            callback = self._callbacks[ev.stream]
            if callback is not None:
                callback(ev.data)
        elif ev.kind == "end":
            self.end = ev

    def result(self) -> RunResult:
        if self.end is None:
            raise EnvdError("internal", "the command's stream ended without an end event")
        return RunResult(pid=self.pid, exit_code=self.end.exit_code or 0, stdout=bytes(self._out["stdout"]),
                         stderr=bytes(self._out["stderr"]), status=self.end.status, error=self.end.error,
                         truncated=self.truncated)


def written_entry(answer) -> dict:
    """The first entry of ``POST /files``'s answer (``{"name", "type", "path"}``)."""
    if not isinstance(answer, list) or not answer or not isinstance(answer[0], dict):
        raise EnvdError("internal", f"unexpected /files answer: {answer!r:.200}")
    return answer[0]


@lru_cache(maxsize=1)
def _default_tls() -> ssl.SSLContext:
    return ssl.create_default_context()


def tls_for(base_url: str):
    """httpx's ``verify`` for ``base_url``: no TLS context for plain http (building
    httpx's default costs ~20 ms per client, which a health poll cannot afford), one
    shared verifying context for https (e.g. the CLI through a TLS data plane)."""
    return _default_tls() if base_url.lower().startswith("https:") else False
