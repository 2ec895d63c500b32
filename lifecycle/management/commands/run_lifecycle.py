"""`manage.py run_lifecycle`: the TTL / retention sweeper (lifecycle.expiry) as a
long-running loop, one tick per AENV_LIFECYCLE_PERIOD seconds.

Started by scripts/up.sh next to the API; several may run at once (each action is a
conditional transition, so two sweepers never both act on a sandbox). SIGTERM stops
ticking and waits briefly for actions in flight; one that is cut off leaves its
sandbox in a transitional state that the owning node reconciles.

--heartbeat FILE: the file's mtime is set after every sweep that reached the database, so a
container's liveness probe can tell a sweeper that still sweeps from one that is stuck
(deploy/docker/entrypoint.sh health sweeper)."""
import asyncio
import logging
import signal
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand

from lifecycle.expiry import Sweeper, sweep_once

log = logging.getLogger(__name__)

SHUTDOWN_GRACE = 20.0


class Command(BaseCommand):
    help = "Pause or kill expired sandboxes and delete paused ones past retention, every --period seconds."

    def add_arguments(self, parser):
        parser.add_argument("--period", type=float, default=settings.AENV_LIFECYCLE_PERIOD,
                            help="seconds between sweeps")
        parser.add_argument("--once", action="store_true", help="one sweep, wait for it, print the outcomes")
        parser.add_argument("--heartbeat", type=Path, default=None,
                            help="a file touched after every sweep that reached the database (liveness)")

    def handle(self, *args, period: float, once: bool, heartbeat: Path | None = None, **options):
        if once:
            for sandbox_id, kind, outcome in asyncio.run(sweep_once()):
                self.stdout.write(f"{sandbox_id} {kind}: {outcome}")
            return
        asyncio.run(self._loop(period, heartbeat))

    async def _loop(self, period: float, heartbeat: Path | None = None) -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        sweeper = Sweeper()
        log.info("lifecycle sweeper running: period %.1f s, retention %d s, concurrency %d",
                 period, settings.AENV_PAUSED_RETENTION, sweeper.concurrency)
        await sweeper.run(period, stop, heartbeat.touch if heartbeat is not None else None)
        await sweeper.drain(timeout=SHUTDOWN_GRACE)
        log.info("lifecycle sweeper stopped")
