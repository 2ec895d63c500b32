"""Connect-JSON framing, message codec and error mapping used by envd."""
import json
import struct

import pytest

from envd.connect import (
    CODE_TO_HTTP,
    ConnectError,
    EnvelopeReader,
    FLAG_END_STREAM,
    decode_message,
    encode_message,
    end_stream,
    envelope,
    error_from_exception,
)
from envd.proto import filesystem_pb2 as fpb
from envd.proto import process_pb2 as ppb


def test_envelope_header_is_flag_and_big_endian_length():
    frame = envelope(b'{"a":1}')
    assert frame[:5] == b"\x00\x00\x00\x00\x07"
    assert frame[5:] == b'{"a":1}'


def test_end_stream_success_and_error():
    ok = end_stream()
    assert ok == b"\x02\x00\x00\x00\x02{}"
    err = end_stream(ConnectError("not_found", "process with pid 7 not found"))
    flags, size = struct.unpack(">BI", err[:5])
    assert flags == FLAG_END_STREAM and size == len(err) - 5
    assert json.loads(err[5:]) == {"error": {"code": "not_found", "message": "process with pid 7 not found"}}


def test_reader_reassembles_split_and_packed_envelopes():
    stream = envelope(b'{"x":1}') + envelope(b"{}") + end_stream()
    reader = EnvelopeReader()
    got = []
    for i in range(len(stream)):  # one byte at a time
        got.extend(reader.feed(stream[i:i + 1]))
    assert [f for f, _ in got] == [0, 0, FLAG_END_STREAM]
    assert got[0][1] == b'{"x":1}'
    assert reader.pending == 0
    packed = EnvelopeReader().feed(stream)
    assert packed == got


def test_reader_rejects_compressed_and_oversized():
    with pytest.raises(ConnectError) as exc:
        EnvelopeReader().feed(b"\x01\x00\x00\x00\x00")
    assert exc.value.code == "unimplemented"
    with pytest.raises(ConnectError) as exc:
        EnvelopeReader(max_message_bytes=10).feed(b"\x00\x00\x00\x00\x20")
    assert exc.value.code == "resource_exhausted"


def test_start_request_decodes_sdk_json():
    body = b'{"process":{"cmd":"/bin/bash","args":["-l","-c","echo hello"],"envs":{"A":"1"},"cwd":"/tmp"},"stdin":false}'
    req = decode_message(body, ppb.StartRequest)
    assert req.process.cmd == "/bin/bash"
    assert list(req.process.args) == ["-l", "-c", "echo hello"]
    assert dict(req.process.envs) == {"A": "1"}
    assert req.HasField("stdin") and req.stdin is False
    assert not req.HasField("pty")


def test_stream_input_data_uses_field_two_and_snake_case_is_accepted():
    req = decode_message(b'{"data":{"input":{"stdin":"YQo="}}}', ppb.StreamInputRequest)
    assert req.data.input.stdin == b"a\n"
    assert ppb.StreamInputRequest.DataEvent.DESCRIPTOR.fields_by_name["input"].number == 2
    req = decode_message(b'{"watcher_id":"w1","unknownField":3}', fpb.GetWatcherEventsRequest)
    assert req.watcher_id == "w1"


def test_encode_uses_camel_case_enum_names_and_base64():
    ev = ppb.ProcessEvent(data=ppb.ProcessEvent.DataEvent(stdout=b"hello\n"))
    assert json.loads(encode_message(ppb.StartResponse(event=ev))) == {"event": {"data": {"stdout": "aGVsbG8K"}}}
    end = ppb.ProcessEvent(end=ppb.ProcessEvent.EndEvent(exit_code=-1, status="signal: killed", error="signal: killed"))
    assert json.loads(encode_message(ppb.StartResponse(event=end)))["event"]["end"]["exitCode"] == -1
    entry = fpb.EntryInfo(name="a", type=fpb.FILE_TYPE_FILE, is_symlink=True, symlink_target="/x")
    out = json.loads(encode_message(entry))
    assert out["type"] == "FILE_TYPE_FILE" and out["isSymlink"] is True and out["symlinkTarget"] == "/x"


def test_bad_json_is_invalid_argument():
    with pytest.raises(ConnectError) as exc:
        decode_message(b"{not json", ppb.ListRequest)
    assert exc.value.code == "invalid_argument"


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (FileNotFoundError("x"), "not_found"),
        (FileExistsError("x"), "already_exists"),
        (PermissionError("x"), "permission_denied"),
        (NotADirectoryError("x"), "invalid_argument"),
        (RuntimeError("boom"), "internal"),
    ],
)
def test_error_from_exception(exc, code):
    assert error_from_exception(exc).code == code


def test_http_status_table_matches_spec():
    assert CODE_TO_HTTP["not_found"] == 404
    assert CODE_TO_HTTP["unauthenticated"] == 401
    assert CODE_TO_HTTP["invalid_argument"] == 400
    assert CODE_TO_HTTP["deadline_exceeded"] == 504
    assert ConnectError("already_exists").http_status == 409
    with pytest.raises(ValueError):
        ConnectError("not_a_code")
