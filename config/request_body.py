"""Request bodies for the Django side (API, dashboard, admin), read whole and bounded.

Why: Django's ASGI request reads at most ``Content-Length`` bytes, so a body sent with
``Transfer-Encoding: chunked`` and no length — what Node's ``fetch`` (the TypeScript
E2B SDK) sends for every JSON body — arrived empty, and the serializers quietly turned
the missing fields into defaults (a fork of 2 became 1). This ASGI middleware sits in
front of Django: it reads a body without a length up to the limit and hands Django the
same bytes with a ``Content-Length``, so every view sees the body whatever framing the
client chose. One limit (``AENV_API_MAX_BODY_BYTES``) applies to both framings, checked
before any byte is read when the length is declared: 413 past it. A body that cannot
be read (a malformed length, a client that stops mid-body) is an error, never empty.
"""
import json
import re
import tempfile

from django.conf import settings

# Paths whose bodies are file uploads with a limit of their own (the setting named here),
# never buffered in memory here: the COPY archives of template builds
# (api.templates.views.upload_view; a declared length required, 411 without) and the files
# written through the volume content API (api.volumes.content; the TypeScript SDK streams
# them chunked, so a body without a length is spooled to a temporary file, up to the limit).
FILE_UPLOADS = ((re.compile(r"^/template-files/"), "AENV_TEMPLATE_FILE_MAX_BYTES", False),
                (re.compile(r"^/volumecontent/[^/]+/file$"), "AENV_VOLUME_MAX_FILE_BYTES", True))
SPOOL_IN_MEMORY = 1 << 20  # a spooled upload moves to disk past this


def _error(status: int, message: str) -> tuple[int, list, bytes]:
    body = json.dumps({"code": status, "message": message}).encode()
    return status, [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close")], body


async def _answer(send, status: int, message: str) -> None:
    status, headers, body = _error(status, message)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class BoundedRequestBody:
    """ASGI middleware for HTTP scopes; anything else passes through untouched."""

    def __init__(self, app, max_bytes: int | None = None):
        self.app = app
        self._max_bytes = max_bytes

    @property
    def max_bytes(self) -> int:
        return self._max_bytes if self._max_bytes is not None else settings.AENV_API_MAX_BODY_BYTES

    @staticmethod
    def upload_limit(path: str) -> int | None:
        """The limit of a file-upload path (``FILE_UPLOADS``), None for any other path."""
        for pattern, setting, _ in FILE_UPLOADS:
            if pattern.match(path):
                return getattr(settings, setting)
        return None

    @staticmethod
    def spools(path: str) -> bool:
        """Whether an upload to ``path`` may come without a length (spooled to a file here)."""
        return any(pattern.match(path) and chunked for pattern, _, chunked in FILE_UPLOADS)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        upload_limit = self.upload_limit(scope.get("path", ""))
        limit = self.max_bytes if upload_limit is None else upload_limit
        lengths = [v for n, v in scope["headers"] if n.lower() == b"content-length"]
        if not lengths and upload_limit is not None and scope.get("method") in ("PUT", "POST"):
            if self.spools(scope.get("path", "")):
                return await self._spooled(scope, receive, send, upload_limit)
            return await _answer(send, 411, "an upload needs a Content-Length header")
        if lengths:
            values = {v.strip() for v in lengths}
            value = next(iter(values))
            if len(values) != 1 or not value.isdigit():
                return await _answer(send, 400, f"invalid Content-Length header: {b', '.join(lengths).decode('latin-1')}")
            if int(value) > limit:
                return await _answer(send, 413, f"request body of {int(value)} bytes exceeds the limit of {limit} bytes")
            return await self.app(scope, receive, send)  # Django reads exactly that many bytes

        # No declared length (chunked, or a body that simply runs to its end): read it here.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client went away mid-body: nobody to answer, nothing to run
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return await _answer(send, 413, f"request body exceeds the limit of {limit} bytes")
            if chunk:
                chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        headers = [(n, v) for n, v in scope["headers"] if n.lower() != b"transfer-encoding"]
        headers.append((b"content-length", str(len(body)).encode()))
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(dict(scope, headers=headers), replay, send)

    async def _spooled(self, scope, receive, send, limit: int):
        """An upload without a length: written to a temporary file (memory up to
        ``SPOOL_IN_MEMORY``) up to ``limit`` (413 past it), then handed on with its length in
        chunks, so a large file never sits in memory."""
        with tempfile.SpooledTemporaryFile(max_size=SPOOL_IN_MEMORY) as spool:
            size = 0
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    return await _answer(send, 413, f"request body exceeds the limit of {limit} bytes")
                spool.write(chunk)
                if not message.get("more_body", False):
                    break
            spool.seek(0)
            headers = [(n, v) for n, v in scope["headers"] if n.lower() != b"transfer-encoding"]
            headers.append((b"content-length", str(size).encode()))
            done = False

            async def replay():
                nonlocal done
                if done:
                    return await receive()
                chunk = spool.read(SPOOL_IN_MEMORY)
                done = spool.tell() >= size
                return {"type": "http.request", "body": chunk, "more_body": not done}

            await self.app(dict(scope, headers=headers), replay, send)
