"""The sandbox log collector: the node reads each of its VMs' serial console — where the
guest kernel, aenv's guest init and envd write their log lines — and stores the new lines
as ``SandboxLog`` rows, which the API serves as E2B's ``GET /sandboxes/{id}/logs`` and
``/v2/sandboxes/{id}/logs`` (the E2B CLI's ``sandbox logs``).

Why on the node: only the node has the console files (the driver's ``console_path``), and
they go away with the VM (a kill removes its state dir; a resume or restore starts a new
file), so the node reads them as it goes — every ``AENV_SANDBOX_LOGS_INTERVAL`` seconds
for its running sandboxes, and once more right before it pauses or kills one — and the
database keeps them for paused and killed sandboxes alike.

A guest is hostile: it may write without end. Each round first has the driver trim the
console file to its newest ``AENV_CONSOLE_LOG_MAX_KB`` (the node's disk; what was cut is a
hole that reading skips, so a guest that floods loses its oldest unread lines, never the
newest), then reads at most ``READ_BYTES`` of it (the rest waits for the next round); a line
is split every ``MAX_LINE_BYTES``, and a sandbox keeps its newest
``AENV_SANDBOX_LOG_MAX_LINES`` lines; lines older than
``AENV_SANDBOX_LOGS_RETENTION`` seconds are deleted. Where reading resumes is stored with
each line (the VM generation and the byte offset where the line ended), so a node worker
that restarts neither loses nor repeats lines.
"""
from __future__ import annotations

import errno
import logging
import os
import re
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from django.conf import settings
from django.db.models import Max
from django.utils import timezone

from sandboxes.models import Sandbox, SandboxLog
from sandboxes.states import SandboxState

from agent.periodic import Periodic

log = logging.getLogger(__name__)

READ_BYTES = 256 * 1024
MAX_LINE_BYTES = 4096
PRUNE_EVERY = 30  # rounds between retention deletes
STEP = timedelta(milliseconds=1)
# Sandboxes whose console is read every round: a VM runs and its generation is settled (a
# creating or resuming sandbox's new VM is read once its route, and generation, are written).
COLLECTED = (SandboxState.RUNNING, SandboxState.SNAPSHOTTING, SandboxState.FORKING)

# envd's own format (envd.server: "%(asctime)s %(levelname)s %(name)s: %(message)s"), and
# uvicorn's ("INFO:     Uvicorn running on …"), both written to the console by the guest init.
ENVD_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) ([\w.\-]+): (.*)$")
UVICORN_LINE = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL):\s+(.*)$")
KERNEL_LINE = re.compile(r"^\[\s*\d+\.\d+\] ")
LEVELS = {"DEBUG": "debug", "INFO": "info", "WARNING": "warn", "ERROR": "error", "CRITICAL": "error"}
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@dataclass(frozen=True)
class Line:
    line: str
    message: str
    level: str = "info"
    source: str = "console"
    logger: str = "console"


def parse(text: str) -> Line:
    """What one console line is: envd's (its level and logger), the guest init's, the
    kernel's, or anything else the guest wrote there (``console``, level ``info``)."""
    text = ANSI.sub("", text).rstrip("\r")
    m = ENVD_LINE.match(text)
    if m:
        return Line(text, m.group(3), LEVELS[m.group(1)], "envd", m.group(2)[:64])
    m = UVICORN_LINE.match(text)
    if m:
        return Line(text, m.group(2), LEVELS[m.group(1)], "envd", "uvicorn")
    if text.startswith("aenv-init: "):
        return Line(text, text[len("aenv-init: "):], "info", "console", "init")
    if KERNEL_LINE.match(text):
        return Line(text, text, "info", "console", "kernel")
    return Line(text, text)


def split(data: bytes, final: bool) -> tuple[list[tuple[bytes, int]], int]:
    """The complete lines of ``data`` with the offset (into ``data``) where each ends, and
    how many bytes they take. An unterminated tail waits for its newline unless ``final``
    (the VM is about to go) or it is already ``MAX_LINE_BYTES`` long; a longer line is split."""
    lines, start = [], 0
    while start < len(data):
        end = data.find(b"\n", start, start + MAX_LINE_BYTES + 1)
        if end < 0:
            rest = len(data) - start
            if not final and rest < MAX_LINE_BYTES:
                break
            end = min(len(data), start + MAX_LINE_BYTES)
            lines.append((data[start:end], end))
            start = end
            continue
        lines.append((data[start:min(end, start + MAX_LINE_BYTES)], end + 1))
        start = end + 1
    return lines, start


def data_from(fd: int, offset: int) -> int:
    """Where the file's data starts again at or after ``offset`` (a trimmed console begins
    with a hole); ``offset`` where the filesystem cannot tell."""
    try:
        return os.lseek(fd, offset, os.SEEK_DATA)
    except OSError as e:
        return os.fstat(fd).st_size if e.errno == errno.ENXIO else offset


