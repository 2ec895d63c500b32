"""A small async client for the PTY part of envd's ``process.Process`` Connect RPC,
used by the dashboard terminal (spec §3.2, §3.4, §4.3).

Why its own client: the terminal talks to envd directly (``envd_host:envd_port``
with the sandbox's X-Access-Token) from daphne's event loop, so it needs async
streaming (httpx) and must never block or hang: every call has a timeout, and a
stream that goes quiet longer than a few keepalive intervals counts as dead."""
from __future__ import annotations

import base64
import json
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx

# envd sends a keepalive event after this much silence (seconds) on our streams...
KEEPALIVE_INTERVAL = 10
# ...so a stream silent for longer than this is dead (VM frozen, network gone).
STREAM_READ_TIMEOUT = 3 * KEEPALIVE_INTERVAL
CONNECT_TIMEOUT = 5.0
UNARY_TIMEOUT = 10.0
SHELL = {"cmd": "/bin/bash", "args": ["-i", "-l"],
         "envs": {"TERM": "xterm-256color", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}}


class EnvdError(Exception):
    """An envd call failed. ``code`` is the Connect error code (``not_found``,
    ``unavailable`` for transport failures, ...)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass
class Event:
    """One process event: ``kind`` is start | data | end | keepalive."""

    kind: str
    pid: int | None = None
    data: bytes = b""
    exit_code: int | None = None
    status: str = ""
    error: str = ""


def envelope(message: dict) -> bytes:
    payload = json.dumps(message).encode()
    return struct.pack(">BI", 0, len(payload)) + payload


def _event(message: dict) -> Event:
    event = message.get("event") or {}
    if "start" in event:
        return Event("start", pid=int(event["start"].get("pid", 0)))
    if "data" in event:
        data = event["data"]
        raw = data.get("pty") or data.get("stdout") or data.get("stderr") or ""
        return Event("data", data=base64.b64decode(raw))
    if "end" in event:
        end = event["end"]
        return Event("end", exit_code=int(end.get("exitCode", end.get("exit_code", 0))),
                     status=end.get("status", ""), error=end.get("error", ""))
    return Event("keepalive")


class EnvelopeReader:
    """Re-assembles Connect envelopes from arbitrarily split chunks."""

    def __init__(self):
        self._buf = bytearray()

    def feed(self, chunk: bytes) -> list[tuple[int, dict]]:
        self._buf += chunk
        out = []
        while len(self._buf) >= 5:
            flags, length = struct.unpack(">BI", self._buf[:5])
            if len(self._buf) < 5 + length:
                break
            payload = bytes(self._buf[5:5 + length])
            del self._buf[:5 + length]
            out.append((flags, json.loads(payload or b"{}")))
        return out


def _error_from_response(status: int, body: bytes) -> EnvdError:
    try:
        data = json.loads(body)
        return EnvdError(str(data.get("code", status)), str(data.get("message", "")))
    except ValueError:
        return EnvdError("unavailable" if status in (502, 503) else "unknown",
                         f"HTTP {status}: {body[:200].decode(errors='replace')}")


class EnvdPty:
    """PTY calls against one sandbox's envd. Use as ``async with EnvdPty(...) as envd``."""

    def __init__(self, base_url: str, access_token: str = ""):
        headers = {"connect-protocol-version": "1"}
        if access_token:
            headers["X-Access-Token"] = access_token
        self._client = httpx.AsyncClient(
            base_url=base_url, headers=headers,
            timeout=httpx.Timeout(UNARY_TIMEOUT, connect=CONNECT_TIMEOUT),
        )

    async def __aenter__(self) -> "EnvdPty":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _unary(self, method: str, message: dict) -> dict:
        try:
            resp = await self._client.post(f"/process.Process/{method}", json=message)
        except httpx.HTTPError as exc:
            raise EnvdError("unavailable", f"{type(exc).__name__}: {exc}") from None
        if resp.status_code != 200:
            raise _error_from_response(resp.status_code, resp.content)
        return resp.json()

    async def _stream(self, method: str, message: dict) -> AsyncIterator[Event]:
        """Yields the events of a server-streaming call; raises EnvdError when the
        call fails, ends with an error, or the connection breaks or goes silent."""
        headers = {"content-type": "application/connect+json",
                   "keepalive-ping-interval": str(KEEPALIVE_INTERVAL)}
        timeout = httpx.Timeout(STREAM_READ_TIMEOUT, connect=CONNECT_TIMEOUT)
        try:
            async with self._client.stream("POST", f"/process.Process/{method}", content=envelope(message),
                                           headers=headers, timeout=timeout) as resp:
                if resp.status_code != 200:
                    raise _error_from_response(resp.status_code, await resp.aread())
                reader = EnvelopeReader()
                async for chunk in resp.aiter_raw():
                    for flags, msg in reader.feed(chunk):
                        if flags & 0x02:  # end of stream
                            if msg.get("error"):
                                err = msg["error"]
                                raise EnvdError(str(err.get("code", "unknown")), str(err.get("message", "")))
                            return
                        yield _event(msg)
        except httpx.HTTPError as exc:
            raise EnvdError("unavailable", f"{type(exc).__name__}: {exc}") from None
        raise EnvdError("unavailable", "the stream ended without an end-of-stream message")

    def start_shell(self, cols: int, rows: int, tag: str) -> AsyncIterator[Event]:
        """``Process/Start`` of a login shell on a PTY of ``cols``×``rows``. No deadline:
        the shell lives until it exits or the sandbox goes away."""
        return self._stream("Start", {"process": SHELL, "pty": {"size": {"cols": cols, "rows": rows}},
                                      "tag": tag})

    def connect(self, pid: int) -> AsyncIterator[Event]:
        """``Process/Connect``: live output of a running process (no replay)."""
        return self._stream("Connect", {"process": {"pid": pid}})

    async def send_input(self, pid: int, data: bytes) -> None:
        await self._unary("SendInput", {"process": {"pid": pid},
                                        "input": {"pty": base64.b64encode(data).decode()}})

    async def resize(self, pid: int, cols: int, rows: int) -> None:
        await self._unary("Update", {"process": {"pid": pid}, "pty": {"size": {"cols": cols, "rows": rows}}})

    async def tag_of(self, pid: int) -> str | None:
        """The tag of running process ``pid`` (None if there is no such process)."""
        listing = await self._unary("List", {})
        for proc in listing.get("processes", []):
            if int(proc.get("pid", 0)) == pid:
                return proc.get("tag", "")
        return None
