"""The API's ASGI app under uvicorn on a free loopback port, for tests that drive it with the
unchanged E2B SDKs (real HTTP, as the SDKs speak it) from the test's own event loop."""
from __future__ import annotations

import asyncio
import contextlib
import socket

import uvicorn


@contextlib.asynccontextmanager
async def served(app):
    """Serves ``app`` while the block runs; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning", timeout_graceful_shutdown=2))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
