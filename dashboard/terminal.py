"""The sandbox terminal: a WebSocket (``/ws/sandboxes/<id>/terminal``) bridging
xterm.js in the dashboard to a PTY shell run by the sandbox's envd.

Protocol. Browser → server: text frames ``{"type": "input", "data": "..."}`` and
``{"type": "resize", "cols": C, "rows": R}`` (binary frames are raw input).
Server → browser: binary frames are PTY output; text frames are JSON status:
``{"type": "ready", "pid": P, "reconnected": bool}``, ``{"type": "exit", ...}`` and,
last, ``{"type": "close", "code": C, "reason": "..."}``: the server ends the socket
with a 4xxx close code (``CLOSE_*`` below) and a reason saying why, which the page
shows.

The page's status follows this: "connecting" until ``ready`` (the shell is attached),
"connected" after it, "closed" after a code in ``FINAL_CLOSE_CODES`` (trying again
cannot help), and "reconnecting" after any other end (a network drop, a daphne
restart, envd briefly unreachable): it retries with backoff, and the retry re-attaches
to the same shell.

The PTY outlives the socket: its pid (and a random tag, so a reused pid after a
reboot is never mistaken for ours) is remembered in the user's session per
sandbox, and a reload re-attaches with ``Process/Connect``. Only members of the
sandbox's team (the dashboard's current team) can open it; anything else looks
like a missing sandbox.

envd is reached directly (``envd_host:envd_port`` with the sandbox's X-Access-Token)
through ``envd_client.AsyncEnvdClient`` from daphne's event loop: nothing blocks, every
call has a timeout, and a PTY stream silent for longer than a few of envd's keepalive
intervals counts as dead (VM frozen, network gone)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from types import SimpleNamespace

from channels.db import database_sync_to_async

from envd_client import AsyncEnvdClient, EnvdError
from envd_client.protocol import STREAM_IDLE_TIMEOUT, UNARY_TIMEOUT
from sandboxes.models import Sandbox
from sandboxes.states import ROUTABLE, SandboxState

from dashboard.sockets import (CLOSE_BAD_MESSAGE, CLOSE_EXITED, CLOSE_NOT_FOUND, CLOSE_NOT_RUNNING,  # noqa: F401
                      CLOSE_UNAUTHENTICATED, CLOSE_UNREACHABLE, TaskSocket)
from dashboard.teams import current_team

log = logging.getLogger(__name__)

# While the socket is open the sandbox row is re-read this often, so a pause or kill
# closes the terminal promptly even when the envd connection lingers.
STATE_POLL_SECONDS = 2.0
# States in which the VM (and so the PTY) keeps running.
TERMINAL_STATES = ROUTABLE  # a terminal needs a VM whose envd takes traffic
DEFAULT_SIZE = (80, 24)
# envd calls: a unary call's timeout; the silence after which the PTY stream is dead.
ENVD_TIMEOUT = UNARY_TIMEOUT
ENVD_STREAM_IDLE_TIMEOUT = STREAM_IDLE_TIMEOUT
MAX_INPUT_BATCH = 64 * 1024
# After these the page says "closed" and does not retry (it does after any other close):
# the shell exited, a bad frame, signed out, no such sandbox, the sandbox is not running.
FINAL_CLOSE_CODES = frozenset({CLOSE_EXITED, CLOSE_BAD_MESSAGE, CLOSE_UNAUTHENTICATED, CLOSE_NOT_FOUND,
                               CLOSE_NOT_RUNNING})


def session_key(sandbox_id: str) -> str:
    return f"dashboard_terminal:{sandbox_id}"


def gone_reason(state: str) -> str:
    """Why the terminal cannot (or can no longer) run in a sandbox in ``state``."""
    if state in (SandboxState.PAUSING, SandboxState.PAUSED):
        return "sandbox is paused: resume it to use the terminal"
    if state in (SandboxState.KILLING, SandboxState.KILLED):
        return "sandbox was killed"
    if state == SandboxState.ERROR:
        return "sandbox failed"
    return f"sandbox is {state}"


def _size(value, default: int) -> int:
    try:
        return min(max(int(value), 1), 1000)
    except (TypeError, ValueError):
        return default


def _query(scope) -> dict[str, str]:
    from urllib.parse import parse_qsl  # noqa: PLC0415

    return dict(parse_qsl(scope.get("query_string", b"").decode("latin1")))


@database_sync_to_async
def _find_sandbox(scope, sandbox_id: str) -> Sandbox | None:
    """The sandbox if it belongs to the user's current dashboard team, else None."""
    user = scope.get("user")
    if user is None or not user.is_authenticated:
        return None
    team = current_team(SimpleNamespace(user=user, session=scope["session"]))
    if team is None:
        return None
    return Sandbox.objects.filter(pk=sandbox_id, team=team).first()


