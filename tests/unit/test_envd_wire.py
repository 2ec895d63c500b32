"""envd.wire, the Connect framing shared by envd and envd_client: envelopes and
end-of-stream messages round-trip byte for byte, errors survive the trip with their
code, and error responses that are not Connect errors map like the E2B SDK maps them."""
import json
import subprocess
import sys

import pytest

from envd import connect, wire
from envd.wire import (
    FLAG_END_STREAM,
    ConnectError,
    EnvelopeReader,
    end_stream,
    envelope,
    error_from_response,
    parse_end_stream,
)


@pytest.mark.parametrize("payload", [b"", b"{}", b'{"event":{"start":{"pid":7}}}', bytes(range(256)) * 300])
def test_envelopes_round_trip_split_anywhere(payload):
    stream = envelope(payload) + envelope(payload, FLAG_END_STREAM)
    for step in (1, 2, 5, 7, len(stream)):
        reader, got = EnvelopeReader(), []
        for i in range(0, len(stream), step):
            got += reader.feed(stream[i:i + step])
        assert got == [(0, payload), (FLAG_END_STREAM, payload)]
        assert reader.pending == 0


def test_end_stream_round_trips_errors_and_metadata():
    assert parse_end_stream(end_stream()[5:]) == (None, {})
    frame = end_stream(ConnectError("not_found", "process with pid 7 not found"), {"x-trace": ["a", "b"]})
    [(flags, payload)] = EnvelopeReader().feed(frame)
    assert flags == FLAG_END_STREAM
    error, metadata = parse_end_stream(payload)
    assert error == {"code": "not_found", "message": "process with pid 7 not found"} and metadata == {"x-trace": ["a", "b"]}
    again = ConnectError.from_dict(error)
    assert (again.code, again.message, again.http_status) == ("not_found", "process with pid 7 not found", 404)
    assert end_stream(again, {"x-trace": ["a", "b"]}) == frame  # byte for byte


def test_end_stream_garbage_is_an_internal_error():
    assert parse_end_stream(b"{nope")[0]["code"] == "internal"
    assert parse_end_stream(b"[1]")[0]["code"] == "internal"


def test_unknown_codes_become_unknown():
    assert ConnectError.from_dict({"code": "teapot", "message": "x"}).code == "unknown"
    assert ConnectError.from_dict({"code": 404}).code == "unknown"
    assert ConnectError.from_dict(None).code == "unknown"


@pytest.mark.parametrize(("status", "body", "code", "message"), [
    (404, b'{"code":"not_found","message":"process with pid 9 not found"}', "not_found", "process with pid 9 not found"),
    (401, b'{"code":401,"message":"unauthorized access"}', "unauthenticated", "unauthorized access"),  # envd /files, /init
    (502, b'{"message":"The sandbox was not found","sandboxId":"x"}', "unavailable", "The sandbox was not found"),
    (503, b"upstream down", "unavailable", "HTTP 503: upstream down"),
    (413, b"", "resource_exhausted", "HTTP 413"),
    (418, b"[]", "unknown", "HTTP 418: []"),
])
def test_error_from_response(status, body, code, message):
    err = error_from_response(status, body)
    assert (err.code, err.message) == (code, message)


def test_error_from_response_builds_the_callers_class():
    class Mine(ConnectError):
        def __init__(self, code, message="", *, status=None):
            super().__init__(code, message)
            self.status = status

    err = error_from_response(409, b'{"code":"already_exists"}', Mine, status=409)
    assert isinstance(err, Mine) and err.code == "already_exists" and err.status == 409


def test_envd_connect_uses_the_shared_framing():
    assert connect.envelope is wire.envelope and connect.ConnectError is wire.ConnectError
    assert json.loads(connect.end_stream(ConnectError("internal", "x"))[5:]) == {"error": {"code": "internal",
                                                                                           "message": "x"}}


def test_wire_is_pure():
    """Importable without protobuf or Django: the host-side client depends on it."""
    code = "import sys, envd.wire; bad = {'google.protobuf', 'django', 'httpx'} & set(sys.modules); print(sorted(bad))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

