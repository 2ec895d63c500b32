"""``GET /files`` and ``POST /files``: streamed download/upload with E2B semantics.

Bodies are processed chunk by chunk straight to/from disk (multipart via
python-multipart's callback parser), so file size never costs memory.
"""

import json
import logging
import os
import stat
import zlib
from urllib.parse import parse_qs

from . import permissions
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
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise HTTPError(404, f"path '{path}' does not exist") from None
    except NotADirectoryError:
        raise HTTPError(404, f"path '{path}' does not exist") from None
    except IsADirectoryError:
        raise HTTPError(400, f"path '{path}' is a directory") from None
    except PermissionError as exc:
        raise HTTPError(403, str(exc)) from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise HTTPError(400, f"path '{path}' is a directory")
        gz = _wants_gzip(headers)
        out_headers = [(b"content-type", b"application/octet-stream")]
        name = os.path.basename(path).replace('"', "")
        out_headers.append((b"content-disposition", f'attachment; filename="{name}"'.encode("utf-8", "replace")))
        # st_size is not the length of every file: /proc reports 0 and sysfs 4096
        # whatever the content. Whatever fits in the first read is sent with its true
        # length; a longer file streams to its end (a regular file's st_size is then the
        # length, and a file that shrinks meanwhile breaks the response, never pads it).
        head, ended = _read_head(fd)
        limit = None
        if gz:
            out_headers.append((b"content-encoding", b"gzip"))
            compressor = zlib.compressobj(6, zlib.DEFLATED, 31)
        elif ended:
            out_headers.append((b"content-length", str(len(head)).encode()))
        elif stat.S_ISREG(st.st_mode) and st.st_size > len(head):
            limit = st.st_size
            out_headers.append((b"content-length", str(limit).encode()))
        await send({"type": "http.response.start", "status": 200, "headers": out_headers})
        sent = 0
        chunk = head
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
            chunk = os.read(fd, CHUNK)
        if limit is not None and sent < limit:
            raise ConnectionError(f"{path} shrank while it was read ({sent} of {limit} bytes)")
        tail = compressor.flush() if gz else b""
        await send({"type": "http.response.body", "body": tail, "more_body": False})
    finally:
        os.close(fd)


def _read_head(fd) -> tuple[bytes, bool]:
    """The first CHUNK bytes of a file, and whether that is all of it (reads until
    CHUNK bytes or end of file: pseudo-files may return short reads)."""
    parts, size = [], 0
    while size < CHUNK:
        part = os.read(fd, CHUNK - size)
        if not part:
            return b"".join(parts), True
        parts.append(part)
        size += len(part)
    return b"".join(parts), False


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
            self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        except IsADirectoryError:
            raise HTTPError(400, f"path '{path}' is a directory") from None
        except NotADirectoryError:
            raise HTTPError(400, f"a parent of '{path}' is not a directory") from None
        except PermissionError as exc:
            raise HTTPError(403, str(exc)) from None
        if os.geteuid() == 0:
            os.fchown(self.fd, pw.pw_uid, pw.pw_gid)
        if stat.S_IMODE(os.fstat(self.fd).st_mode) != 0o644:
            os.fchmod(self.fd, 0o644)
        self.metadata_set = write_metadata(self.fd, metadata) and bool(metadata)

    def write(self, data):
        self.state["bytes"] += len(data)
        if self.state["bytes"] > self.limit:
            raise HTTPError(413, f"upload exceeds the limit of {self.limit} bytes")
        view = memoryview(data)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]

    def close(self):
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def abort(self):
        self.close()
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
