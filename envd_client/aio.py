"""The asyncio envd client (``httpx.AsyncClient``): the dashboard terminal, async node code.

The same calls as ``envd_client.sync.EnvdClient``, awaited. Streams (``start``,
``start_pty``, ``connect``) are async generators: the request goes out at the first
``__anext__``, and ``aclose()`` (or ``contextlib.aclosing``) closes the connection —
which envd never takes as a reason to stop the process. Nothing here blocks the loop,
and every call has a timeout (a stream silent for ``stream_idle_timeout`` is dead).
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from datetime import datetime

import httpx

from . import answers, limits, protocol
from .base import BaseClient
from .errors import EnvdError, EnvdUnavailable, transport_error
from .answers import EntryInfo, Event, GuestMetrics, ProcessInfo, RunResult


class AsyncEnvdClient(BaseClient):
    """One sandbox's envd. Use as ``async with AsyncEnvdClient.at(host, port, token) as envd:``."""

    def __init__(self, base_url: str, access_token: str | None = None, **kwargs):
        super().__init__(base_url, access_token, **kwargs)
        self._http = httpx.AsyncClient(**self._client_options)

    async def __aenter__(self) -> "AsyncEnvdClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # -- transport ------------------------------------------------------------------------------

    async def _send(self, req: protocol.Request) -> bytes:
        """The answer's body: at most ``req.max_bytes`` of it read (EnvdAnswerTooLarge past
        that), all of it within the call's total deadline (EnvdUnavailable after it)."""
        total = self._total(req)
        try:
            async with asyncio.timeout(total), \
                    self._http.stream(req.method, req.path, content=req.content, params=req.params,
                                      headers=self._headers(req), timeout=self._timeout(req)) as resp:
                if resp.status_code not in req.expect:
                    self._check(req, resp.status_code, await self._read(resp, limits.ERROR_BYTES, truncate=True))
                return await self._read(resp, req.max_bytes, what=f"the answer to {req.method} {req.path}")
        except httpx.HTTPError as exc:
            raise transport_error(exc) from None
        except TimeoutError:
            raise EnvdUnavailable(f"no whole answer to {req.method} {req.path} within {total} s") from None

    @staticmethod
    async def _read(resp: httpx.Response, cap: int, *, what: str = "", truncate: bool = False) -> bytes:
        body = limits.Cap(what, cap, truncate=truncate)
        limits.check_encoding(resp.headers)
        async for chunk in resp.aiter_bytes():
            if not body.add(chunk):
                break
        return body.bytes()

    async def _call(self, req: protocol.Request) -> dict:
        return answers.json_answer(await self._send(req))

    async def _stream(self, req: protocol.Request) -> AsyncIterator[Event]:
        decoder = answers.StreamDecoder()
        try:
            async with self._http.stream(req.method, req.path, content=req.content, headers=self._headers(req),
                                   timeout=self._stream_timeout()) as resp:
                if resp.status_code != 200:
                    self._check(req, resp.status_code, await self._read(resp, limits.ERROR_BYTES, truncate=True))
                async for chunk in resp.aiter_raw():
                    for message in decoder.feed(chunk):
                        yield answers.event(message)
                    if decoder.done:
                        decoder.check()
                        return
        except httpx.HTTPError as exc:
            raise transport_error(exc) from None
        raise answers.unterminated()

    # -- lifecycle: the node and the driver -----------------------------------------------------

    async def health(self, timeout: float | None = protocol.HEALTH_TIMEOUT) -> bool:
        """True when envd answers ``GET /health`` (204); False when it cannot be reached
        or answers anything else. Never raises: made for polling."""
        try:
            await self._send(protocol.health(timeout=timeout))
        except EnvdError:
            return False
        return True

    async def init(self, env_vars: dict | None = None, *, access_token: str | None = None,
             timestamp: datetime | None = None, default_user: str | None = None, default_workdir: str | None = None,
             entropy_seed: bytes | None = None, timeout: float | None = protocol.INIT_TIMEOUT) -> None:
        """``POST /init`` as the node sends it (see ``protocol.init_body``). The request
        shows the client's current token (a re-init reaches an envd that requires it);
        ``access_token``, if given, is installed and used from then on."""
        await self._send(protocol.init(protocol.init_body(env_vars, access_token=access_token, timestamp=timestamp,
                                                    default_user=default_user, default_workdir=default_workdir,
                                                    entropy_seed=entropy_seed), timeout=timeout))
        if access_token is not None:
            self.access_token = access_token or None

    async def handoff_token(self, access_token: str, *, timeout: float | None = protocol.INIT_TIMEOUT) -> None:
        """Installs ``access_token`` in an envd that still requires the client's current
        one (a restored or forked VM carries its source's token)."""
        await self._send(protocol.init({"accessToken": access_token}, timeout=timeout))
        self.access_token = access_token

    async def sync(self, timeout: float | None = protocol.SYNC_TIMEOUT) -> None:
        """``POST /aenv/sync``: the guest's sync(2), so its page cache is on the disk."""
        await self._send(protocol.sync(timeout=timeout))

    async def trust(self, pem: str, timeout: float | None = protocol.TRUST_TIMEOUT) -> dict:
        """``POST /aenv/trust``: the guest trusts ``pem`` (the node's TLS-interception CA) in its
        system bundle, every certifi copy and Node's ``NODE_EXTRA_CA_CERTS``; envd's summary."""
        return await self._call(protocol.trust(pem, timeout=timeout))

    async def metrics(self, timeout: float | None = protocol.METRICS_TIMEOUT) -> GuestMetrics:
        """``GET /metrics``: the guest's CPU, memory and disk usage (E2B's envd ``Metrics``)."""
        return answers.guest_metrics(await self._call(protocol.metrics(timeout=timeout)))

    # -- processes ------------------------------------------------------------------------------

    def start(self, cmd: str, args=(), *, envs: dict | None = None, cwd: str | None = None, user: str | None = None,
              stdin: bool | None = None, tag: str | None = None, pty: tuple[int, int] | None = None,
              deadline: float | None = None) -> AsyncIterator[Event]:
        """``Process/Start``: the process's events (start, data, ..., end) as they come.
        ``deadline`` (seconds) ends the process then; without one it lives on its own."""
        config = protocol.process_config(cmd, args, envs=envs, cwd=cwd)
        return self._stream(protocol.start(config, pty=pty, tag=tag, stdin=stdin, user=user, deadline=deadline))

    async def run(self, command: str, *, envs: dict | None = None, cwd: str | None = None, user: str | None = None,
            stdin: bool | None = False, deadline: float | None = None,
            on_stdout: Callable[[bytes], None] | None = None,
            on_stderr: Callable[[bytes], None] | None = None) -> RunResult:
        """Runs ``bash -l -c command`` to its end, passing output to the callbacks as it
        arrives; a non-zero exit is a result, not an error."""
        collector = answers.RunCollector(on_stdout, on_stderr)
        events = self._stream(protocol.start(protocol.command_config(command, envs=envs, cwd=cwd), stdin=stdin,
                                             user=user, deadline=deadline))
        total = None if deadline is None else deadline + limits.RUN_DEADLINE_GRACE
        try:
            async with asyncio.timeout(total):
                async for ev in events:
                    collector.add(ev)
        except TimeoutError:
            raise EnvdUnavailable(f"the command's stream went on past its deadline of {deadline:g} s") from None
        finally:
            await events.aclose()
        return collector.result()

    def start_pty(self, cols: int, rows: int, *, tag: str | None = None, envs: dict | None = None,
                  cwd: str | None = None, user: str | None = None) -> AsyncIterator[Event]:
        """A login shell on a PTY of ``cols``×``rows`` (output as ``pty`` data events)."""
        config = protocol.shell_config(envs=envs, cwd=cwd)
        return self._stream(protocol.start(config, pty=(cols, rows), tag=tag, user=user))

    def connect(self, pid: int) -> AsyncIterator[Event]:
        """``Process/Connect``: a start event, then live output of a running process (no
        replay). Unknown pid: EnvdError ``not_found``."""
        return self._stream(protocol.connect(pid))

    async def send_input(self, pid: int, data: bytes, *, pty: bool = True) -> None:
        """Keystrokes for a PTY (``pty=False``: bytes for a process's stdin pipe)."""
        await self._call(protocol.send_input(pid, data, pty=pty))

    async def resize(self, pid: int, cols: int, rows: int) -> None:
        await self._call(protocol.resize(pid, cols, rows))

    async def kill(self, pid: int | None, signal: str = "SIGKILL", *, tag: str | None = None) -> bool:
        """Signals ``pid`` (None: the process started with ``tag``); False if there is no such process."""
        try:
            await self._call(protocol.send_signal(pid, signal, tag=tag))
        except EnvdError as exc:
            if exc.code == "not_found":
                return False
            raise
        return True

    async def list(self) -> list[ProcessInfo]:
        return answers.process_infos(await self._call(protocol.list_processes()))

    async def close_stdin(self, pid: int) -> None:
        """EOF on the stdin pipe of ``pid`` (started with ``stdin=True``)."""
        await self._call(protocol.close_stdin(pid))

    async def tag_of(self, pid: int) -> str | None:
        """The tag of running process ``pid`` ("" if untagged, None if there is none)."""
        for proc in await self.list():
            if proc.pid == pid:
                return proc.tag or ""
        return None

    # -- files ----------------------------------------------------------------------------------

    async def read_file(self, path: str, *, user: str | None = None, max_bytes: int = limits.FILE_BYTES) -> bytes:
        """The file, whole (at most ``max_bytes``: EnvdAnswerTooLarge past that)."""
        return await self._send(protocol.read_file(path, user=user, max_bytes=max_bytes))

    async def write_file(self, path: str, data: bytes, *, user: str | None = None) -> dict:
        """Writes (creating parents, replacing) ``path``; returns envd's entry for it
        (``name``, ``type``, ``path``: absolute)."""
        return answers.written_entry(await self._call(protocol.write_file(path, data, user=user)))

    async def stat(self, path: str, *, user: str | None = None) -> EntryInfo:
        """The entry at ``path`` (a final symlink described, not followed)."""
        return answers.entry_answer(await self._call(protocol.stat(path, user=user)))

    async def list_dir(self, path: str, depth: int = 1, *, user: str | None = None) -> list[EntryInfo]:
        """The entries under directory ``path`` down to ``depth`` levels, parents first."""
        answer = await self._call(protocol.list_dir(path, depth, user=user))
        return answers.entry_infos(answer)

    async def make_dir(self, path: str, *, user: str | None = None) -> EntryInfo:
        """``mkdir -p``; EnvdError ``already_exists`` if it is already a directory."""
        return answers.entry_answer(await self._call(protocol.make_dir(path, user=user)))

    async def move(self, source: str, destination: str, *, user: str | None = None) -> EntryInfo:
        """Renames ``source`` to ``destination`` (replacing a file there)."""
        return answers.entry_answer(await self._call(protocol.move(source, destination, user=user)))

    async def remove(self, path: str, *, user: str | None = None) -> None:
        """``rm -rf`` of ``path`` (a missing path is fine)."""
        await self._call(protocol.remove(path, user=user))
