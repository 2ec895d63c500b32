"""The HTTP surface on guest port 49999, exactly what the e2b-code-interpreter SDKs call
(spec e2b-code-interpreter.md §2): ``POST /execute`` (a stream of JSON lines),
``POST``/``GET /contexts``, ``POST /contexts/{id}/restart``, ``DELETE /contexts/{id}`` and
``GET /health``. Query strings are ignored (the JS SDK may append ``?source=``); no auth on
the contexts routes (the SDKs send no token there); errors are plain text with the
reference's status codes (400, 404, 422, 500), never 502 (the SDK reads that as a dead
sandbox).

``/execute`` answers 200 with its headers at once (the JS SDK's request timer stops only
then) and writes a ``keepalive`` line after every ``KEEPALIVE_SECONDS`` of silence: a write
to a client that went away fails, and an ``http.disconnect`` is watched too, either way
the execution is abandoned (its kernel interrupted, see ``contexts.Execution``)."""
from __future__ import annotations

import asyncio
import json
import logging
import os
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from . import events
from .contexts import ContextFailed, ContextNotFound, Contexts

log = logging.getLogger(__name__)

KEEPALIVE_SECONDS = 2.0


class BadRequest(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


async def _json_body(request: Request, allow_empty: bool = False) -> dict:
    raw = await request.body()
    if not raw.strip() and allow_empty:
        return {}
    try:
        data = json.loads(raw)
    except ValueError:
        raise BadRequest(422, "the body must be a JSON object") from None
    if not isinstance(data, dict):
        raise BadRequest(422, "the body must be a JSON object")
    return data


def _optional_str(data: dict, key: str) -> str | None:
    value = data.get(key)
    if value is not None and not isinstance(value, str):
        raise BadRequest(422, f"'{key}' must be a string or null")
    return value


def _env_vars(data: dict) -> dict | None:
    value = data.get("env_vars")
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise BadRequest(422, "'env_vars' must be an object of strings or null")
    return value


def _contexts(request: Request) -> Contexts:
    return request.app.state.contexts


async def health(request: Request) -> Response:
    if _contexts(request).ready:
        return JSONResponse("OK")
    return JSONResponse("starting", status_code=503)


async def create_context(request: Request) -> Response:
    data = await _json_body(request, allow_empty=True)
    language, cwd = _optional_str(data, "language"), _optional_str(data, "cwd")
    try:
        ctx = await _contexts(request).create(language, cwd)
    except ContextFailed as exc:
        raise BadRequest(500, f"Failed to create context: {exc}") from None
    return JSONResponse(ctx.to_json())


async def list_contexts(request: Request) -> Response:
    return JSONResponse([ctx.to_json() for ctx in _contexts(request).list()])


async def restart_context(request: Request) -> Response:
    await _contexts(request).restart(request.path_params["context_id"])
    return JSONResponse(None)


async def remove_context(request: Request) -> Response:
    await _contexts(request).remove(request.path_params["context_id"])
    return JSONResponse(None)


async def execute(request: Request) -> Response:
    data = await _json_body(request)
    code = data.get("code")
    if not isinstance(code, str):
        raise BadRequest(422, "'code' is required and must be a string")
    context_id, language = _optional_str(data, "context_id"), _optional_str(data, "language")
    env_vars = _env_vars(data)
    if context_id and language:
        raise BadRequest(400, "Only one of context_id or language can be provided")
    contexts = _contexts(request)
    if context_id:
        ctx = contexts.get(context_id)
    else:
        try:
            ctx = await contexts.default_for(language)
        except ContextFailed as exc:
            raise BadRequest(500, f"Failed to create context: {exc}") from None
    run = contexts.execute(ctx, code, env_vars, request.headers.get("x-access-token"))
    return ExecutionStream(run)


class ExecutionStream(Response):
    """The NDJSON body of one execution, written as its events come."""

    media_type = "application/x-ndjson"

    def __init__(self, run):
        super().__init__(status_code=200, media_type=self.media_type)
        self.run = run

    async def __call__(self, scope, receive, send) -> None:
        headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
        finished = False

        async def watch_disconnect() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    self.run.abandon()
                    return

        watcher = asyncio.create_task(watch_disconnect())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            while True:
                event = await self.run.next_event(KEEPALIVE_SECONDS)
                if event is None:
                    finished = True
                    break
                await send({"type": "http.response.body", "body": events.line(event), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client is gone (uvicorn's ClientDisconnected)
            pass
        finally:
            watcher.cancel()
            if not finished:
                self.run.abandon()


async def _bad_request(request: Request, exc: BadRequest) -> Response:
    return PlainTextResponse(exc.message, status_code=exc.status)


async def _not_found(request: Request, exc: ContextNotFound) -> Response:
    return PlainTextResponse(str(exc), status_code=404)


def create_app(contexts: Contexts, start_defaults: bool = True) -> Starlette:
    """The ASGI app; with ``start_defaults`` its lifespan starts the default contexts in the
    background (``/health`` answers 503 until they run; the process exits if they fail)."""

    @asynccontextmanager
    async def lifespan(app):
        task = None
        if start_defaults:
            task = asyncio.create_task(_start(contexts))
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
            await contexts.close()

    app = Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/execute", execute, methods=["POST"]),
            Route("/contexts", create_context, methods=["POST"]),
            Route("/contexts", list_contexts, methods=["GET"]),
            Route("/contexts/{context_id}/restart", restart_context, methods=["POST"]),
            Route("/contexts/{context_id}", remove_context, methods=["DELETE"]),
        ],
        middleware=[Middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"])],
        exception_handlers={BadRequest: _bad_request, ContextNotFound: _not_found},
        lifespan=lifespan,
    )
    app.state.contexts = contexts
    return app


async def _start(contexts: Contexts) -> None:
    try:
        await contexts.start_defaults()
        log.info("default contexts ready: %s", ", ".join(contexts.defaults))
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001 - without its default contexts the server is useless
        log.exception("the default contexts did not start; exiting")
        os._exit(3)
