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
