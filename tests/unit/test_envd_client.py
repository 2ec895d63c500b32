"""envd_client without an envd: the /init body the node sends, the headers every call
carries (token, user, the data plane's routing), how answers that are not envd's own
are read (a proxy's 502, a stream cut short or ending in an error), and that importing
it stays light. The real-envd tests are tests/envd/test_client.py."""
import base64
import json
import subprocess
import sys
from datetime import datetime, timezone

import httpx
import pytest

from envd.wire import FLAG_END_STREAM, ConnectError, end_stream, envelope
from envd_client import AsyncEnvdClient, EnvdClient, EnvdError, EnvdUnavailable, protocol


def test_init_body_is_what_the_node_sends():
    at = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=timezone.utc)
    body = protocol.init_body({"A": "1"}, access_token="tok", timestamp=at, entropy_seed=b"\x01" * 64)
    assert body == {"envVars": {"A": "1"}, "timestamp": "2026-01-02T03:04:05.678901Z",
                    "entropySeed": base64.b64encode(b"\x01" * 64).decode(), "accessToken": "tok"}
    # the template's disk says the defaults (envd.state.TEMPLATE_DEFAULTS); given ones are sent
    assert protocol.init_body(None, default_user="app", default_workdir="/app")["defaultWorkdir"] == "/app"
    plain = protocol.init_body(None)
    assert plain["envVars"] == {} and "accessToken" not in plain and plain["timestamp"].endswith("Z")
    seeds = {protocol.init_body()["entropySeed"] for _ in range(3)}
    assert len(seeds) == 3 and all(len(base64.b64decode(s)) == 64 for s in seeds)  # fresh every time


def recording(handler):
    seen = []

    def record(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return handler(request)

    return seen, httpx.MockTransport(record)


def test_headers_token_user_and_proxy_routing():
    seen, transport = recording(lambda r: httpx.Response(200, json={"processes": []}))
    with EnvdClient.through_proxy("http://dp.example:3001", "sbx1", "tok", transport=transport) as envd:
        assert envd.list() == []
        envd.init({}, access_token="new")
        envd.list()
    first, init, last = seen
    assert str(first.url) == "http://dp.example:3001/process.Process/List"
    assert first.headers["e2b-sandbox-id"] == "sbx1" and first.headers["e2b-sandbox-port"] == "49983"
    assert first.headers["x-access-token"] == "tok" and first.headers["connect-protocol-version"] == "1"
    assert first.headers["content-type"] == "application/json" and first.content == b"{}"
    assert init.headers["x-access-token"] == "tok" and json.loads(init.content)["accessToken"] == "new"
    assert last.headers["x-access-token"] == "new"  # the installed token from then on


def test_stream_request_is_one_envelope_with_user_and_deadline():
    def answer(request):
        frames = envelope(b'{"event":{"start":{"pid":4}}}') + envelope(b'{"event":{"end":{}}}') + end_stream()
        return httpx.Response(200, stream=httpx.ByteStream(frames), headers={"content-type": "application/connect+json"})

    seen, transport = recording(answer)
    with EnvdClient("http://envd", transport=transport) as envd:
        result = envd.run("echo hi", user="root", deadline=2.5, envs={"K": "V"})
    assert (result.pid, result.exit_code, result.stdout) == (4, 0, b"")
    [req] = seen
    assert req.headers["content-type"] == "application/connect+json"
    assert req.headers["authorization"] == "Basic " + base64.b64encode(b"root:").decode()
    assert req.headers["connect-timeout-ms"] == "2500" and req.headers["keepalive-ping-interval"] == "10"
    assert "x-access-token" not in req.headers
    assert req.content[:1] == b"\x00" and int.from_bytes(req.content[1:5], "big") == len(req.content) - 5
    assert json.loads(req.content[5:]) == {"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "echo hi"],
                                                       "envs": {"K": "V"}}, "stdin": False}


def split_stream(*frames: bytes):
    """A streaming answer delivered one byte per chunk."""
    data = b"".join(frames)
    return httpx.Response(200, stream=_Bytes(data),
                          headers={"content-type": "application/connect+json"})


class _Bytes(httpx.SyncByteStream):
    def __init__(self, data):
        self.data = data

    def __iter__(self):
        for i in range(len(self.data)):
            yield self.data[i:i + 1]


def test_events_before_an_end_of_stream_error_are_delivered_then_the_error_raised():
    frames = (envelope(b'{"event":{"start":{"pid":9}}}'), envelope(b'{"event":{"data":{"stdout":"aGk="}}}'),
              end_stream(ConnectError("deadline_exceeded", "stream deadline exceeded")))
    _, transport = recording(lambda r: split_stream(*frames))
    got = []
    with EnvdClient("http://envd", transport=transport) as envd, pytest.raises(EnvdError) as exc:
        for ev in envd.connect(9):
            got.append(ev)
    assert [(e.kind, e.data) for e in got] == [("start", b""), ("data", b"hi")]
    assert (exc.value.code, exc.value.message) == ("deadline_exceeded", "stream deadline exceeded")


def test_a_stream_cut_short_is_unavailable():
    _, transport = recording(lambda r: split_stream(envelope(b'{"event":{"start":{"pid":9}}}'), b"\x00\x00"))
    with EnvdClient("http://envd", transport=transport) as envd, pytest.raises(EnvdUnavailable) as exc:
        list(envd.connect(9))
    assert "without an end-of-stream" in exc.value.message


