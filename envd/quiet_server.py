"""uvicorn's Server without its 10 Hz housekeeping tick.

Why: uvicorn's main loop wakes every 0.1 s to refresh the Date header and to notice a shutdown
signal. In a guest emulated by TCG every wakeup costs the host real CPU (the timer interrupt,
the scheduler and the Python loop, all emulated), and an idle sandbox's envd spent most of the
host CPU its sandbox cost (docs/benchmarks.md, "Idle guests"). Here the main loop sleeps until a
shutdown signal, which wakes it through the event loop's self-pipe, and the Date header is made
when a response needs it (once per second at most).
"""

import asyncio
import time
from email.utils import formatdate

import uvicorn
from uvicorn.server import ServerState


class _DateOnDemand(ServerState):
    """ServerState whose ``default_headers`` (what uvicorn puts in every response) carry the
    current Date, computed when read instead of by the tick."""

    def __init__(self, config: uvicorn.Config):
        self._config = config
        self._second = None
        self._headers = []
        super().__init__()

    @property
    def default_headers(self):
        now = int(time.time())
        if now != self._second:
            date = [(b"date", formatdate(now, usegmt=True).encode())] if self._config.date_header else []
            self._headers = date + self._config.encoded_headers
            self._second = now
        return self._headers

    @default_headers.setter
    def default_headers(self, value):
        """uvicorn's own tick would set them; they are computed here instead."""


class QuietServer(uvicorn.Server):
    """A uvicorn Server whose main loop waits for the exit signal instead of polling for it.
    ``limit_max_requests`` and ``callback_notify`` (which need the tick) are refused."""

    def __init__(self, config: uvicorn.Config):
        if config.limit_max_requests is not None or config.callback_notify is not None:
            raise ValueError("QuietServer has no tick: limit_max_requests and callback_notify are not supported")
        super().__init__(config)
        self.server_state = _DateOnDemand(config)
        self._loop = None
        self._exit = None

    async def main_loop(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._exit = asyncio.Event()
        if not self.should_exit:  # a signal before this point set it; one after wakes _exit
            await self._exit.wait()

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        loop, event = self._loop, self._exit
        if loop is not None and event is not None and not loop.is_closed():
            loop.call_soon_threadsafe(event.set)
