"""A build's log as the builder writes it: lines buffered briefly and appended in batches
through ``template_builds.progress`` (one transaction per batch, not per line: a ``pip
install`` prints hundreds), so the SDK's polling and the dashboard see them within a
fraction of a second. The append is also how the builder learns the build was cancelled
(template deleted, timed out): it then calls ``on_cancel`` (which kills the build VM, so
a running command stops at once) and raises ``Cancelled`` at the next line. A command that
prints nothing (``sleep 600``) is checked on too, every ``CHECK_SECONDS``, with an empty
append.

The build VM runs the user's image and commands, so what it prints is a hostile guest's
output: a ``RUN yes`` must not fill the control plane's database for the build's hour.
Command output past ``max_output_bytes`` (``AENV_BUILD_LOG_MAX_MB``) is counted, not kept;
one line says so when the cap is reached and one at the end says how much was left out,
and the newest lines stay in ``tail`` for a failed command's reason."""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from datetime import datetime, timezone

log = logging.getLogger(__name__)

FLUSH_SECONDS = 0.25
CHECK_SECONDS = 2.0  # how soon a build whose command is silent learns it was cancelled
MAX_BATCH = 200
TAIL_LINES = 8  # the last output lines a failed command's reason quotes
MAX_OUTPUT_BYTES = 16 * 1024 * 1024  # command output kept per build (AENV_BUILD_LOG_MAX_MB)


class Cancelled(Exception):
    """The build is no longer building (cancelled, timed out or failed elsewhere)."""


class BuildLog:
    def __init__(self, build_id: str, append, on_cancel=lambda: None, max_output_bytes: int = MAX_OUTPUT_BYTES):
        """``append(build_id, [(level, message, step, timestamp)])`` → False once the build
        is no longer building (``template_builds.progress.report_many``)."""
        self.build_id = build_id
        self.max_output_bytes = max_output_bytes
        self.output_bytes = 0  # command output seen, kept or not
        self.dropped_lines = self.dropped_bytes = 0
        self._append = append
        self._on_cancel = on_cancel
        self._pending: list[tuple] = []
        self._lock = threading.Lock()
        self._flushing = threading.Lock()
        self._last = self._checked = time.monotonic()
        self.cancelled = False
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)  # the newest command output lines
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"build-log-{build_id[:8]}", daemon=True)
        self._thread.start()

    def __call__(self, level: str, message: str, step: str = "") -> None:
        if self.cancelled:
            raise Cancelled("the build was cancelled")
        with self._lock:
            self._pending.append((level, message, step, datetime.now(timezone.utc)))
            full = len(self._pending) >= MAX_BATCH
        if full:
            self.flush()

    def info(self, message: str, step: str = "") -> None:
        self(level="info", message=message, step=step)

    def output(self, stream: str, line: str, prefix: str, step: str) -> None:
        """A line a command printed: ``<prefix> [stdout]: line``; kept in the tail, and in
        the log while the build's output is under its cap."""
        self.tail.append(line)
        size = len(line.encode("utf-8", "replace")) + 1
        self.output_bytes += size
        if self.output_bytes > self.max_output_bytes:
            if not self.dropped_lines:
                self(level="warn", step=step, message=(
                    f"the build's commands printed more than {self.max_output_bytes // (1024 * 1024)} MiB: "
                    "further output is not kept in the log (the build goes on; a failed command's last "
                    "lines are still quoted)"))
            self.dropped_lines += 1
            self.dropped_bytes += size
            if self.cancelled:
                raise Cancelled("the build was cancelled")
            return
        self(level="info" if stream == "stdout" else "warn", message=f"{prefix} [{stream}]: {line}", step=step)

    def flush(self, check: bool = False) -> bool:
        """Writes what is pending (with ``check``, also when nothing is: the append then only
        asks whether the build still runs); False (and ``on_cancel`` called once) once the
        build is no longer building."""
        with self._flushing:
            with self._lock:
                batch, self._pending = self._pending, []
            self._last = time.monotonic()
            if (not batch and not check) or self.cancelled:
                return not self.cancelled
            self._checked = self._last
            try:
                ok = self._append(self.build_id, batch)
            except Exception:  # noqa: BLE001 - a database hiccup must not end the build; retried
                log.exception("build %s: appending %d log lines failed", self.build_id, len(batch))
                with self._lock:
                    self._pending = batch + self._pending
                return True
            if not ok:
                self.cancelled = True
                try:
                    self._on_cancel()
                except Exception:  # noqa: BLE001
                    log.exception("build %s: cancel hook failed", self.build_id)
            return ok

    def _run(self) -> None:
        """The flusher thread. Its appends open a database connection of its own, which it
        closes as it ends: left open, a pooled connection (PostgreSQL) would stay taken for
        good, one per build, until the node's pool ran dry."""
        from django.db import connections

        try:
            while not self._stop.wait(FLUSH_SECONDS):
                now = time.monotonic()
                if now - self._last >= FLUSH_SECONDS:
                    self.flush(check=now - self._checked >= CHECK_SECONDS)
        finally:
            connections.close_all()

    def close(self) -> bool:
        self._stop.set()
        self._thread.join(5)
        if self.dropped_lines and not self.cancelled:
            with self._lock:
                self._pending.append(("warn", f"{self.dropped_lines} lines ({self.dropped_bytes} bytes) of command "
                                      "output were not kept in the log", "", datetime.now(timezone.utc)))
        return self.flush()


class LineSplitter:
    """Bytes as a command prints them → whole lines (a partial last line is kept for the
    next chunk; ``close`` gives it)."""

    def __init__(self, emit):
        self._emit = emit
        self._buf = b""

    def feed(self, data: bytes) -> None:
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        for line in lines:
            self._emit(line.rstrip(b"\r").decode("utf-8", "replace"))
        if len(self._buf) > 16384:  # a huge line without a newline: emit it in pieces
            self._emit(self._buf.decode("utf-8", "replace"))
            self._buf = b""

    def close(self) -> None:
        if self._buf:
            self._emit(self._buf.decode("utf-8", "replace"))
            self._buf = b""