def test_a_stream_without_end_event_is_an_error_for_run():
    _, transport = recording(lambda r: split_stream(envelope(b'{"event":{"start":{"pid":9}}}'), end_stream()))
    with EnvdClient("http://envd", transport=transport) as envd, pytest.raises(EnvdError) as exc:
        envd.run("true")
    assert exc.value.code == "internal"


@pytest.mark.parametrize(("status", "body", "code", "message"), [
    (502, {"message": "The sandbox was not found", "code": 502}, "unavailable", "The sandbox was not found"),
    (404, {"code": "not_found", "message": "process with pid 3 not found"}, "not_found", "process with pid 3 not found"),
    (401, {"code": 401, "message": "unauthorized access"}, "unauthenticated", "unauthorized access"),
])
def test_error_answers_keep_code_message_and_status(status, body, code, message):
    _, transport = recording(lambda r: httpx.Response(status, json=body))
    with EnvdClient("http://envd", transport=transport) as envd:
        for call in (lambda: envd.resize(3, 1, 1), lambda: next(envd.connect(3)), lambda: envd.read_file("/x")):
            with pytest.raises(EnvdError) as exc:
                call()
            assert (exc.value.code, exc.value.message, exc.value.status) == (code, message, status)
        assert envd.health() is False


def test_health_accepts_2xx_only():
    _, transport = recording(lambda r: httpx.Response(204))
    with EnvdClient("http://envd", transport=transport) as envd:
        assert envd.health() is True


async def test_async_client_reads_the_same_streams():
    frames = envelope(b'{"event":{"start":{"pid":2}}}') + envelope(b'{"event":{"data":{"pty":"eA=="}}}') \
        + envelope(b'{"event":{"end":{"exitCode":3,"status":"exit status 3"}}}') + end_stream()
    transport = httpx.MockTransport(lambda r: httpx.Response(200, stream=httpx.ByteStream(frames)))
    async with AsyncEnvdClient("http://envd", transport=transport) as envd:
        events = [ev async for ev in envd.start_pty(80, 24, tag="t")]
    assert [(e.kind, e.stream, e.data, e.exit_code) for e in events] == [
        ("start", "", b"", None), ("data", "pty", b"x", None), ("end", "", b"", 3)]


def test_exception_hierarchy():
    assert issubclass(EnvdUnavailable, EnvdError) and issubclass(EnvdError, ConnectError)
    assert EnvdError("not_a_code", "x").code == "unknown"
    assert str(EnvdError("not_found", "gone")) == "not_found: gone"
    assert EnvdUnavailable("refused").code == "unavailable"
    assert FLAG_END_STREAM == 2


def test_import_is_light():
    """The CLI will ship on its own: no Django, no protobuf, and httpx only once a client
    class is used."""
    code = ("import sys, envd_client; light = {'django', 'google.protobuf', 'httpx'} & set(sys.modules); "
            "envd_client.EnvdClient; heavy = {'django', 'google.protobuf'} & set(sys.modules); "
            "print(sorted(light), sorted(heavy), 'httpx' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["[]", "[]", "True"]


def test_files_stream_in_chunks_with_their_length_and_progress(tmp_path):
    src = tmp_path / "blob"
    src.write_bytes(b"x" * (protocol.FILE_CHUNK * 2 + 5))
    bodies = []

    def answer(request):
        if request.method == "POST":
            bodies.append((request.headers["content-length"], request.read()))
            return httpx.Response(200, json=[{"name": "b", "type": "file", "path": "/home/user/b"}])
        return httpx.Response(200, content=b"y" * 300_000)

    seen, transport = recording(answer)
    sent, got = [], []
    with EnvdClient("http://envd", transport=transport) as envd:
        assert envd.upload_file("b", src, user="root", on_chunk=sent.append)["path"] == "/home/user/b"
        with open(tmp_path / "out", "wb") as sink:
            assert envd.download_file("b", sink, on_chunk=got.append) == 300_000
    assert bodies == [(str(src.stat().st_size), src.read_bytes())]
    assert sent == [protocol.FILE_CHUNK, protocol.FILE_CHUNK, 5] and sum(got) == 300_000
    assert (tmp_path / "out").read_bytes() == b"y" * 300_000
    assert seen[0].url.params["path"] == "b" and seen[0].url.params["username"] == "root"


def test_filesystem_entries_read_from_proto_json():
    answer = {"entries": [{"name": "d", "type": "FILE_TYPE_DIRECTORY", "path": "/d", "mode": 493},
                          {"name": "f", "type": "FILE_TYPE_FILE", "path": "/d/f", "size": "12"},
                          {"name": "l", "type": "FILE_TYPE_FILE", "path": "/d/l", "isSymlink": True,
                           "symlinkTarget": "/d/f"}]}
    seen, transport = recording(lambda r: httpx.Response(200, json=answer))
    with EnvdClient("http://envd", transport=transport) as envd:
        entries = envd.list_dir("/d", 3, user="user")
    assert [(e.type, e.size, e.mode, e.is_symlink) for e in entries] == [("dir", 0, 493, False), ("file", 12, 0, False),
                                                                        ("file", 0, 0, True)]
    assert json.loads(seen[0].content) == {"path": "/d", "depth": 3} and seen[0].headers["authorization"]
