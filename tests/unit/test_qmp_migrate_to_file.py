"""vmm.qemu.qmp.migrate_to_file against a QMP stand-in that runs the migrate command the way
QEMU's ``exec:`` transport does (``/bin/sh -c``, the stream on its stdin) and says completed as
soon as the stream is written, before the writer has ended: a failed write (a full disk) must
not pass as a saved device state."""
from __future__ import annotations

import subprocess

import pytest

from vmm.qemu import qmp
from vmm.qemu.qmp import QMPError, migrate_to_file

STREAM = b"QEVM" + bytes(range(256)) * 64


class ExecTransport:
    def __init__(self):
        self.proc = None

    def execute(self, command, **args):
        if command == "migrate":
            assert args["uri"].startswith("exec:")
            self.proc = subprocess.Popen(["/bin/sh", "-c", args["uri"][len("exec:"):]], stdin=subprocess.PIPE)
            try:
                self.proc.stdin.write(STREAM)
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
            return {}
        if command == "query-migrate":
            return {"status": "completed"}  # QEMU's view: its pipe took every byte
        raise AssertionError(command)

    def reap(self):
        if self.proc is not None:
            self.proc.wait(timeout=30)


def test_a_written_state_is_saved_and_nothing_else_is_left(tmp_path):
    q = ExecTransport()
    path = tmp_path / "device.state"
    migrate_to_file(q, path)
    q.reap()
    assert path.read_bytes() == STREAM
    assert sorted(p.name for p in tmp_path.iterdir()) == ["device.state"]


def test_a_write_that_fails_is_no_saved_state(tmp_path):
    """/dev/full refuses every write with ENOSPC, as a full disk does."""
    q = ExecTransport()
    path = tmp_path / "device.state"
    path.symlink_to("/dev/full")
    with pytest.raises(QMPError, match="writing the file failed"):
        migrate_to_file(q, path)
    q.reap()


class SilentWriter(ExecTransport):
    """A writer that ends without a word (killed, or no room even for its status)."""

    def execute(self, command, **args):
        if command == "migrate":
            args["uri"] = args["uri"].split(";")[0]
        return super().execute(command, **args)


def test_a_writer_that_never_says_how_it_ended_is_an_error_in_bounded_time(tmp_path, monkeypatch):
    monkeypatch.setattr(qmp, "WRITER_EXIT_TIMEOUT", 0.5)
    q = SilentWriter()
    with pytest.raises(QMPError, match="did not say how it ended"):
        migrate_to_file(q, tmp_path / "device.state")
    q.reap()


class StuckIncoming:
    """An incoming QEMU that never leaves inmigrate (a host too loaded to schedule it)."""

    def __init__(self):
        self.commands = []

    def execute(self, command, **args):
        self.commands.append(command)
        if command == "query-status":
            return {"status": "inmigrate"}
        if command == "query-migrate":
            return {"status": "active"}
        return {}


def test_a_state_that_does_not_load_in_time_is_a_load_timeout_and_the_guest_never_runs(tmp_path):
    from vmm.driver import StateLoadTimeout

    q = StuckIncoming()
    with pytest.raises(StateLoadTimeout, match="still inmigrate after 0.2s"):
        qmp.migrate_from_file(q, tmp_path / "device.state", timeout=0.2)
    assert "cont" not in q.commands and q.commands[0] == "migrate-incoming"
