"""Spawn and supervise sandbox processes; fan their output out to RPC streams.

Processes outlive the stream that started them (a client disconnect only drops
a subscriber). Exit is observed through a pidfd (thread fallback) and the end
event is emitted after the output pipes reach EOF or a short grace period, so
clients see all output before ``end``.
"""

import asyncio
import errno
import fcntl
import grp
import logging
import os
import signal
import struct
import subprocess
import termios
import threading

from .connect import ConnectError

log = logging.getLogger("envd.processes")

PIPE_CHUNK = 32 * 1024
PTY_CHUNK = 16 * 1024
EOF_GRACE_SECONDS = 0.25
# Backpressure: stop reading a process's output while a subscriber lags this many chunks.
QUEUE_HIGH_WATER = 256
QUEUE_LOW_WATER = 32

# Go's wording for ProcessState.String(), which E2B clients display.
_SIGNAL_WORDS = {
    signal.SIGHUP: "hangup",
    signal.SIGINT: "interrupt",
    signal.SIGQUIT: "quit",
    signal.SIGILL: "illegal instruction",
    signal.SIGTRAP: "trace/breakpoint trap",
    signal.SIGABRT: "aborted",
    signal.SIGBUS: "bus error",
    signal.SIGFPE: "floating point exception",
    signal.SIGKILL: "killed",
    signal.SIGUSR1: "user defined signal 1",
    signal.SIGSEGV: "segmentation fault",
    signal.SIGUSR2: "user defined signal 2",
    signal.SIGPIPE: "broken pipe",
    signal.SIGALRM: "alarm clock",
    signal.SIGTERM: "terminated",
}


def exit_status(returncode):
    """Return ``(exit_code, exited, status, error)`` for a Popen returncode."""
    if returncode < 0:
        sig = -returncode
        word = _SIGNAL_WORDS.get(sig, f"signal {sig}")
        status = f"signal: {word}"
        return -1, False, status, status
    status = f"exit status {returncode}"
    return returncode, True, status, (status if returncode else None)


def set_winsize(fd, cols, rows):
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _set_nonblocking(fd):
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_NONBLOCK)


