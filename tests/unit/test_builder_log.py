"""agent.builder.log.BuildLog: batches lines, and learns of a cancel even while the running
command prints nothing (the build VM is then killed at once, not at the command's end)."""
import importlib
import threading
import time

import pytest

from agent.builder.log import BuildLog, Cancelled

build_log = importlib.import_module("agent.builder.log")


class Store:
    """``append`` as template_builds.progress.report_many behaves: False once not building."""

    def __init__(self):
        self.building = True
        self.lines: list[str] = []
        self.calls = 0

    def append(self, build_id, batch) -> bool:
        self.calls += 1
        if not self.building:
            return False
        self.lines += [message for _, message, _, _ in batch]
        return True


def test_lines_arrive_in_batches():
    store = Store()
    blog = BuildLog("b1", store.append)
    for i in range(5):
        blog.info(f"line {i}")
    assert blog.close() is True
    assert store.lines == [f"line {i}" for i in range(5)] and store.calls <= 2


def test_a_silent_command_still_learns_of_a_cancel(monkeypatch):
    monkeypatch.setattr(build_log, "CHECK_SECONDS", 0.5)
    store = Store()
    killed = threading.Event()
    blog = BuildLog("b2", store.append, on_cancel=killed.set)
    blog.info("step-running")
    time.sleep(0.6)
    assert store.lines == ["step-running"] and not killed.is_set()
    store.building = False  # the template was deleted; the command prints nothing more
    assert killed.wait(3), "the cancel went unnoticed while the command was silent"
    with pytest.raises(Cancelled):
        blog.info("too late")
    blog.close()


def test_a_flooding_command_keeps_only_the_cap_in_the_log():
    """A ``RUN yes`` in a hostile image: the log keeps the cap's worth, one line saying
    output stops being kept, one at the end saying how much was left out; the newest
    lines stay in the tail for a failure's reason."""
    store = Store()
    blog = BuildLog("b3", store.append, max_output_bytes=10_000)
    for i in range(5_000):  # 8 bytes a line with its newline: 40 KB of output
        blog.output("stdout", f"y {i:05d}", "[builder 1/2] RUN yes", "run-1")
    assert blog.close() is True
    kept = [line for line in store.lines if "[stdout]: y " in line]
    assert len(kept) == 10_000 // 8, len(kept)
    kept_bytes = sum(len(line.split("]: ", 1)[1]) + 1 for line in kept)
    assert kept_bytes <= 10_000
    notices = [line for line in store.lines if "not kept" in line]
    assert len(notices) == 2 and notices[-1].startswith(f"{5_000 - len(kept)} lines"), notices
    assert list(blog.tail)[-1] == "y 04999"


@pytest.mark.django_db(transaction=True)
def test_the_flusher_thread_closes_its_database_connection():
    """The flusher's appends use the database from its own thread: that connection is closed
    as the thread ends (a pooled one left open stays taken for good, one per build)."""
    from django.db import connections

    from template_builds.models import TemplateBuild

    opened = []

    def append(build_id, batch) -> bool:
        TemplateBuild.objects.filter(pk="00000000-0000-0000-0000-000000000000").exists()
        if threading.current_thread().name.startswith("build-log-"):
            opened.append(connections["default"])
        return True

    blog = BuildLog("b4", append)
    blog.info("a line the flusher writes")
    deadline = time.monotonic() + 5
    while not opened and time.monotonic() < deadline:
        time.sleep(0.05)
    assert opened, "the flusher thread never appended"
    assert blog.close() is True
    assert opened[0].connection is None
