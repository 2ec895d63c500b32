"""How each envd answer is read, without any I/O: the result types and the decoders of
unary answers and event streams.

Why a module of its own: a guest may send anything, and every client (sync and async)
must read it the same way: a malformed answer is an ``internal`` EnvdError, never a
TypeError in the caller, and what is kept of it is bounded (``limits``). The requests
these answer are ``protocol``'s."""
from __future__ import annotations

import base64
from contextlib import contextmanager
from dataclasses import dataclass

from envd.wire import FLAG_END_STREAM, ConnectError, EnvelopeReader, decode_json, parse_end_stream

from . import limits
from .errors import EnvdError, EnvdUnavailable



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


# ------------------------------------------------------------------ answers

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