def _take_controlling_tty():
    """Child-side: make stdin (the pty slave) our controlling terminal."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Process:
    """One supervised child plus the state needed to stream and control it."""

    def __init__(self, manager, popen, config, tag, pty_master, stdin_fd, out_fds):
        self.manager = manager
        self.popen = popen
        self.pid = popen.pid
        self.config = config
        self.tag = tag
        self.pty_master = pty_master
        self._pty = pty_master is not None
        self.stdin_fd = stdin_fd
        self.stdin_enabled = stdin_fd is not None or pty_master is not None
        self.subscribers = set()
        self.returncode = None
        self.end = None  # (exit_code, exited, status, error) once finished
        self._open_fds = {}  # fd -> stream name ("stdout"/"stderr"/"pty")
        self._write_lock = asyncio.Lock()
        self._timer = None
        self._grace = None
        self._pidfd = None
        self._paused = False
        loop = manager.loop
        for fd, name in out_fds:
            _set_nonblocking(fd)
            self._open_fds[fd] = name
            loop.add_reader(fd, self._on_readable, fd)
        self._watch_exit()

    @property
    def is_pty(self):
        return self._pty

    # -- output -----------------------------------------------------------
    def subscribe(self):
        queue = asyncio.Queue()
        self.subscribers.add(queue)
        return queue

    def unsubscribe(self, queue):
        self.subscribers.discard(queue)
        self.consumed()

    def _broadcast(self, item):
        lagging = False
        for queue in list(self.subscribers):
            queue.put_nowait(item)
            lagging = lagging or queue.qsize() >= QUEUE_HIGH_WATER
        if lagging and not self._paused and item[0] == "data":
            self._paused = True  # the child blocks on a full pipe until clients catch up
            for fd in self._open_fds:
                self.manager.loop.remove_reader(fd)

    def consumed(self):
        """Called by stream readers after taking an item; resumes paused output."""
        if self._paused and all(q.qsize() <= QUEUE_LOW_WATER for q in self.subscribers):
            self._paused = False
            for fd in self._open_fds:
                self.manager.loop.add_reader(fd, self._on_readable, fd)

    def _on_readable(self, fd):
        name = self._open_fds.get(fd)
        if name is None:
            return
        size = PTY_CHUNK if name == "pty" else PIPE_CHUNK
        try:
            data = os.read(fd, size)
        except BlockingIOError:
            return
        except OSError as exc:
            if exc.errno != errno.EIO:  # EIO = pty slave closed
                log.warning("read from pid %s failed: %s", self.pid, exc)
            data = b""
        if data:
            self._broadcast(("data", name, data))
        else:
            self._close_output(fd)
            self._maybe_finish()

    def _close_output(self, fd):
        if self._open_fds.pop(fd, None) is None:
            return
        if not self._paused:
            self.manager.loop.remove_reader(fd)
        if fd == self.pty_master:
            return  # the master is also our input side; closed in _finish
        try:
            os.close(fd)
        except OSError:
            pass

    def _drain_and_close_outputs(self):
        for fd in list(self._open_fds):
            name = self._open_fds[fd]
            for _ in range(64):  # bounded: a background child may keep writing
                try:
                    data = os.read(fd, PTY_CHUNK if name == "pty" else PIPE_CHUNK)
                except OSError:
                    break
                if not data:
                    break
                self._broadcast(("data", name, data))
            self._close_output(fd)

    # -- exit -------------------------------------------------------------
    def _watch_exit(self):
        loop = self.manager.loop
        try:
            self._pidfd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            self._pidfd = None
        if self._pidfd is not None:
            loop.add_reader(self._pidfd, self._on_exit_ready)
            return

        def wait_thread():
            code = self.popen.wait()
            loop.call_soon_threadsafe(self._on_exited, code)

        threading.Thread(target=wait_thread, name=f"wait-{self.pid}", daemon=True).start()

    def _on_exit_ready(self):
        code = self.popen.poll()
        if code is None:
            return
        self.manager.loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        self._pidfd = None
        self._on_exited(code)

    def _on_exited(self, code):
        self.returncode = code
        if self._open_fds:
            # Grandchildren may keep the pipes open; don't wait for them forever.
            self._grace = self.manager.loop.call_later(EOF_GRACE_SECONDS, self._grace_expired)
        self._maybe_finish()

    def _grace_expired(self):
        self._grace = None
        self._drain_and_close_outputs()
        self._maybe_finish()

    def _maybe_finish(self):
        if self.returncode is None or self._open_fds or self.end is not None:
            return
        self._finish()

    def _finish(self):
        self.end = exit_status(self.returncode)
        for handle in (self._timer, self._grace):
            if handle is not None:
                handle.cancel()
        for fd in (self.stdin_fd, self.pty_master):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.stdin_fd = None
        self.pty_master = None
        self.manager.forget(self)
        self._broadcast(("end", self.end))

    # -- control ----------------------------------------------------------
    def set_lifetime(self, seconds):
        """Kill the process after ``seconds`` (E2B uses the call deadline as lifetime)."""
        if seconds is not None:
            self._timer = self.manager.loop.call_later(seconds, self.signal, signal.SIGKILL)

    def signal(self, sig):
        if self.end is not None:
            return
        try:
            os.killpg(self.pid, sig)
        except OSError:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    async def write_input(self, data, kind):
        """Write stdin bytes (``kind`` "stdin") or terminal bytes (``kind`` "pty")."""
        if self.end is not None:
            raise ConnectError("not_found", f"process with pid {self.pid} not found")
        if kind == "pty":
            if not self.is_pty:
                raise ConnectError("failed_precondition", "process has no pty; send stdin instead")
            fd = self.pty_master
        else:
            if self.is_pty:
                raise ConnectError("failed_precondition", "process has a pty; send pty input instead")
            if not self.stdin_enabled:
                raise ConnectError("failed_precondition", "stdin is not enabled for this process")
            fd = self.stdin_fd
            if fd is None:
                raise ConnectError("failed_precondition", "stdin is already closed")
        async with self._write_lock:
            await _write_all(self.manager.loop, fd, data)

    async def close_stdin(self):
        if self.is_pty:
            raise ConnectError("failed_precondition", "cannot close stdin of a pty process")
        async with self._write_lock:
            fd, self.stdin_fd = self.stdin_fd, None
            if fd is not None:
                os.close(fd)

    def resize(self, cols, rows):
        if not self.is_pty or self.end is not None:
            raise ConnectError("failed_precondition", "process has no pty")
        set_winsize(self.pty_master, cols, rows)


async def _write_all(loop, fd, data):
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
            view = view[n:]
        except BlockingIOError:
            ready = loop.create_future()
            loop.add_writer(fd, lambda: ready.done() or ready.set_result(None))
            try:
                await ready
            finally:
                loop.remove_writer(fd)
        except BrokenPipeError:
            raise ConnectError("failed_precondition", "process stdin is closed") from None


class ProcessManager:
    """Table of running processes, keyed by pid."""

    def __init__(self, loop):
        self.loop = loop
        self.processes = {}

    def kill_all(self):
        for proc in list(self.processes.values()):
            proc.signal(signal.SIGKILL)

    def forget(self, proc):
        self.processes.pop(proc.pid, None)

    def get(self, pid=None, tag=None):
        if tag:
            for proc in self.processes.values():
                if proc.tag == tag:
                    return proc
            raise ConnectError("not_found", f"process with tag {tag} not found")
        proc = self.processes.get(pid)
        if proc is None:
            raise ConnectError("not_found", f"process with pid {pid} not found")
        return proc

    def start(self, config, pw, env, cwd, pty_size=None, stdin=True, tag=None):
        """Spawn ``config.cmd config.args`` as user ``pw``; returns the Process."""
        argv = [config.cmd, *config.args]
        kwargs = dict(env=env, cwd=cwd, close_fds=True, start_new_session=True)
        if os.geteuid() == 0 and pw.pw_uid != os.geteuid():
            kwargs.update(user=pw.pw_uid, group=pw.pw_gid,
                          extra_groups=[g for g in os.getgrouplist(pw.pw_name, pw.pw_gid)])
        elif os.geteuid() != pw.pw_uid:
            raise ConnectError("permission_denied", f"envd is not root; cannot run as {pw.pw_name}")
        pty_master = stdin_fd = None
        try:
            if pty_size is not None:
                pty_master, slave = os.openpty()
                try:
                    set_winsize(slave, pty_size[0] or 80, pty_size[1] or 24)
                    if os.geteuid() == 0:
                        os.fchown(slave, pw.pw_uid, _tty_gid(pw.pw_gid))
                    popen = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave,
                                             preexec_fn=_take_controlling_tty, **kwargs)
                finally:
                    os.close(slave)
                out_fds = [(pty_master, "pty")]
            else:
                popen = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)
                if popen.stdin is not None:
                    stdin_fd = os.dup(popen.stdin.fileno())
                    popen.stdin.close()
                    _set_nonblocking(stdin_fd)
                out_fds = [(os.dup(popen.stdout.fileno()), "stdout"), (os.dup(popen.stderr.fileno()), "stderr")]
                popen.stdout.close()
                popen.stderr.close()
        except (FileNotFoundError, PermissionError, NotADirectoryError) as exc:
            if pty_master is not None:
                os.close(pty_master)
            raise ConnectError("invalid_argument", f"failed to start process: {exc}") from None
        proc = Process(self, popen, config, tag, pty_master, stdin_fd, out_fds)
        self.processes[proc.pid] = proc
        return proc


def _tty_gid(default):
    try:
        return grp.getgrnam("tty").gr_gid
    except KeyError:
        return default
