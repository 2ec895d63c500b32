"""Minimal Connect-protocol (JSON codec) primitives: errors, envelopes, message codec.

We implement the wire format ourselves instead of using connectrpc's server so we
control stream lifetimes (keepalives, deadlines, disconnects that must not kill
processes) and keep startup imports small for TCG-emulated guests.
"""

import json
import struct

from google.protobuf import json_format

UNARY_CONTENT_TYPE = "application/json"
STREAM_CONTENT_TYPE = "application/connect+json"

FLAG_COMPRESSED = 0x01
FLAG_END_STREAM = 0x02

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


def error_from_exception(exc):
    """Map an arbitrary exception to a ConnectError (OS errors get sensible codes)."""
    if isinstance(exc, ConnectError):
        return exc
    if isinstance(exc, FileNotFoundError):
        return ConnectError("not_found", str(exc))
    if isinstance(exc, FileExistsError):
        return ConnectError("already_exists", str(exc))
    if isinstance(exc, PermissionError):
        return ConnectError("permission_denied", str(exc))
    if isinstance(exc, (NotADirectoryError, IsADirectoryError, ValueError)):
        return ConnectError("invalid_argument", str(exc))
    return ConnectError("internal", f"{type(exc).__name__}: {exc}")


def encode_message(msg):
    """Serialize a protobuf message to compact canonical JSON bytes."""
    return json.dumps(json_format.MessageToDict(msg), separators=(",", ":")).encode()


def decode_message(data, cls):
    """Parse JSON bytes into a new ``cls`` message; bad input -> invalid_argument."""
    msg = cls()
    if not data or not data.strip():
        return msg
    try:
        json_format.Parse(data, msg, ignore_unknown_fields=True)
    except (json_format.ParseError, UnicodeDecodeError, ValueError) as exc:
        raise ConnectError("invalid_argument", f"invalid request body: {exc}") from exc
    return msg


def envelope(payload, flags=0):
    """Frame ``payload`` with the 5-byte Connect envelope header."""
    return struct.pack(">BI", flags, len(payload)) + payload


def end_stream(error=None, metadata=None):
    """Build the end-of-stream envelope, optionally carrying an error."""
    body = {}
    if error is not None:
        body["error"] = error.to_dict()
    if metadata:
        body["metadata"] = metadata
    return envelope(json.dumps(body, separators=(",", ":")).encode(), FLAG_END_STREAM)


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
            flags, size = struct.unpack_from(">BI", self._buf)
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
