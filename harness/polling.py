"""Waiting in tests for something a guest or a node does: poll a check until it holds or a
deadline passes (a fixed sleep is either too short on a loaded CI host or wasted time)."""
from __future__ import annotations

import time

import httpx


def until(check, what: str, deadline: float = 30.0, interval: float = 0.3,
          tolerate: tuple[type[BaseException], ...] = (httpx.HTTPError, OSError)):
    """``check()``'s first truthy result; an error of a ``tolerate`` kind counts as not yet.
    Fails the test, naming ``what``, once ``deadline`` seconds have passed."""
    end = time.monotonic() + deadline
    while True:
        try:
            result = check()
            if result:
                return result
        except tolerate:
            pass
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(interval)