@database_sync_to_async
def _state_of(sandbox_id: str) -> str:
    return Sandbox.objects.filter(pk=sandbox_id).values_list("state", flat=True).first() or SandboxState.KILLED


class TerminalConsumer(TaskSocket):
    sandbox: Sandbox | None = None
    cancel_timeout = 15.0

    async def connect(self):
        self.sandbox_id = self.scope["url_route"]["kwargs"]["sandbox_id"]
        self.inputs: asyncio.Queue = asyncio.Queue()
        self.pid: int | None = None
        user = self.scope.get("user")
        # Accept first, then close: a close before accept reaches the browser as a bare
        # failed handshake, without the code and reason the page shows.
        await self.accept()
        if user is None or not user.is_authenticated:
            return await self._finish(CLOSE_UNAUTHENTICATED, "sign in to use the terminal")
        self.sandbox = await _find_sandbox(self.scope, self.sandbox_id)
        if self.sandbox is None:
            return await self._finish(CLOSE_NOT_FOUND, "sandbox not found")
        if self.sandbox.state not in TERMINAL_STATES:
            return await self._finish(CLOSE_NOT_RUNNING, gone_reason(self.sandbox.state))
        query = _query(self.scope)
        size = (_size(query.get("cols"), DEFAULT_SIZE[0]), _size(query.get("rows"), DEFAULT_SIZE[1]))
        self._task = asyncio.create_task(self._run(size), name=f"terminal-{self.sandbox_id}")

    async def receive(self, text_data=None, bytes_data=None):
        if self.sandbox is None:
            return
        if bytes_data is not None:
            self.inputs.put_nowait(("input", bytes_data))
            return
        try:
            msg = json.loads(text_data or "")
            kind = msg["type"]
            if kind == "input":
                self.inputs.put_nowait(("input", str(msg["data"]).encode()))
            elif kind == "resize":
                self.inputs.put_nowait(("resize", (_size(msg["cols"], 80), _size(msg["rows"], 24))))
            else:
                raise ValueError(kind)
        except (ValueError, KeyError, TypeError):
            if self._task is not None:
                self._task.cancel()  # no second close from the bridge
            await self._finish(CLOSE_BAD_MESSAGE, "bad terminal message")

    # ------------------------------------------------------------------ the bridge

    async def _run(self, size: tuple[int, int]) -> None:
        """Runs the bridge until the shell ends, the sandbox leaves the running state
        or envd fails, then closes the socket with the reason. Cancelled (the browser
        went away) it stops its helpers and the envd connection; the shell lives on."""
        envd = AsyncEnvdClient(self.sandbox.envd_base_url, self.sandbox.envd_access_token,
                               timeout=ENVD_TIMEOUT, stream_idle_timeout=ENVD_STREAM_IDLE_TIMEOUT)
        self._writer: asyncio.Task | None = None
        tasks = [asyncio.create_task(self._pump(envd, size), name=f"terminal-{self.sandbox_id}-pump"),
                 asyncio.create_task(self._watch_state(), name=f"terminal-{self.sandbox_id}-watch")]
        code, reason = CLOSE_UNREACHABLE, "terminal stopped"
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            code, reason = done.pop().result()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never leave the socket open on a bug
            log.exception("terminal for sandbox %s failed", self.sandbox_id)
            code, reason = CLOSE_UNREACHABLE, f"terminal failed: {type(exc).__name__}"
        finally:
            tasks.append(self._writer)
            for task in tasks:
                if task is not None:
                    task.cancel()
            for task in tasks:
                if task is not None:
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
            with contextlib.suppress(Exception):
                await envd.aclose()
        await self._finish(code, reason)

    async def _pump(self, envd: AsyncEnvdClient, size: tuple[int, int]) -> tuple[int, str]:
        """Streams PTY output to the socket; returns the close code and reason."""
        try:
            stream, reconnected = await self._open(envd, size)
            async with contextlib.aclosing(stream):
                return await self._forward(stream, envd, size, reconnected)
        except EnvdError as exc:
            # A broken stream usually means the VM went away: say why if the DB knows.
            state = await _state_of(self.sandbox_id)
            if state not in TERMINAL_STATES:
                return CLOSE_NOT_RUNNING, gone_reason(state)
            return CLOSE_UNREACHABLE, f"sandbox unreachable: {exc.message or exc.code}"

    async def _forward(self, stream, envd: AsyncEnvdClient, size: tuple[int, int],
                       reconnected: bool) -> tuple[int, str]:
        async for event in stream:
            if event.kind == "start":
                self.pid = event.pid
                await self._remember(event.pid, self._tag)
                await self.send(text_data=json.dumps({"type": "ready", "pid": event.pid,
                                                      "reconnected": reconnected}))
                if reconnected:  # another window may have left another size
                    self.inputs.put_nowait(("resize", size))
                self._writer = asyncio.create_task(self._write_inputs(envd), name=f"terminal-{self.sandbox_id}-input")
            elif event.kind == "data" and event.data:
                await self.send(bytes_data=event.data)
            elif event.kind == "end":
                await self._forget()
                await self.send(text_data=json.dumps({"type": "exit", "exit_code": event.exit_code,
                                                      "status": event.status}))
                detail = f"exit code {event.exit_code}" + (f", {event.error}" if event.error else "")
                return CLOSE_EXITED, f"shell exited ({detail})"
        return CLOSE_UNREACHABLE, "the shell's output stream ended"

    async def _open(self, envd: AsyncEnvdClient, size: tuple[int, int]):
        """(event stream, reconnected): the remembered shell if it still runs with our
        tag, else a new one."""
        remembered = await self._recall()
        if remembered:
            pid, tag = remembered
            try:
                alive = await envd.tag_of(pid) == tag
            except EnvdError as exc:
                if exc.code != "not_found":
                    raise
                alive = False
            if alive:
                self._tag = tag
                return envd.connect(pid), True
        self._tag = "aenv-terminal-" + secrets.token_hex(8)
        return envd.start_pty(size[0], size[1], tag=self._tag), False

    async def _write_inputs(self, envd: AsyncEnvdClient) -> None:
        """Sends queued keystrokes (coalesced) and resizes to envd, in order."""
        while True:
            kind, value = await self.inputs.get()
            if kind == "input":
                data = bytearray(value)
                while not self.inputs.empty() and len(data) < MAX_INPUT_BATCH:
                    nxt_kind, nxt = self.inputs._queue[0]  # peek: keep resizes in order
                    if nxt_kind != "input":
                        break
                    self.inputs.get_nowait()
                    data += nxt
                call = envd.send_input(self.pid, bytes(data))
            else:
                call = envd.resize(self.pid, *value)
            try:
                await call
            except EnvdError as exc:
                # The output stream notices a dead process or VM and closes the socket.
                log.info("terminal %s: %s failed: %s", self.sandbox_id, kind, exc)

    async def _watch_state(self) -> tuple[int, str]:
        """Returns (close code, reason) once the sandbox leaves the running states."""
        while True:
            await asyncio.sleep(STATE_POLL_SECONDS)
            state = await _state_of(self.sandbox_id)
            if state not in TERMINAL_STATES:
                return CLOSE_NOT_RUNNING, gone_reason(state)

    # ------------------------------------------------------------------ session memory

    @database_sync_to_async
    def _recall(self) -> tuple[int, str] | None:
        value = self.scope["session"].get(session_key(self.sandbox_id))
        try:
            return int(value["pid"]), str(value["tag"])
        except (TypeError, KeyError, ValueError):
            return None

    @database_sync_to_async
    def _remember(self, pid: int, tag: str) -> None:
        session = self.scope["session"]
        session[session_key(self.sandbox_id)] = {"pid": pid, "tag": tag}
        session.save()

    @database_sync_to_async
    def _forget(self) -> None:
        session = self.scope["session"]
        if session.pop(session_key(self.sandbox_id), None) is not None:
            session.save()

