"""What the dashboard's WebSocket consumers share: the close codes the pages understand,
the last JSON frame that says why a socket closes (daphne drops close reasons), and the
one task a socket runs, cancelled when the browser goes away."""
from __future__ import annotations

import asyncio
import contextlib
import json

from channels.generic.websocket import AsyncWebsocketConsumer

CLOSE_EXITED = 4000         # the shell exited
CLOSE_UNAUTHENTICATED = 4401
CLOSE_NOT_FOUND = 4404
CLOSE_NOT_RUNNING = 4409    # paused, killed, failed (at open or while open)
CLOSE_BAD_MESSAGE = 4400
CLOSE_UNREACHABLE = 4502    # envd refused, failed or went silent


class TaskSocket(AsyncWebsocketConsumer):
    """A consumer whose work runs in ``self._task``; ``cancel_timeout``: how long a
    disconnect waits for it to wind down."""

    _task: asyncio.Task | None = None
    cancel_timeout: float = 10.0

    async def disconnect(self, code):
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(self._task, timeout=self.cancel_timeout)

    async def _finish(self, code: int, reason: str) -> None:
        """Says why in a last JSON frame, then closes with the code and reason (a close
        reason is ≤ 123 bytes)."""
        reason = reason.encode()[:120].decode(errors="ignore")
        with contextlib.suppress(Exception):  # the socket may already be gone
            await self.send(text_data=json.dumps({"type": "close", "code": code, "reason": reason}))
        await self.close(code, reason)