class ConsoleLogs:
    """Reads consoles into SandboxLog rows; one per node process (``collector()``), shared
    by its round thread and its pause / kill tasks (serialized by a lock)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._offsets: dict[tuple[str, int], int] = {}
        self._last: dict[str, datetime] = {}

    def collect(self, sandbox_id: str, generation: int, path: Path | None, *, final: bool = False) -> int:
        """Stores the console lines written since the last read; returns how many."""
        if path is None:
            return 0
        with self._lock:
            return self._collect(sandbox_id, generation, Path(path), final)

    def bound(self, driver, sandbox_id: str) -> int:
        """Has the driver trim the sandbox's console file to its newest bytes (between reads,
        so a read never meets a hole punched under it); returns the bytes freed."""
        with self._lock:
            return driver.trim_console(sandbox_id, int(settings.AENV_CONSOLE_LOG_MAX_KB) << 10)

    def _collect(self, sandbox_id: str, generation: int, path: Path, final: bool) -> int:
        key = (sandbox_id, generation)
        offset = self._offsets.get(key)
        if offset is None:
            offset = (SandboxLog.objects.filter(sandbox_id=sandbox_id, vm_generation=generation)
                      .aggregate(m=Max("offset"))["m"] or 0)
        try:
            with open(path, "rb") as f:
                size = f.seek(0, 2)
                if size < offset:  # the file began anew under the same generation: read it all
                    offset = 0
                offset = max(offset, data_from(f.fileno(), offset))  # past what bound() cut unread
                f.seek(offset)
                data = f.read(READ_BYTES)
        except FileNotFoundError:
            return 0
        lines, used = split(data, final and len(data) < READ_BYTES)
        self._offsets[key] = offset + used
        if not lines:
            return 0
        last = self._last.get(sandbox_id)
        if last is None:
            last = SandboxLog.objects.filter(sandbox_id=sandbox_id).aggregate(m=Max("timestamp"))["m"]
        at = timezone.now()
        rows = []
        for raw, end in lines:
            at = max(at, last + STEP) if last is not None else at
            last = at
            parsed = parse(raw.decode("utf-8", "replace"))
            rows.append(SandboxLog(sandbox_id=sandbox_id, timestamp=at, level=parsed.level, message=parsed.message,
                                   line=parsed.line, source=parsed.source, logger=parsed.logger,
                                   vm_generation=generation, offset=offset + end))
        SandboxLog.objects.bulk_create(rows, ignore_conflicts=True)
        self._last[sandbox_id] = last
        self._cap(sandbox_id)
        return len(rows)

    @staticmethod
    def _cap(sandbox_id: str) -> None:
        keep = int(settings.AENV_SANDBOX_LOG_MAX_LINES)
        oldest_kept = (SandboxLog.objects.filter(sandbox_id=sandbox_id).order_by("-timestamp")
                       .values_list("timestamp", flat=True)[keep - 1:keep])
        cutoff = list(oldest_kept)
        if cutoff:
            SandboxLog.objects.filter(sandbox_id=sandbox_id, timestamp__lt=cutoff[0]).delete()

    def forget(self, sandbox_id: str) -> None:
        with self._lock:
            self._last.pop(sandbox_id, None)
            for key in [k for k in self._offsets if k[0] == sandbox_id]:
                del self._offsets[key]


_collector: ConsoleLogs | None = None
_collector_lock = threading.Lock()


def collector() -> ConsoleLogs:
    global _collector
    with _collector_lock:
        if _collector is None:
            _collector = ConsoleLogs()
        return _collector


def flush(driver, sandbox_id: str, *, gone: bool = False) -> None:
    """The console's last lines, read before the node pauses or kills the VM (its file
    goes with the VM; ``gone``: for good, so its reading positions are forgotten); never
    fails the operation."""
    try:
        path = driver.console_path(sandbox_id)
        generation = None if path is None else (
            Sandbox.objects.filter(pk=sandbox_id).values_list("vm_generation", flat=True).first())
        if generation is not None:
            collector().collect(sandbox_id, generation, path, final=True)
    except Exception:  # noqa: BLE001 - logs are best effort; the pause or kill goes on
        log.exception("reading the console of %s before it stops failed", sandbox_id)
    if gone:
        collector().forget(sandbox_id)


def prune(retention_s: float) -> int:
    deleted, _ = SandboxLog.objects.filter(timestamp__lt=timezone.now() - timedelta(seconds=retention_s)).delete()
    return deleted


class ConsoleCollector(Periodic):
    """Reads the consoles of the node's running sandboxes every ``interval`` seconds until
    stopped; never dies on a database or file error."""

    def __init__(self, node_id: str, driver, interval: float, retention_s: float):
        super().__init__(f"console-logs-{node_id}", interval, at_once=True)
        self.node_id, self.driver, self.retention_s = node_id, driver, retention_s
        self._rounds = 0

    def collect_once(self) -> int:
        rows = list(Sandbox.objects.filter(node_id=self.node_id, state__in=COLLECTED)
                    .values_list("id", "vm_generation"))
        logs, stored = collector(), 0
        for sandbox_id, generation in rows:
            try:
                logs.bound(self.driver, sandbox_id)
                stored += logs.collect(sandbox_id, generation, self.driver.console_path(sandbox_id))
            except Exception:  # noqa: BLE001 - one sandbox's trouble is not the others'
                log.exception("reading the console of %s failed", sandbox_id)
        self._rounds += 1
        if self.retention_s and self._rounds % PRUNE_EVERY == 1:
            prune(self.retention_s)
        return stored

    def round(self) -> None:
        self.collect_once()
