"""``aenv connect`` and the shell of an attached ``aenv start``: an interactive shell on
a PTY in the sandbox (envd's ``Process/Start`` with a PTY), driven from the local
terminal.

Three threads, so no wait holds up another:

- the main thread puts the terminal in raw mode (Ctrl-C, Ctrl-Z, Ctrl-\\ reach the remote
  shell as bytes) and sends keystrokes (``SendInput``) and window sizes (``Update``, on
  SIGWINCH);
- the pump reads the shell's output stream and writes it to stdout. When the stream
  breaks (a data plane restart, a network blip, silence past envd's keepalives) it
  re-attaches to the same shell with ``Process/Connect``; output produced meanwhile is
  lost, the shell and its state are not;
- the watchdog asks the API every few seconds whether the sandbox was paused or killed
  (the session then ends with 130) and, while the shell is used, extends the sandbox's
  time to live.

The exit status is the shell's. The local terminal is restored however the session
ends; SIGTERM / SIGHUP (a closed terminal window) also kill the remote shell, which
nobody could reach again, and nothing else: the sandbox stays."""
from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
from dataclasses import dataclass

from envd_client import EnvdClient, EnvdError, EnvdUnavailable
from envd_client.protocol import SHELL

from . import errors
from .api import check, client, segment
from .config import Config

LOST_AFTER = 15.0     # seconds of failing to re-attach before the session counts as lost
WATCH_EVERY = 3.0     # seconds between checks of the sandbox's state
REFRESH_EVERY = 60.0  # seconds between time-to-live extensions while the shell is used
STREAM_IDLE = 30.0    # seconds of silence (envd sends keepalives every 10 s) = a dead stream
INPUT_CHUNK = 4096
# TERM values every guest's terminfo knows; anything else becomes xterm-256color.
KNOWN_TERMS = ("xterm", "xterm-256color", "screen", "screen-256color", "tmux", "tmux-256color", "linux", "vt100",
               "vt220", "dumb")
DEFAULT_SHELLS = ((SHELL["cmd"], SHELL["args"]), ("/bin/sh", ["-l"]))


@dataclass(frozen=True)
class ShellOptions:
    shell: str | None = None  # a path, run without arguments; None: bash -i -l, else sh -l
    user: str | None = None
    cwd: str | None = None
    timeout: int = 300  # the time to live kept while the shell is used


def cmd_connect(args, config: Config) -> int:
    with client(config, timeout=300) as api:
        sandbox = check(api.post(f"/sandboxes/{segment(args.sandbox_id)}/connect",
                                 json={"timeout": args.timeout})).json()
    options = ShellOptions(shell=args.shell, user=args.user, cwd=args.cwd, timeout=args.timeout)
    return open_session(config, args.sandbox_id, sandbox.get("envdAccessToken"), options)


def open_session(config: Config, sandbox_id: str, token: str | None, options: ShellOptions, *,
                 stdin_fd: int = 0, stdout_fd: int = 1) -> int:
    """Runs the interactive session to its end; returns the exit status."""
    session = Session(config, sandbox_id, token, options, stdin_fd=stdin_fd, stdout_fd=stdout_fd)
    try:
        return session.run()
    finally:
        session.close()


def pty_envs(environ=None) -> dict:
    environ = os.environ if environ is None else environ
    term = environ.get("TERM", "")
    envs = {**SHELL["envs"], "TERM": term if term in KNOWN_TERMS else "xterm-256color"}
    if environ.get("COLORTERM"):
        envs["COLORTERM"] = environ["COLORTERM"]
    return envs


def terminal_size(*fds: int) -> tuple[int, int]:
    """(cols, rows) of the first of ``fds`` that is a terminal; 80×24 otherwise."""
    for fd in fds:
        try:
            size = os.get_terminal_size(fd)
            if size.columns and size.lines:
                return size.columns, size.lines
        except OSError:
            continue
    return 80, 24


