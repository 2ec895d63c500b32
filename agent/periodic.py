"""The node's background duties (heartbeat, reconcile, metrics sampling, console logs): one
loop for all of them."""
from __future__ import annotations

import logging
import threading
import time

from django.db import close_old_connections

log = logging.getLogger(__name__)


class Periodic(threading.Thread):
    """Calls ``round()`` every ``interval`` seconds (the first one at once when
    ``at_once``) until ``stop()``. A failing round is logged and the next one still comes:
    the node must keep beating whatever its database or driver does; after each round the
    thread's database connection is closed, so a long-lived thread never keeps a broken one."""

    def __init__(self, name: str, interval: float, at_once: bool = False):
        super().__init__(name=name, daemon=True)
        self.interval, self.at_once = interval, at_once
        self._stopped = threading.Event()

    def round(self) -> None:
        raise NotImplementedError

    def run(self) -> None:
        next_round = time.monotonic() + (0.0 if self.at_once else self.interval)
        while not self._stopped.wait(max(0.0, next_round - time.monotonic())):
            next_round = time.monotonic() + self.interval
            try:
                self.round()
            except Exception:
                log.exception("%s: round failed", self.name)
            finally:
                close_old_connections()

    def stop(self) -> None:
        self._stopped.set()
