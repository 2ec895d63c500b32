"""The blocking envd client (``httpx.Client``): the node agent, vmm and the CLI.

Every call raises ``EnvdError`` (``EnvdUnavailable`` for transport failures) except
``health``, which answers a bool. Streams (``start``, ``start_pty``, ``connect``) are
generators: the request goes out at the first ``next()``, and closing the generator (or
leaving a ``with contextlib.closing(...)`` block) closes the connection — which envd
never takes as a reason to stop the process.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import BinaryIO

import httpx

from . import deadline as _deadline
from . import answers, limits, protocol
from .base import BaseClient
from .errors import EnvdError, transport_error
from .answers import EntryInfo, Event, GuestMetrics, ProcessInfo, RunResult


class EnvdClient(BaseClient):
    """One sandbox's envd. Use as ``with EnvdClient.at(host, port, token) as envd:``."""

    def __init__(self, base_url: str, access_token: str | None = None, **kwargs):
        super().__init__(base_url, access_token, **kwargs)
        options = self._client_options
        if "transport" not in options:  # sockets that keep to a call's total deadline (envd_client.deadline)
            options = {**options, "transport": _deadline.transport(options["verify"])}
        self._http = httpx.Client(**options)

    def __enter__(self) -> "EnvdClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # -- transport ------------------------------------------------------------------------------

    def _send(self, req: protocol.Request) -> bytes:
        """The answer's body: at most ``req.max_bytes`` of it read (EnvdAnswerTooLarge past
        that), all of it within the call's total deadline (EnvdUnavailable after it)."""
        try:
            with _deadline.within(self._total(req)), \
                    self._http.stream(req.method, req.path, content=req.content, params=req.params,
                                      headers=self._headers(req), timeout=self._timeout(req)) as resp:
                if resp.status_code not in req.expect:
                    self._check(req, resp.status_code, self._read(resp, limits.ERROR_BYTES, truncate=True))
                return self._read(resp, req.max_bytes, what=f"the answer to {req.method} {req.path}")
        except httpx.HTTPError as exc:
            raise transport_error(exc) from None

    @staticmethod
    def _read(resp: httpx.Response, cap: int, *, what: str = "", truncate: bool = False) -> bytes:
        body = limits.Cap(what, cap, truncate=truncate)
        limits.check_encoding(resp.headers)
        for chunk in resp.iter_bytes():
            if not body.add(chunk):
                break
        return body.bytes()

    def _call(self, req: protocol.Request) -> dict:
        return answers.json_answer(self._send(req))

    def _stream(self, req: protocol.Request) -> Iterator[Event]:
        decoder = answers.StreamDecoder()
        try:
            with self._http.stream(req.method, req.path, content=req.content, headers=self._headers(req),
                                   timeout=self._stream_timeout()) as resp:
                if resp.status_code != 200:
                    self._check(req, resp.status_code, self._read(resp, limits.ERROR_BYTES, truncate=True))
                for chunk in resp.iter_raw():
                    for message in decoder.feed(chunk):
                        yield answers.event(message)
                    if decoder.done:
                        decoder.check()
                        return
        except httpx.HTTPError as exc:
            raise transport_error(exc) from None
        raise answers.unterminated()

    # -- lifecycle: the node and the driver -----------------------------------------------------

    def health(self, timeout: float | None = protocol.HEALTH_TIMEOUT) -> bool:
        """True when envd answers ``GET /health`` (204); False when it cannot be reached
        or answers anything else. Never raises: made for polling."""
        try:
            self._send(protocol.health(timeout=timeout))
        except EnvdError:
            return False
        return True

    def init(self, env_vars: dict | None = None, *, access_token: str | None = None,
             timestamp: datetime | None = None, default_user: str | None = None, default_workdir: str | None = None,
             entropy_seed: bytes | None = None, timeout: float | None = protocol.INIT_TIMEOUT) -> None:
        """``POST /init`` as the node sends it (see ``protocol.init_body``). The request
        shows the client's current token (a re-init reaches an envd that requires it);
        ``access_token``, if given, is installed and used from then on."""
        self._send(protocol.init(protocol.init_body(env_vars, access_token=access_token, timestamp=timestamp,
                                                    default_user=default_user, default_workdir=default_workdir,
                                                    entropy_seed=entropy_seed), timeout=timeout))
        if access_token is not None:
            self.access_token = access_token or None

    def handoff_token(self, access_token: str, *, timeout: float | None = protocol.INIT_TIMEOUT) -> None:
        """Installs ``access_token`` in an envd that still requires the client's current
        one (a restored or forked VM carries its source's token)."""
        self._send(protocol.init({"accessToken": access_token}, timeout=timeout))
        self.access_token = access_token

    def sync(self, timeout: float | None = protocol.SYNC_TIMEOUT) -> None:
        """``POST /aenv/sync``: the guest's sync(2), so its page cache is on the disk."""
        self._send(protocol.sync(timeout=timeout))

    def trust(self, pem: str, timeout: float | None = protocol.TRUST_TIMEOUT) -> dict:
        """``POST /aenv/trust``: the guest trusts ``pem`` (the node's TLS-interception CA) in its
        system bundle, every certifi copy and Node's ``NODE_EXTRA_CA_CERTS``; envd's summary."""
        return self._call(protocol.trust(pem, timeout=timeout))

    def metrics(self, timeout: float | None = protocol.METRICS_TIMEOUT) -> GuestMetrics:
        """``GET /metrics``: the guest's CPU, memory and disk usage (E2B's envd ``Metrics``)."""
        return answers.guest_metrics(self._call(protocol.metrics(timeout=timeout)))

    # -- processes ------------------------------------------------------------------------------

    def start(self, cmd: str, args=(), *, envs: dict | None = None, cwd: str | None = None, user: str | None = None,
              stdin: bool | None = None, tag: str | None = None, pty: tuple[int, int] | None = None,
              deadline: float | None = None, keepalive: float = protocol.KEEPALIVE_INTERVAL) -> Iterator[Event]:
        """``Process/Start``: the process's events (start, data, ..., end) as they come.
        ``deadline`` (seconds) ends the process then; without one it lives on its own.
        ``keepalive``: a quiet stream still yields a keepalive event this often (seconds)."""
        config = protocol.process_config(cmd, args, envs=envs, cwd=cwd)
        return self._stream(protocol.start(config, pty=pty, tag=tag, stdin=stdin, user=user, deadline=deadline,
                                           keepalive=keepalive))

    def run(self, command: str, *, envs: dict | None = None, cwd: str | None = None, user: str | None = None,
            stdin: bool | None = False, deadline: float | None = None,
            on_stdout: Callable[[bytes], None] | None = None,
            on_stderr: Callable[[bytes], None] | None = None) -> RunResult:
        """Runs ``bash -l -c command`` to its end, passing output to the callbacks as it
        arrives; a non-zero exit is a result, not an error."""
        config = protocol.command_config(command, envs=envs, cwd=cwd)
        return self.run_argv(config["cmd"], config["args"], envs=envs, cwd=cwd, user=user, stdin=stdin,
                             deadline=deadline, on_stdout=on_stdout, on_stderr=on_stderr)

    def run_argv(self, cmd: str, args=(), *, envs: dict | None = None, cwd: str | None = None,
                 user: str | None = None, stdin: bool | None = False, deadline: float | None = None,
                 on_stdout: Callable[[bytes], None] | None = None,
                 on_stderr: Callable[[bytes], None] | None = None) -> RunResult:
        """``cmd args…`` to its end, no shell in between (for a guest that may have no bash);
        output and exit as in ``run``."""
        collector = answers.RunCollector(on_stdout, on_stderr)
        events = self._stream(protocol.start(protocol.process_config(cmd, args, envs=envs, cwd=cwd), stdin=stdin,
                                             user=user, deadline=deadline))
        try:
            with _deadline.within(None if deadline is None else deadline + limits.RUN_DEADLINE_GRACE):
                for ev in events:
                    collector.add(ev)
        finally:
            events.close()
        return collector.result()

    def start_pty(self, cols: int, rows: int, *, tag: str | None = None, envs: dict | None = None,
                  cwd: str | None = None, user: str | None = None) -> Iterator[Event]:
        """A login shell on a PTY of ``cols``×``rows`` (output as ``pty`` data events)."""
        config = protocol.shell_config(envs=envs, cwd=cwd)
        return self._stream(protocol.start(config, pty=(cols, rows), tag=tag, user=user))

    def connect(self, pid: int) -> Iterator[Event]:
        """``Process/Connect``: a start event, then live output of a running process (no
        replay). Unknown pid: EnvdError ``not_found``."""
        return self._stream(protocol.connect(pid))

    def send_input(self, pid: int, data: bytes, *, pty: bool = True) -> None:
        """Keystrokes for a PTY (``pty=False``: bytes for a process's stdin pipe)."""
        self._call(protocol.send_input(pid, data, pty=pty))

    def resize(self, pid: int, cols: int, rows: int) -> None:
        self._call(protocol.resize(pid, cols, rows))

    def kill(self, pid: int | None, signal: str = "SIGKILL", *, tag: str | None = None) -> bool:
        """Signals ``pid`` (None: the process started with ``tag``); False if there is no such process."""
        try:
            self._call(protocol.send_signal(pid, signal, tag=tag))
        except EnvdError as exc:
            if exc.code == "not_found":
                return False
            raise
        return True

    def list(self) -> list[ProcessInfo]:
        return answers.process_infos(self._call(protocol.list_processes()))

    def close_stdin(self, pid: int) -> None:
        """EOF on the stdin pipe of ``pid`` (started with ``stdin=True``)."""
        self._call(protocol.close_stdin(pid))

    def tag_of(self, pid: int) -> str | None:
        """The tag of running process ``pid`` ("" if untagged, None if there is none)."""
        for proc in self.list():
            if proc.pid == pid:
                return proc.tag or ""
        return None

    # -- files ----------------------------------------------------------------------------------

    def read_file(self, path: str, *, user: str | None = None, max_bytes: int = limits.FILE_BYTES) -> bytes:
        """The file, whole (at most ``max_bytes``: EnvdAnswerTooLarge past that)."""
        return self._send(protocol.read_file(path, user=user, max_bytes=max_bytes))

    def download_file(self, path: str, sink: BinaryIO, *, user: str | None = None,
                      on_chunk: Callable[[int], None] | None = None) -> int:
        """Streams ``path`` into the writable ``sink`` chunk by chunk (never whole in
        memory), calling ``on_chunk(len)`` after each; returns the bytes written. A
        connection that breaks or stays silent for ``stream_idle_timeout`` is
        EnvdUnavailable."""
        req = protocol.read_file(path, user=user)
        written = 0
        try:
            with self._http.stream(req.method, req.path, params=req.params, headers=self._headers(req),
                                   timeout=self._stream_timeout()) as resp:
                if resp.status_code not in req.expect:
                    self._check(req, resp.status_code, self._read(resp, limits.ERROR_BYTES, truncate=True))
                for chunk in resp.iter_bytes():
                    sink.write(chunk)
                    written += len(chunk)
                    if on_chunk is not None:
                        on_chunk(len(chunk))
        except httpx.HTTPError as exc:
            raise transport_error(exc) from None
        return written

    def upload_file(self, path: str, source, *, user: str | None = None,
                    on_chunk: Callable[[int], None] | None = None) -> dict:
        """Streams the host file ``source`` (a path) to ``path`` in chunks, never whole in
        memory (a template's COPY archive may be gigabytes), calling ``on_chunk(len)`` as
        each is sent; like ``write_file`` otherwise."""
        with open(source, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            base = protocol.write_file(path, b"", user=user)
            req = dataclasses.replace(base, content=protocol.file_chunks(f, on_chunk),
                                      headers={**base.headers, "Content-Length": str(size)})
            return answers.written_entry(self._call(req))

    def write_file(self, path: str, data: bytes, *, user: str | None = None) -> dict:
        """Writes (creating parents, replacing) ``path``; returns envd's entry for it
        (``name``, ``type``, ``path``: absolute)."""
        return answers.written_entry(self._call(protocol.write_file(path, data, user=user)))

    def stat(self, path: str, *, user: str | None = None) -> EntryInfo:
        """The entry at ``path`` (a final symlink described, not followed); EnvdError
        ``not_found`` if there is none."""
        return answers.entry_answer(self._call(protocol.stat(path, user=user)))

    def list_dir(self, path: str, depth: int = 1, *, user: str | None = None) -> list[EntryInfo]:
        """The entries under directory ``path`` down to ``depth`` levels, parents before
        their children (symlinked directories are not entered)."""
        answer = self._call(protocol.list_dir(path, depth, user=user))
        return answers.entry_infos(answer)

    def make_dir(self, path: str, *, user: str | None = None) -> EntryInfo:
        """``mkdir -p``; EnvdError ``already_exists`` if it is already a directory."""
        return answers.entry_answer(self._call(protocol.make_dir(path, user=user)))

    def move(self, source: str, destination: str, *, user: str | None = None) -> EntryInfo:
        """Renames ``source`` to ``destination`` (replacing a file there)."""
        return answers.entry_answer(self._call(protocol.move(source, destination, user=user)))

    def remove(self, path: str, *, user: str | None = None) -> None:
        """``rm -rf`` of ``path`` (a missing path is fine)."""
        self._call(protocol.remove(path, user=user))