class Session:
    def __init__(self, config: Config, sandbox_id: str, token: str | None, options: ShellOptions, *,
                 stdin_fd: int = 0, stdout_fd: int = 1):
        self.config, self.sandbox_id, self.options = config, sandbox_id, options
        self.stdin_fd, self.stdout_fd = stdin_fd, stdout_fd

        def envd() -> EnvdClient:
            return EnvdClient.through_proxy(config.sandbox_url, sandbox_id, token, stream_idle_timeout=STREAM_IDLE)

        self.pump_envd, self.input_envd = envd(), envd()  # one per thread
        self.api = client(config, timeout=5)
        self.api_lock = threading.Lock()
        self.pid: int | None = None
        self.size = terminal_size(stdout_fd, stdin_fd)
        self.started = threading.Event()
        self.attached = threading.Event()
        self.finished = threading.Event()
        self.finish_lock = threading.Lock()  # the output pump and the input loop both end sessions
        self.outcome: tuple[int, str | None] = (errors.FAILED, "the session ended unexpectedly")
        self.used = False  # input or output since the last time-to-live extension
        self.wake_r, self.wake_w = os.pipe()
        self.resized = False
        self.hung_up: int | None = None

    def close(self) -> None:
        """Closes the connections. The wake pipe stays open: the daemon threads may still
        write to it, and a closed descriptor's number could belong to a new file by then."""
        for closable in (self.pump_envd, self.input_envd, self.api):
            try:
                closable.close()
            except Exception:  # noqa: BLE001 - closing from another thread's middle is fine to fail
                pass

    # -- ending --------------------------------------------------------------------------------

    def finish(self, code: int, notice: str | None = None) -> None:
        """Ends the session (the first call wins)."""
        with self.finish_lock:
            if self.finished.is_set():
                return
            self.outcome = (code, notice)
            self.finished.set()
        self._wake(b"x")

    def _wake(self, byte: bytes) -> None:
        try:
            os.write(self.wake_w, byte)
        except OSError:
            pass

    def _fail(self, exc: BaseException) -> None:
        described = errors.describe(exc)
        if described is None:
            described = (f"{type(exc).__name__}: {exc}", errors.FAILED)
        self.finish(described[1], described[0])

    # -- the sandbox, through the API -------------------------------------------------------

    def sandbox_state(self) -> str | None:
        """running | paused | gone, or None when the API cannot say now."""
        try:
            with self.api_lock:
                resp = self.api.get(f"/sandboxes/{segment(self.sandbox_id)}")
        except Exception:  # noqa: BLE001 - the API unreachable: no verdict
            return None
        if resp.status_code == 404:
            return "gone"
        if resp.status_code != 200:
            return None
        return resp.json().get("state")

    def ended_by_state(self, state: str | None) -> bool:
        if state == "paused":
            self.finish(errors.INTERRUPTED, f"sandbox {self.sandbox_id} has been paused; "
                                            f"`aenv connect {self.sandbox_id}` resumes it")
        elif state == "gone":
            self.finish(errors.INTERRUPTED, f"sandbox {self.sandbox_id} no longer exists")
        else:
            return False
        return True

    def _refresh(self) -> None:
        try:
            with self.api_lock:
                self.api.post(f"/sandboxes/{segment(self.sandbox_id)}/refreshes",
                              json={"duration": self.options.timeout})
        except Exception:  # noqa: BLE001 - the next one may work
            pass

    def watch(self) -> None:
        last_refresh = time.monotonic()
        while not self.finished.wait(WATCH_EVERY):
            if self.ended_by_state(self.sandbox_state()):
                return
            if self.used and time.monotonic() - last_refresh >= REFRESH_EVERY:
                self.used = False
                last_refresh = time.monotonic()
                self._refresh()

    # -- output: the pump ---------------------------------------------------------------------

    def _start_shell(self):
        """The shell's event stream, after its start event (``self.pid`` set)."""
        shells = [(self.options.shell, [])] if self.options.shell else list(DEFAULT_SHELLS)
        for index, (cmd, args) in enumerate(shells):
            events = self.pump_envd.start(cmd, args, envs=pty_envs(), cwd=self.options.cwd, user=self.options.user,
                                          pty=self.size)
            try:
                for event in events:
                    if event.kind == "start":
                        self.pid = event.pid
                        return events
            except EnvdError as exc:
                missing = exc.code == "invalid_argument" and "failed to start process" in exc.message
                if missing and index + 1 < len(shells):
                    continue
                raise
            raise EnvdUnavailable("the shell's stream ended before it started")
        raise AssertionError("unreachable")

    def _drain(self, events) -> int:
        """Writes the shell's output until it ends; its exit status."""
        for event in events:
            if event.kind == "data" and event.data:
                self.used = True
                _write_all(self.stdout_fd, event.data)
            elif event.kind == "end":
                return errors.remote_exit_status(event.exit_code, event.status)
        raise EnvdUnavailable("the stream ended without the shell's end")

    def _reattach(self):
        """The shell's stream again (``Process/Connect``), or None once the session is over."""
        self.attached.clear()
        deadline = time.monotonic() + LOST_AFTER
        while not self.finished.is_set():
            if self.ended_by_state(self.sandbox_state()):
                return None
            try:
                events = self.pump_envd.connect(self.pid)
                for event in events:
                    if event.kind == "start":
                        self.attached.set()
                        return events
            except EnvdError as exc:
                if exc.code == "not_found":
                    self.finish(errors.FAILED, "the shell ended while the connection was down; its exit status "
                                               "is unknown")
                    return None
            if time.monotonic() >= deadline:
                self.finish(errors.INTERRUPTED, f"lost contact with sandbox {self.sandbox_id}; "
                                                f"`aenv connect {self.sandbox_id}` opens a new shell")
                return None
            time.sleep(0.5)
        return None

    def pump(self) -> None:
        try:
            events = self._start_shell()
            self.attached.set()
            self.started.set()
            self._wake(b"s")
            while events is not None:
                try:
                    self.finish(self._drain(events))
                    return
                except EnvdError:
                    if self.finished.is_set():
                        return
                    events = self._reattach()
        except BaseException as exc:  # noqa: BLE001 - reported as the session's end
            self._fail(exc)

    # -- input: the main thread -----------------------------------------------------------------

    def _send(self, data: bytes) -> None:
        for _ in range(2):
            try:
                self.input_envd.send_input(self.pid, data)
                self.used = True
                return
            except EnvdUnavailable:
                if not self.attached.wait(LOST_AFTER) or self.finished.is_set():
                    return
            except EnvdError:
                return  # the shell is gone: the pump reports how it ended

    def _resize(self) -> None:
        size = terminal_size(self.stdout_fd, self.stdin_fd)
        if size != self.size:
            self.size = size
            try:
                self.input_envd.resize(self.pid, *size)
            except EnvdError:
                pass

    def _on_signal(self, signum, _frame) -> None:
        if signum == signal.SIGWINCH:
            self.resized = True
        else:
            self.hung_up = signum
        self._wake(b"w")

    def _hang_up(self, signum: int) -> None:
        """The session's outcome is the signal's, decided before the remote shell is
        killed: the output pump would otherwise report the killed shell's 137 first."""
        self.finish(128 + signum, None)
        if self.pid is not None:
            try:
                self.input_envd.kill(self.pid)
            except EnvdError:
                pass

    def _loop(self) -> None:
        reading = True
        while not self.finished.is_set():
            fds = [self.wake_r] + ([self.stdin_fd] if reading and self.started.is_set() else [])
            ready, _, _ = select.select(fds, [], [], 1.0)
            if self.wake_r in ready:
                os.read(self.wake_r, 1024)
            if self.hung_up is not None:
                self._hang_up(self.hung_up)
                return
            if self.resized and self.started.is_set():
                self.resized = False
                self._resize()
            if self.stdin_fd in ready and not self.finished.is_set():
                data = os.read(self.stdin_fd, INPUT_CHUNK)
                if data:
                    self._send(data)
                else:  # stdin ended (a pipe): the shell gets an end of input once
                    reading = False
                    if not os.isatty(self.stdin_fd):
                        self._send(b"\x04")

    def run(self) -> int:
        tty_state = None
        if os.isatty(self.stdin_fd):
            import termios  # noqa: PLC0415
            import tty  # noqa: PLC0415

            tty_state = termios.tcgetattr(self.stdin_fd)
        handlers = {}
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            handlers = {sig: signal.signal(sig, self._on_signal)
                        for sig in (signal.SIGWINCH, signal.SIGTERM, signal.SIGHUP)}
        threading.Thread(target=self.pump, name="aenv-shell-output", daemon=True).start()
        threading.Thread(target=self.watch, name="aenv-shell-watchdog", daemon=True).start()
        try:
            if tty_state is not None:
                tty.setraw(self.stdin_fd)
            self._loop()
        except KeyboardInterrupt:  # not on a terminal (there Ctrl-C is a byte for the shell)
            self._hang_up(signal.SIGINT)
        finally:
            if tty_state is not None:
                termios.tcsetattr(self.stdin_fd, termios.TCSADRAIN, tty_state)
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        code, notice = self.outcome
        if notice:
            lead = "\r\x1b[2K" if os.isatty(2) else ""
            print(f"{lead}aenv: {notice}", file=sys.stderr, flush=True)
        return code


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]
