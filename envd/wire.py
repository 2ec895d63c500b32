"""The Connect protocol's wire format (JSON codec), shared by envd and the host-side client.

Why a module of its own: envd (the server, in the guest) and ``envd_client`` (the host
side: node agent, vmm, dashboard, CLI) must agree on every byte of the framing, so there
is one copy of it. It is pure (``struct`` + ``json``, no protobuf, no I/O) so the client
can use it without envd's protobuf messages and the guest bundle stays small.

What is here (spec: ``shared/spec/e2b-compat.md`` §3.2):

* envelopes: 1 flag byte + 4-byte big-endian length + payload (``envelope``,
  ``EnvelopeReader`` for byte chunks split or packed arbitrarily);
* the end-of-stream envelope (flag ``0x02``): ``{}``, or ``{"error": {code, message}}``
  and/or ``{"metadata": {...}}`` (``end_stream``, ``parse_end_stream``);
* the Connect error codes, their HTTP statuses (``CODE_TO_HTTP``, used by the server)
  and the reverse mapping for responses that are not Connect errors (``HTTP_TO_CODE``,
  as the E2B SDK maps them), with ``ConnectError`` and ``error_from_response``.
"""

import json
import struct

UNARY_CONTENT_TYPE = "application/json"
STREAM_CONTENT_TYPE = "application/connect+json"

FLAG_COMPRESSED = 0x01
FLAG_END_STREAM = 0x02

HEADER = struct.Struct(">BI")  # flags, payload length

# Connect code -> HTTP status for unary (and pre-stream) error responses.
CODE_TO_HTTP = {
    "canceled": 499,
    "unknown": 500,
    "invalid_argument": 400,
    "deadline_exceeded": 504,
    "not_found": 404,
    "already_exists": 409,
    "permission_denied": 403,
    "resource_exhausted": 429,
    "failed_precondition": 400,
    "aborted": 409,
    "out_of_range": 400,
    "unimplemented": 501,
    "internal": 500,
    "unavailable": 503,
    "data_loss": 500,
    "unauthenticated": 401,
}

# HTTP status -> Connect code for error responses that carry no Connect code (a proxy's
# plain 502, envd's ``/files`` and ``/init`` errors with an integer ``code``): the E2B
# SDK's table; any other status is ``unknown``.
HTTP_TO_CODE = {
    400: "invalid_argument",
    401: "unauthenticated",
    403: "permission_denied",
    404: "not_found",
    409: "already_exists",
    413: "resource_exhausted",
    429: "resource_exhausted",
    499: "canceled",
    500: "internal",
    501: "unimplemented",
    502: "unavailable",
    503: "unavailable",
    504: "deadline_exceeded",
    505: "unimplemented",
}


class ConnectError(Exception):
    """An RPC failure carrying a Connect error code string (e.g. ``not_found``)."""

    def __init__(self, code, message=""):
        if code not in CODE_TO_HTTP:
            raise ValueError(f"unknown connect code {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message

    @property
    def http_status(self):
        return CODE_TO_HTTP[self.code]

    def to_dict(self):
        out = {"code": self.code}
        if self.message:
            out["message"] = self.message
        return out

    @classmethod
    def from_dict(cls, data, /, **kwargs):
        """From a wire error object ``{"code", "message"}``; a code this side does not
        know (or a non-string one) becomes ``unknown``."""
        data = data if isinstance(data, dict) else {}
        code = data.get("code")
        message = data.get("message")
        return cls(code if code in CODE_TO_HTTP else "unknown", "" if message is None else str(message), **kwargs)


def code_for_http_status(status):
    """The Connect code for an HTTP error status that came without one."""
    return HTTP_TO_CODE.get(status, "unknown")


def error_from_response(status, body, error_cls=ConnectError, /, **kwargs):
    """The error an HTTP error response stands for: a Connect error body
    ``{"code": "<code>", "message"}`` keeps its code; anything else (an integer code, a
    proxy's text) is mapped by HTTP status, with the JSON ``message`` or the raw text."""
    message = None
    try:
        data = json.loads(body or b"null")
    except (ValueError, UnicodeDecodeError):
        data = None
    if isinstance(data, dict):
        if isinstance(data.get("code"), str) and data["code"] in CODE_TO_HTTP:
            return error_cls.from_dict(data, **kwargs)
        if data.get("message") is not None:
            message = str(data["message"])
    if message is None:
        text = body.decode(errors="replace") if isinstance(body, (bytes, bytearray)) else str(body or "")
        message = f"HTTP {status}" + (f": {text[:300]}" if text else "")
    return error_cls(code_for_http_status(status), message, **kwargs)


def encode_json(obj):
    """Compact JSON bytes, the form every message and trailer is sent in."""
    return json.dumps(obj, separators=(",", ":")).encode()


def decode_json(payload):
    """A message's JSON object (an empty payload is ``{}``); bad JSON -> ValueError."""
    return json.loads(payload or b"{}")


def envelope(payload, flags=0):
    """Frame ``payload`` with the 5-byte Connect envelope header."""
    return HEADER.pack(flags, len(payload)) + payload


def end_stream(error=None, metadata=None):
    """Build the end-of-stream envelope, optionally carrying an error and trailers."""
    body = {}
    if error is not None:
        body["error"] = error.to_dict()
    if metadata:
        body["metadata"] = metadata
    return envelope(encode_json(body), FLAG_END_STREAM)


def parse_end_stream(payload):
    """``(error, metadata)`` of an end-of-stream payload: the error object as sent (a
    dict, None on success) and the trailers (``{}`` if none)."""
    try:
        body = decode_json(payload)
    except (ValueError, UnicodeDecodeError):
        return {"code": "internal", "message": "undecodable end-of-stream message"}, {}
    if not isinstance(body, dict):
        return {"code": "internal", "message": "end-of-stream message is not an object"}, {}
    error = body.get("error")
    return (error if error else None), (body.get("metadata") or {})


class EnvelopeReader:
    """Incrementally reassembles envelopes from arbitrarily split byte chunks."""

    def __init__(self, max_message_bytes=64 << 20):
        self._buf = bytearray()
        self._max = max_message_bytes

    def feed(self, chunk):
        """Add bytes; return the list of complete ``(flags, payload)`` envelopes."""
        self._buf += chunk
        out = []
        while len(self._buf) >= 5:
            flags, size = HEADER.unpack_from(self._buf)
            if size > self._max:
                raise ConnectError("resource_exhausted", f"message of {size} bytes exceeds limit")
            if len(self._buf) < 5 + size:
                break
            payload = bytes(self._buf[5 : 5 + size])
            del self._buf[: 5 + size]
            if flags & FLAG_COMPRESSED:
                raise ConnectError("unimplemented", "compressed messages are not supported")
            out.append((flags, payload))
        return out

    @property
    def pending(self):
        """Bytes of an incomplete trailing envelope."""
        return len(self._buf)

