"""A node worker told to stop (SIGTERM, as systemd and scripts/down.sh send it) pauses every
running sandbox of its node to disk before it exits (issue 12, item 4): the rows go
``running → pausing → paused`` with events that say why, their QEMU processes are gone,
the next node worker resumes nothing by itself, and a connect brings each back with its
processes and files — also after a reboot, simulated by emptying their tmpfs files: their
memory waited on disk."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
from e2b import Sandbox

from harness.guest_counter import read_counter, start_counter

pytestmark = [pytest.mark.vm, pytest.mark.timeout(900)]


def test_a_stopped_node_pauses_its_sandboxes_and_serves_them_after_restart(node_kill_stack, monkeypatch):
    """On the conftest's node kill stack (default settings), before its other users."""
    stack = node_kill_stack
    for key, value in (("E2B_API_URL", stack.api_url), ("E2B_SANDBOX_URL", stack.sandbox_url),
                       ("E2B_API_KEY", stack.api_key)):
        monkeypatch.setenv(key, value)
    boxes = [Sandbox.create(timeout=600) for _ in range(2)]
    counters = {}
    for i, sbx in enumerate(boxes):
        sbx.files.write("/home/user/mine.txt", f"box {i}")
        counters[sbx.sandbox_id] = start_counter(sbx)[0]
    try:
        t0 = time.monotonic()
        stack.stop("node", timeout=120)
        stopped_s = time.monotonic() - t0
        for sbx in boxes:
            state = stack.db(f"from sandboxes.models import Sandbox as S; print(S.objects.get(pk='{sbx.sandbox_id}')"
                             ".state)").strip()
            assert state == "paused", (sbx.sandbox_id, state, stack.log("node"))
            assert stack.qemu_pids(sbx.sandbox_id) == []
        events = stack.db("from sandboxes.models import SandboxEvent as E; "
                          "print(E.objects.filter(operation='pause', outcome='ok', "
                          "details__reason='node shutdown').count())").strip()
        assert events == "2"
        assert "stopping: 2 of 2 sandbox(es) paused" in stack.log("node") and stopped_s < 60
        for sbx in boxes:  # their memory waits on disk, so a reboot (tmpfs emptied) loses nothing
            assert (stack.home / "sandboxes" / sbx.sandbox_id / "memory.ram").is_file()
            for leftover in Path("/dev/shm").glob(f"aenv-{sbx.sandbox_id}*"):
                leftover.unlink()

        stack.start_node()
        time.sleep(2)
        for sbx in boxes:  # nothing resumed by itself
            assert stack.qemu_pids(sbx.sandbox_id) == []
        for i, sbx in enumerate(boxes):
            again = Sandbox.connect(sbx.sandbox_id)
            assert again.files.read("/home/user/mine.txt") == f"box {i}"
            pid, n1 = read_counter(again)
            assert pid == counters[sbx.sandbox_id]  # the same process, still counting
            time.sleep(0.6)
            assert read_counter(again)[1] > n1
    finally:
        for sbx in boxes:
            try:
                Sandbox.kill(sbx.sandbox_id)
            except Exception:  # noqa: BLE001 - cleanup
                pass
