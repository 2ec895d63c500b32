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


@contextlib.asynccontextmanager
async def served_to_sdk(app, monkeypatch, api_key: str, volumes: bool = False):
    """``served``, with the E2B SDK pointed at it through its environment: E2B_API_URL (with
    ``volumes`` E2B_VOLUME_API_URL too, the volume content API's) and ``api_key``."""
    async with served(app) as url:
        monkeypatch.setenv("E2B_API_URL", url)
        if volumes:
            monkeypatch.setenv("E2B_VOLUME_API_URL", url)
        monkeypatch.setenv("E2B_API_KEY", api_key)
        yield url
