"""envd's side of the Connect protocol (JSON codec): protobuf messages to and from JSON,
exceptions to Connect errors, on the framing of ``envd.wire``.

We implement the wire format ourselves instead of using connectrpc's server so we
control stream lifetimes (keepalives, deadlines, disconnects that must not kill
processes) and keep startup imports small for TCG-emulated guests. The framing, the
error codes and their HTTP statuses live in ``envd.wire`` (pure, shared with the
host-side ``envd_client``); this module re-exports them for envd's own modules.
"""

from google.protobuf import json_format

from .oserrors import classify
from .wire import (  # noqa: F401  (re-exported: envd's modules import them from here)
    CODE_TO_HTTP,
    FLAG_COMPRESSED,
    FLAG_END_STREAM,
    STREAM_CONTENT_TYPE,
    UNARY_CONTENT_TYPE,
    ConnectError,
    EnvelopeReader,
    encode_json,
    end_stream,
    envelope,
)


def error_from_exception(exc):
    """Map an arbitrary exception to a ConnectError: OS errors by ``envd.oserrors``' table."""
    if isinstance(exc, ConnectError):
        return exc
    found = classify(exc)
    if found is not None:
        return ConnectError(found[1], str(exc))
    if isinstance(exc, ValueError):
        return ConnectError("invalid_argument", str(exc))
    return ConnectError("internal", f"{type(exc).__name__}: {exc}")


def encode_message(msg):
    """Serialize a protobuf message to compact canonical JSON bytes."""
    return encode_json(json_format.MessageToDict(msg))


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
