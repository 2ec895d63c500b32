"""The node's console log collector (agent.console_logs) against console files it reads
as a VM writes them, with the database of the tests."""
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from agent import console_logs
from agent.console_logs import MAX_LINE_BYTES, ConsoleCollector, ConsoleLogs, parse, split
from sandboxes.models import Sandbox, SandboxLog, Team, Template

pytestmark = pytest.mark.django_db


def test_lines_are_told_apart():
    envd = parse("2026-12-02 03:00:00,123 WARNING envd.files: disk almost full")
    assert (envd.source, envd.logger, envd.level, envd.message) == ("envd", "envd.files", "warn", "disk almost full")
    assert parse("ERROR:    Exception in ASGI application").level == "error"
    assert parse("ERROR:    Exception in ASGI application").logger == "uvicorn"
    init = parse("aenv-init: starting envd (uptime 0.91s)\r")
    assert (init.logger, init.message, init.line) == ("init", "starting envd (uptime 0.91s)",
                                                       "aenv-init: starting envd (uptime 0.91s)")
    assert parse("[    1.234567] virtio_blk virtio0: 1/0/0 queues").logger == "kernel"
    other = parse("\x1b[31mhello from a guest\x1b[0m")
    assert (other.source, other.level, other.message) == ("console", "info", "hello from a guest")


def test_split_waits_for_a_newline_and_splits_long_lines():
    assert split(b"a\nbb\ncc", final=False) == ([(b"a", 2), (b"bb", 5)], 5)
    assert split(b"a\nbb\ncc", final=True) == ([(b"a", 2), (b"bb", 5), (b"cc", 7)], 7)
    long = b"x" * (MAX_LINE_BYTES + 10) + b"\nnext\n"
    lines, used = split(long, final=False)
    assert [len(raw) for raw, _ in lines] == [MAX_LINE_BYTES, 10, 4] and used == len(long)  # split, nothing lost
    endless = b"y" * (MAX_LINE_BYTES * 2 + 5)
    lines, used = split(endless, final=False)  # a guest that never writes a newline is cut too
    assert [len(raw) for raw, _ in lines] == [MAX_LINE_BYTES, MAX_LINE_BYTES] and used == 2 * MAX_LINE_BYTES


@pytest.fixture
def sandbox(db):
    team = Team.objects.create(slug="logs", name="logs")
    template, _ = Template.objects.get_or_create(id="base")
    return Sandbox.objects.create(team=team, template=template, state="running",
                                  end_at=timezone.now() + timedelta(minutes=5))


def _lines(sandbox) -> list[str]:
    return list(SandboxLog.objects.filter(sandbox=sandbox).order_by("timestamp", "id").values_list("line", flat=True))


def test_collect_reads_only_what_is_new_and_resumes_after_a_restart(sandbox, tmp_path):
    console = tmp_path / "console.log"
    console.write_bytes(b"[    0.100000] Linux version 6.1\naenv-init: starting envd\npart")
    logs = ConsoleLogs()
    assert logs.collect(sandbox.id, 0, console) == 2
    with console.open("ab") as f:
        f.write(b"ial line\n2026-12-02 03:00:00,001 INFO envd: started\n")
    assert logs.collect(sandbox.id, 0, console) == 2
    assert logs.collect(sandbox.id, 0, console) == 0
    # a node worker that restarts reads on from what the database holds: nothing twice
    with console.open("ab") as f:
        f.write(b"after the restart\n")
    assert ConsoleLogs().collect(sandbox.id, 0, console) == 1
    assert _lines(sandbox) == ["[    0.100000] Linux version 6.1", "aenv-init: starting envd", "partial line",
                               "2026-12-02 03:00:00,001 INFO envd: started", "after the restart"]
    stamps = list(SandboxLog.objects.filter(sandbox=sandbox).order_by("id").values_list("timestamp", flat=True))
    assert all(b - a >= timedelta(milliseconds=1) for a, b in zip(stamps, stamps[1:]))  # strictly increasing


