"""``GET /files`` and ``POST /files``: streamed download/upload with E2B semantics.

Bodies are processed chunk by chunk straight to/from disk (multipart via
python-multipart's callback parser), so file size never costs memory.
"""

import asyncio
import errno
import json
import logging
import os
import stat
import zlib
from urllib.parse import parse_qs

from . import oserrors, permissions
from .fsinfo import make_dirs, write_metadata
from .users import UnknownUser, ensure_home, request_user, resolve_path

log = logging.getLogger("envd.files")

CHUNK = 64 * 1024


class HTTPError(Exception):
    """An error answered as ``{"code": status, "message": ...}`` JSON."""

    def __init__(self, status, message):
        super().__init__(message)
        self.status = status
        self.message = message


async def send_json(send, status, body, extra_headers=()):
    data = json.dumps(body, separators=(",", ":")).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    headers.extend(extra_headers)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


async def send_http_error(send, err):
    await send_json(send, err.status, {"code": err.status, "message": err.message})


def query_params(scope):
    """Single-valued query parameters (first value wins)."""
    qs = parse_qs(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
    return {k: v[0] for k, v in qs.items()}


def resolve_user(settings, username):
    """``username`` (absent: the default user, see users.request_user) or 401."""
    try:
        return request_user(settings, username)
    except UnknownUser as exc:
        raise HTTPError(401, str(exc)) from None


def _resolve(path, pw):
    try:
        return resolve_path(path, pw.pw_dir)
    except ValueError as exc:
        raise HTTPError(400, str(exc)) from None


def _wants_gzip(headers):
    """Compress only when the client asked for gzip alone (SDK ``gzip=True``).

    httpx advertises ``gzip, deflate`` on every request; compressing all
    downloads would waste CPU in slow guests for no benefit.
    """
    codings = [c.split(";")[0].strip().lower() for c in headers.get("accept-encoding", "").split(",") if c.strip()]
    return codings == ["gzip"]


async def download(scope, receive, send, settings, headers):
    params = query_params(scope)
    pw = resolve_user(settings, params.get("username"))
    if not params.get("path"):
        raise HTTPError(400, "missing 'path' query parameter")
    path = _resolve(params["path"], pw)
    try:
        permissions.check_read(pw, path)
        # O_NONBLOCK: opening a FIFO nobody writes would block the whole event loop until
        # someone does (and a read of a FIFO or a terminal waits in _read, not in the kernel).
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except (FileNotFoundError, NotADirectoryError):
        raise HTTPError(404, f"path '{path}' does not exist") from None
    except IsADirectoryError:
        raise HTTPError(400, f"path '{path}' is a directory") from None
    except PermissionError as exc:
        raise HTTPError(403, oserrors.message(exc)) from None
    # Noticing the client leave is ours to do: once it is gone uvicorn's send returns at once,
    # so a loop over an endless file (/dev/zero) would never yield again and starve envd.
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise HTTPError(400, f"path '{path}' is a directory")
        await _send_file(fd, st, path, send, _wants_gzip(headers), gone)
    finally:
        gone.cancel()
        os.close(fd)


async def _send_file(fd, st, path, send, gz, gone):
    out_headers = [(b"content-type", b"application/octet-stream")]
    name = os.path.basename(path).replace('"', "")
    out_headers.append((b"content-disposition", f'attachment; filename="{name}"'.encode("utf-8", "replace")))
    regular = stat.S_ISREG(st.st_mode)
    # st_size is not the length of every file: /proc reports 0 and sysfs 4096 whatever the
    # content. Whatever fits in the first read of a regular file is sent with its true length;
    # a longer one streams to its end (its st_size is then the length, and a file that shrinks
    # meanwhile breaks the response, never pads it). A device or a FIFO may never end, or wait
    # for its writer: it streams at once, for as long as the client reads.
    head, ended = (await _read_head(fd, gone)) if regular else (b"", False)
    if head is None:
        return  # the client left before the first byte
    limit = None
    if gz:
        out_headers.append((b"content-encoding", b"gzip"))
        compressor = zlib.compressobj(6, zlib.DEFLATED, 31)
    elif ended:
        out_headers.append((b"content-length", str(len(head)).encode()))
    elif regular and st.st_size > len(head):
        limit = st.st_size
        out_headers.append((b"content-length", str(limit).encode()))
    await send({"type": "http.response.start", "status": 200, "headers": out_headers})
    try:
        sent = 0
        chunk = head if regular else await _read(fd, CHUNK, gone)
        while chunk:
            if limit is not None:
                chunk = chunk[:limit - sent]
            sent += len(chunk)
            if gz:
                chunk = compressor.compress(chunk)
            if chunk:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if ended or (limit is not None and sent >= limit):
                break
            # send() yields only when the socket's buffer is full: give other requests (and the
            # disconnect watcher) their turn on every chunk.
            await asyncio.sleep(0)
            chunk = await _read(fd, CHUNK, gone)
        if chunk is None:
            log.debug("client left during the download of %s after %d bytes", path, sent)
            return
        if limit is not None and sent < limit:
            log.warning("%s shrank while it was read (%d of %d bytes): response cut", path, sent, limit)
            return  # returning with the response unfinished makes uvicorn close the connection
        tail = compressor.flush() if gz else b""
        await send({"type": "http.response.body", "body": tail, "more_body": False})
    except OSError as exc:  # the status line is out: all that is left is to cut the response
        log.warning("download of %s failed after its start: %s", path, exc)


async def _disconnected(receive):
    """Returns once the client is gone (a GET's only message before that is its empty body)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _read(fd, size, gone):
    """``os.read`` that waits for a FIFO or a device without blocking the event loop; None once
    the client is gone (``gone`` done)."""
    while not gone.done():
        try:
            return os.read(fd, size)
        except BlockingIOError:
            await _readable(fd, gone)
    return None


async def _readable(fd, gone):
    """Waits until ``fd`` has something to read or the client left."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    try:
        loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
    except PermissionError:  # epoll refuses a file that cannot be polled: look again shortly
        await asyncio.wait({gone}, timeout=0.1)
        return
    try:
        await asyncio.wait({ready, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        loop.remove_reader(fd)
        ready.cancel()


async def _read_head(fd, gone) -> tuple[bytes | None, bool]:
    """The first CHUNK bytes of a regular file, and whether that is all of it (reads until
    CHUNK bytes or end of file: pseudo-files may return short reads); None if the client left."""
    parts, size = [], 0
    while size < CHUNK:
        part = await _read(fd, CHUNK - size, gone)
        if part is None:
            return None, False
        if not part:
            return b"".join(parts), True
        parts.append(part)
        size += len(part)
    return b"".join(parts), False


def _pseudo_devices():
    """st_dev of /proc and /sys: their files are the kernel's settings and state, not data."""
    out = set()
    for top in ("/proc", "/sys"):
        try:
            out.add(os.stat(top).st_dev)
        except OSError:
            pass
    return out


class _Sink:
    """Writes one destination file: create, chown to user, metadata, then data."""

    def __init__(self, path, pw, metadata, limit, state):
        self.path = path
        self.state = state  # shared byte counter across files of one request
        self.limit = limit
        ensure_home(pw, os.path.dirname(path))
        if os.path.isdir(path):
            raise HTTPError(400, f"path '{path}' is a directory")
        try:
            permissions.check_write(pw, path)
        except PermissionError as exc:
            raise HTTPError(403, str(exc)) from None
        parent = os.path.dirname(path)
        try:
            make_dirs(parent, pw.pw_uid, pw.pw_gid)
        except (NotADirectoryError, FileExistsError):
            raise HTTPError(400, f"a parent of '{path}' is not a directory") from None
        try:
            # O_NONBLOCK: a FIFO nobody reads is ENXIO here instead of a wait that blocks envd
            self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NONBLOCK
                              | os.O_NOCTTY, 0o644)
        except IsADirectoryError:
            raise HTTPError(400, f"path '{path}' is a directory") from None
        except NotADirectoryError:
            raise HTTPError(400, f"a parent of '{path}' is not a directory") from None
        self.kernel_file = False
        self.removable = False  # what abort() may unlink: never a device nor a /proc or /sys file
        try:
            self._prepare(path, pw, metadata)
        except BaseException:
            self.close()
            raise

    def _prepare(self, path, pw, metadata):
        st = os.fstat(self.fd)
        if stat.S_ISFIFO(st.st_mode):
            # a reader that stops reading would block envd's event loop in write()
            raise HTTPError(400, f"path '{path}' is a FIFO: an upload never writes to one")
        # The written file becomes the user's, 0644 (E2B's rule), but only a regular file of a
        # real file system: a device (/dev/null) or a /proc or /sys file keeps its owner and mode
        # (chown of /proc/sys/... would hand a kernel setting to the user).
        self.kernel_file = stat.S_ISREG(st.st_mode) and st.st_dev in _pseudo_devices()
        if stat.S_ISREG(st.st_mode) and not self.kernel_file:
            self.removable = True
            if os.geteuid() == 0:
                os.fchown(self.fd, pw.pw_uid, pw.pw_gid)
            if stat.S_IMODE(st.st_mode) != 0o644:
                os.fchmod(self.fd, 0o644)
        self.metadata_set = write_metadata(self.fd, metadata) and bool(metadata)

    def write(self, data):
        self.state["bytes"] += len(data)
        if self.state["bytes"] > self.limit:
            raise HTTPError(413, f"upload exceeds the limit of {self.limit} bytes")
        view = memoryview(data)
        while view:
            try:
                n = os.write(self.fd, view)
            except OSError as exc:
                if exc.errno == errno.EIO and self.kernel_file:  # a /proc or /sys file that takes no writes
                    raise HTTPError(403, f"'{self.path}' cannot be written: {exc.strerror}") from None
                raise
            view = view[n:]

    def close(self):
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def abort(self):
        self.close()
        if not self.removable:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass


def _decoder(encoding):
    encoding = (encoding or "identity").strip().lower()
    if encoding in ("", "identity"):
        return None
    if encoding in ("gzip", "x-gzip"):
        return zlib.decompressobj(47)  # gzip or zlib header, auto-detected
    if encoding == "deflate":
        return zlib.decompressobj()
    raise HTTPError(400, f"unsupported Content-Encoding '{encoding}'")


def _metadata_headers(scope):
    meta = {}
    for key, value in scope.get("headers", ()):
        name = key.decode("latin-1").lower()
        if name.startswith("x-metadata-") and len(name) > len("x-metadata-"):
            meta[name[len("x-metadata-"):]] = value.decode("utf-8", "replace")
    return meta


async def _body_chunks(receive, decoder, limit):
    """Yield (decoded) request body chunks; enforces the decoded-size limit too."""
    total = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise HTTPError(400, "client disconnected during upload")
        chunk = msg.get("body", b"")
        if decoder is not None and chunk:
            try:
                chunk = decoder.decompress(chunk, CHUNK * 16)
                while decoder.unconsumed_tail:
                    total += len(chunk)
                    yield chunk
                    chunk = decoder.decompress(decoder.unconsumed_tail, CHUNK * 16)
            except zlib.error as exc:
                raise HTTPError(400, f"invalid compressed body: {exc}") from None
        if chunk:
            total += len(chunk)
            if total > limit + CHUNK:
                raise HTTPError(413, f"upload exceeds the limit of {limit} bytes")
            yield chunk
        if not msg.get("more_body", False):
            if decoder is not None:
                rest = decoder.flush()
                if rest:
                    yield rest
            return


def _result(sink):
    entry = {"name": os.path.basename(sink.path), "type": "file", "path": sink.path}
    return entry


async def upload(scope, receive, send, settings, headers):
    params = query_params(scope)
    pw = resolve_user(settings, params.get("username"))
    limit = settings.max_upload_bytes
    length = headers.get("content-length")
    if length and length.isdigit() and int(length) > limit + CHUNK * 4:
        raise HTTPError(413, f"upload exceeds the limit of {limit} bytes")
    metadata = _metadata_headers(scope)
    ctype = headers.get("content-type", "")
    decoder = _decoder(headers.get("content-encoding"))
    state = {"bytes": 0}
    results = []
    if ctype.split(";")[0].strip().lower() == "multipart/form-data":
        sinks = await _upload_multipart(ctype, receive, decoder, params.get("path"), pw, metadata, limit, state)
    else:
        if not params.get("path"):
            raise HTTPError(400, "missing 'path' query parameter")
        sink = _Sink(_resolve(params["path"], pw), pw, metadata, limit, state)
        try:
            async for chunk in _body_chunks(receive, decoder, limit):
                sink.write(chunk)
        except BaseException:
            sink.abort()
            raise
        sink.close()
        sinks = [sink]
    if not sinks:
        raise HTTPError(400, "no file in request")
    for sink in sinks:
        entry = _result(sink)
        if metadata and sink.metadata_set:
            entry["metadata"] = metadata
        results.append(entry)
    await send_json(send, 200, results)


async def _upload_multipart(ctype, receive, decoder, path_param, pw, metadata, limit, state):
    from python_multipart.multipart import MultipartParser, parse_options_header

    _, options = parse_options_header(ctype)
    boundary = options.get(b"boundary")
    if not boundary:
        raise HTTPError(400, "multipart body without boundary")
    done = []
    cur = {"sink": None, "field": b"", "value": b"", "headers": {}, "skip": False}

    def on_part_begin():
        cur.update(sink=None, headers={}, skip=False)

    def on_header_field(data, start, end):
        cur["field"] += data[start:end]

    def on_header_value(data, start, end):
        cur["value"] += data[start:end]

    def on_header_end():
        cur["headers"][cur["field"].decode("latin-1").lower()] = cur["value"]
        cur["field"] = cur["value"] = b""

    def on_headers_finished():
        _, disp = parse_options_header(cur["headers"].get("content-disposition", b""))
        if disp.get(b"name", b"") != b"file":
            cur["skip"] = True  # ignore other form fields
            return
        # E2B's rule: a `path` parameter names every part's destination, else each part's
        # filename does, relative ones under the user's home and with their directories kept.
        target = path_param or disp.get(b"filename", b"").decode("utf-8", "replace")
        if not target:
            raise HTTPError(400, "file part without a filename and no 'path' parameter")
        path = _resolve(target, pw)
        if any(sink.path == path for sink in done):
            raise HTTPError(400, f"cannot upload several files to '{path}' in one request; only the first "
                                 f"of them was written")
        cur["sink"] = _Sink(path, pw, metadata, limit, state)

    def on_part_data(data, start, end):
        if cur["sink"] is not None:
            cur["sink"].write(data[start:end])

    def on_part_end():
        if cur["sink"] is not None:
            cur["sink"].close()
            done.append(cur["sink"])
            cur["sink"] = None

    parser = MultipartParser(boundary, {
        "on_part_begin": on_part_begin, "on_header_field": on_header_field,
        "on_header_value": on_header_value, "on_header_end": on_header_end,
        "on_headers_finished": on_headers_finished, "on_part_data": on_part_data,
        "on_part_end": on_part_end,
    })
    try:
        async for chunk in _body_chunks(receive, decoder, limit):
            parser.write(chunk)
        parser.finalize()
    except BaseException as exc:
        if cur["sink"] is not None:
            cur["sink"].abort()
        if isinstance(exc, HTTPError):
            raise
        if isinstance(exc, Exception) and type(exc).__name__.endswith("ParseError"):
            raise HTTPError(400, f"invalid multipart body: {exc}") from None
        raise
    return done
