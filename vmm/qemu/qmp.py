"""Minimal synchronous QMP client over a VM's unix socket.

Why: quit, stop/cont, device-state migrate (x-ignore-shared) and blockdev snapshots for the
lifecycle verbs of the QEMU driver. One short-lived
connection per use keeps it safe across worker restarts.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

from vmm.driver import StateLoadTimeout, VMError


class QMPError(VMError):
    """QMP returned an error or the socket failed (a VMError: verbs may let it through)."""


class QMP:
    def __init__(self, path: Path, timeout: float = 5.0):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(str(path))
        except OSError as e:
            self.sock.close()
            raise QMPError(f"cannot connect to {path}: {e}") from e
        self.file = self.sock.makefile("rb")
        self.events: list[dict] = []  # asynchronous events seen while waiting for replies (STOP, RESUME, ...)
        try:
            self._read()  # greeting (late while another client holds the monitor: it takes one)
            self.execute("qmp_capabilities")
        except BaseException:
            self.close()
            raise

    def _read(self) -> dict:
        while True:
            line = self.file.readline()
            if not line:
                raise QMPError("QMP connection closed")
            msg = json.loads(line)
            if "event" not in msg:
                return msg
            if len(self.events) < 1000:
                self.events.append(msg)

    def execute(self, command: str, **arguments) -> object:
        req = {"execute": command}
        if arguments:
            req["arguments"] = arguments
        self.sock.sendall(json.dumps(req).encode() + b"\n")
        reply = self._read()
        if "error" in reply:
            raise QMPError(f"{command}: {reply['error'].get('desc', reply['error'])}")
        return reply.get("return")

    def close(self) -> None:
        try:
            self.file.close()
        finally:
            self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# -- lifecycle helpers (qemu-feasibility §4 recipe B, §5, §6) ------------------------------------

MAX_BANDWIDTH = 100 << 30  # bytes/s; the default cap makes any RAM in the stream ~6x slower


def prepare_migration(q: QMP) -> None:
    """x-ignore-shared (share=on RAM is skipped: the RAM file is the memory snapshot) and no
    bandwidth cap. Set on every VM at spawn, sources and destinations alike."""
    q.execute("migrate-set-capabilities",
              capabilities=[{"capability": "x-ignore-shared", "state": True}])
    q.execute("migrate-set-parameters", **{"max-bandwidth": MAX_BANDWIDTH})


def set_ignore_shared(q: QMP, on: bool) -> None:
    """Toggles x-ignore-shared (only between migrations). Off makes the stream carry every RAM
    block and drops the per-block address field, so a share=on destination loads the RAM into
    its file instead of expecting it to be there already."""
    q.execute("migrate-set-capabilities", capabilities=[{"capability": "x-ignore-shared", "state": on}])


def _shell_path(path: Path) -> str:
    import shlex

    return shlex.quote(str(path))


# How long the writer may take to say how it ended once QEMU says it sent everything (cat
# reads the pipe's last bytes and exits: milliseconds; longer only if its status cannot be
# written either, on a disk with no room at all).
WRITER_EXIT_TIMEOUT = 10.0


def migrate_to_file(q: QMP, path: Path, timeout: float = 60.0) -> None:
    """Saves the (stopped) VM's device state to `path`: QEMU says completed once it wrote all of
    it into its pipe to ``cat``, whose own failure (a full disk: a short file) QEMU never sees,
    so the command also writes cat's exit status beside the file and a state counts as saved
    only when that says 0 (issue 27's chaos: a short device state hung its resume)."""
    import time

    status_file = path.with_name(path.name + ".exit")
    status_file.unlink(missing_ok=True)
    q.execute("migrate", uri=f"exec:cat > {_shell_path(path)}; echo $? > {_shell_path(status_file)}")
    deadline = time.monotonic() + timeout
    while True:
        status = q.execute("query-migrate").get("status")
        if status == "completed":
            break
        if status in ("failed", "cancelled"):
            raise QMPError(f"migrate to {path}: {status}")
        if time.monotonic() > deadline:
            raise QMPError(f"migrate to {path}: still {status} after {timeout}s")
        time.sleep(0.001)
    deadline = time.monotonic() + WRITER_EXIT_TIMEOUT
    while True:
        try:
            written = status_file.read_text()
        except FileNotFoundError:
            written = ""
        if written.endswith("\n"):
            break
        if time.monotonic() > deadline:
            raise QMPError(f"migrate to {path}: its writer did not say how it ended within {WRITER_EXIT_TIMEOUT}s")
        time.sleep(0.001)
    status_file.unlink(missing_ok=True)
    if written.strip() != "0":
        raise QMPError(f"migrate to {path}: writing the file failed (cat exit status {written.strip()})")


def migrate_from_file(q: QMP, path: Path, timeout: float = 60.0, before_cont=None) -> None:
    """On a `-incoming defer -S` VM: loads the device state from `path`, calls `before_cont()`
    (the VM is loaded but stopped), then makes sure it runs. Not loaded within ``timeout``:
    StateLoadTimeout (the guest has not run)."""
    import time

    q.execute("migrate-incoming", uri=f"exec:cat {_shell_path(path)}")
    deadline = time.monotonic() + timeout
    while True:
        status = q.execute("query-status").get("status")
        if status == "running":
            return
        if status in ("paused", "postmigrate", "prelaunch"):
            mig = q.execute("query-migrate").get("status")
            if mig == "completed":
                if before_cont is not None:
                    before_cont()
                    before_cont = None
                q.execute("cont")
                continue
        if status in ("internal-error", "shutdown", "guest-panicked"):
            raise QMPError(f"incoming from {path}: VM status {status}")
        mig = q.execute("query-migrate").get("status")
        if mig in ("failed", "cancelled"):
            raise QMPError(f"incoming from {path}: migration {mig}")
        if time.monotonic() > deadline:  # the guest has not run: what was saved is intact
            raise StateLoadTimeout(f"incoming from {path}: still {status} after {timeout}s")
        time.sleep(0.001)
