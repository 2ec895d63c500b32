"""harness.net_sessions: test processes side by side never get the same network instance
number, and a number comes back when its process ends."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness import net_sessions

ROOT = Path(__file__).resolve().parents[2]
HOLD = ("import sys; from pathlib import Path; from harness import net_sessions as s; "
        "s.SESSIONS = int(sys.argv[2]); print(s.claim(Path(sys.argv[1]), preferred=7), flush=True); sys.stdin.read()")


def _holder(locks: Path, sessions: int = 100) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(locks), str(sessions)], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline())


def test_processes_at_once_hold_different_numbers_and_give_them_back(tmp_path):
    locks = tmp_path / "locks"
    held = [_holder(locks) for _ in range(3)]
    try:
        numbers = [n for _, n in held]
        assert numbers == [7, 8, 9]  # all preferred 7: each took the next free one
        assert net_sessions.claim(locks, preferred=7) == 10
        assert net_sessions.claim(locks, preferred=7) == 10  # this process keeps its own
    finally:
        for proc, _ in held:
            proc.stdin.close()
            proc.wait(timeout=30)
    again, number = _holder(locks)  # the ended holders' numbers are free again
    again.stdin.close()
    again.wait(timeout=30)
    assert number == 7


def test_every_number_held_is_an_error_that_says_so(tmp_path, monkeypatch):
    locks = tmp_path / "full"
    monkeypatch.setattr(net_sessions, "SESSIONS", 2)
    holders = [_holder(locks, 2) for _ in range(2)]
    try:
        assert sorted(n for _, n in holders) == [0, 1]
        with pytest.raises(RuntimeError, match="held by a running process"):  # none free: it says so
            net_sessions.claim(locks)
    finally:
        for proc, _ in holders:
            proc.stdin.close()
            proc.wait(timeout=30)