def test_a_new_vm_generation_starts_its_console_anew(sandbox, tmp_path):
    console = tmp_path / "console.log"
    console.write_bytes(b"first vm\nunterminated")
    logs = ConsoleLogs()
    logs.collect(sandbox.id, 0, console)
    assert logs.collect(sandbox.id, 0, console, final=True) == 1  # before a pause: the tail too
    console.write_bytes(b"second vm\n")  # a resume: a new QEMU truncates the file
    assert logs.collect(sandbox.id, 1, console) == 1
    assert _lines(sandbox) == ["first vm", "unterminated", "second vm"]
    assert logs.collect(sandbox.id, 7, tmp_path / "missing.log") == 0
    assert logs.collect(sandbox.id, 7, None) == 0


def test_two_readers_store_each_line_once(sandbox, tmp_path):
    console = tmp_path / "console.log"
    console.write_bytes(b"one\ntwo\n")
    ConsoleLogs().collect(sandbox.id, 0, console)
    ConsoleLogs().collect(sandbox.id, 0, console)  # e.g. the round thread and a pause task
    assert _lines(sandbox) == ["one", "two"]


def test_a_flooding_guest_is_bounded(sandbox, tmp_path, settings, monkeypatch):
    settings.AENV_SANDBOX_LOG_MAX_LINES = 50
    monkeypatch.setattr(console_logs, "READ_BYTES", 1000)
    console = tmp_path / "console.log"
    console.write_bytes(b"".join(b"line %04d\n" % i for i in range(300)))
    logs = ConsoleLogs()
    first = logs.collect(sandbox.id, 0, console)
    assert first == 100  # one round reads at most READ_BYTES
    while logs.collect(sandbox.id, 0, console):
        pass
    kept = _lines(sandbox)
    assert len(kept) == 50 and kept[-1] == "line 0299" and kept[0] == "line 0250"


def test_the_round_reads_running_sandboxes_of_its_node_and_prunes(sandbox, tmp_path, settings):
    from nodes.models import Node

    node = Node.objects.create(id="logs-node", address="127.0.0.1", last_heartbeat_at=timezone.now())
    paused = Sandbox.objects.create(team=sandbox.team, template=sandbox.template, state="paused", node=node,
                                    end_at=sandbox.end_at)
    Sandbox.objects.filter(pk=sandbox.pk).update(node=node)
    for sid in (sandbox.id, paused.id):
        (tmp_path / sid).write_bytes(f"hello from {sid}\n".encode())

    trimmed = []

    class Driver:
        def console_path(self, sandbox_id):
            return Path(tmp_path / sandbox_id)

        def trim_console(self, sandbox_id, keep_bytes):
            trimmed.append((sandbox_id, keep_bytes))
            return 0

    old = SandboxLog.objects.create(sandbox=sandbox, timestamp=timezone.now() - timedelta(days=30), message="old",
                                    line="old", vm_generation=9, offset=1)
    assert ConsoleCollector(node.id, Driver(), 1.0, retention_s=7 * 86400).collect_once() == 1
    assert _lines(sandbox) == [f"hello from {sandbox.id}"] and not SandboxLog.objects.filter(pk=old.pk).exists()
    assert _lines(paused) == []  # a paused VM's console was read before its pause
    assert trimmed == [(sandbox.id, settings.AENV_CONSOLE_LOG_MAX_KB << 10)]  # bounded every round


def test_a_trimmed_console_is_read_on_after_its_hole(sandbox, tmp_path, monkeypatch):
    """A guest that writes faster than the rounds read: the driver punched a hole over what
    was not read yet, and reading goes on with the newest bytes (not 4 KiB blocks of NULs)."""
    from vmm.qemu import console

    monkeypatch.setattr(console_logs, "READ_BYTES", 1 << 20)
    path = tmp_path / "console.log"
    path.write_bytes(b"first\n")
    logs = ConsoleLogs()
    assert logs.collect(sandbox.id, 0, path) == 1
    with path.open("ab") as f:
        f.write(b"".join(b"flood %06d\n" % i for i in range(100_000)))  # 1.3 MB unread
    assert console.trim(path, 64 << 10) > 1 << 20
    stored = logs.collect(sandbox.id, 0, path)
    kept = _lines(sandbox)
    assert 0 < stored <= (64 << 10) // 13 + 400 and kept[-1] == "flood 099999"
    assert all("\0" not in line for line in kept)
