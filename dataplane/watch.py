"""Responses the data plane is relaying, watched for their sandbox moving on.

Why: when a sandbox is killed or paused, its VM goes away without a word on the wire —
the guest's network slot is removed or the VM is gone, so no FIN or RST ever reaches the
data plane — and a response being streamed from it (``commands.run(...).wait()``, a
file watch, a download) would hang until the client's own timeout. E2B's SDK expects the
stream to break so it can probe ``/health`` and report "the sandbox was killed or reached
its end of life". So every relayed response registers its route here, and one loop per
data plane process reads the routes of all watched sandboxes from the database in one
query every ``interval`` seconds; a sandbox that is gone, no longer routable or now
behind another VM process (``Route.upstream``) sets its responses' events, and the relay
breaks them off (``dataplane.proxy``).
"""
from __future__ import annotations

import asyncio
import logging
from contextlib import contextmanager

from dataplane.routes import Route, RouteTable

log = logging.getLogger(__name__)

WATCH_INTERVAL = 1.0


class RouteWatch:
    """``with watch.moved(route) as event:`` — ``event`` is set once ``route`` no longer
    reaches its sandbox's VM."""

    def __init__(self, routes: RouteTable, interval: float = WATCH_INTERVAL):
        self.routes = routes
        self.interval = interval
        self._watched: dict[str, dict[object, tuple[tuple, asyncio.Event]]] = {}
        self._task: asyncio.Task | None = None

    def __len__(self) -> int:
        return sum(len(w) for w in self._watched.values())

    @contextmanager
    def moved(self, route: Route):
        event, ticket = asyncio.Event(), object()
        self._watched.setdefault(route.sandbox_id, {})[ticket] = (route.upstream, event)
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())
        try:
            yield event
        finally:
            watchers = self._watched.get(route.sandbox_id, {})
            watchers.pop(ticket, None)
            if not watchers:
                self._watched.pop(route.sandbox_id, None)

    async def check(self) -> None:
        """One look at every watched sandbox's route (one query)."""
        ids = list(self._watched)
        if not ids:
            return
        current = await self.routes.get_many(ids)
        for sandbox_id in ids:
            route = current.get(sandbox_id)
            for upstream, event in list(self._watched.get(sandbox_id, {}).values()):
                if route is None or not route.routable or route.upstream != upstream:
                    event.set()

    async def _run(self) -> None:
        while self._watched:
            await asyncio.sleep(self.interval)
            try:
                await self.check()
            except Exception:  # noqa: BLE001 - a database hiccup must not end the watch
                log.exception("checking the routes of relayed responses failed")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
