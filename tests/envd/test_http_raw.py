"""Wire-level checks with raw HTTP: Connect framing, content types, errors, /files edge cases."""
import gzip
import json
import struct

import httpx


def _frames(body):
    out = []
    while body:
        flags, size = struct.unpack(">BI", body[:5])
        out.append((flags, json.loads(body[5:5 + size])))
        body = body[5 + size:]
    return out


def _env(msg):
    data = json.dumps(msg).encode()
    return struct.pack(">BI", 0, len(data)) + data


def _stream(envd, path, msg, headers=None, timeout=10):
    h = {"content-type": "application/connect+json", "connect-protocol-version": "1"}
    h.update(headers or {})
    return httpx.post(envd.url + path, content=_env(msg), headers=h, timeout=timeout)


def test_health(envd):
    r = httpx.get(envd.url + "/health")
    assert r.status_code == 204 and r.content == b""


def test_start_stream_framing(envd):
    r = _stream(envd, "/process.Process/Start",
                {"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "echo hi; exit 3"]}, "stdin": False})
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/connect+json"
    frames = _frames(r.content)
    assert frames[0][0] == 0 and set(frames[0][1]["event"]) == {"start"}
    assert frames[1][1] == {"event": {"data": {"stdout": "aGkK"}}}
    end = frames[-2][1]["event"]["end"]
    assert end == {"exitCode": 3, "exited": True, "status": "exit status 3", "error": "exit status 3"}
    assert frames[-1] == (2, {})


def test_keepalive_is_sent_after_interval(envd):
    r = _stream(envd, "/process.Process/Start",
                {"process": {"cmd": "/bin/sh", "args": ["-c", "sleep 1.3; echo x"]}, "stdin": False},
                headers={"keepalive-ping-interval": "0.5"})
    events = [f[1].get("event", {}) for f in _frames(r.content) if f[0] == 0]
    assert sum(1 for e in events if "keepalive" in e) >= 2
    assert "end" in events[-1]


def test_stream_error_in_end_of_stream(envd):
    r = _stream(envd, "/process.Process/Connect", {"process": {"pid": 999999}})
    assert r.status_code == 200
    assert _frames(r.content) == [(2, {"error": {"code": "not_found", "message": "process with pid 999999 not found"}})]


def test_watch_dir_deadline_ends_stream(envd, workdir):
    r = _stream(envd, "/filesystem.Filesystem/WatchDir", {"path": workdir}, headers={"connect-timeout-ms": "600"})
    frames = _frames(r.content)
    assert frames[0] == (0, {"start": {}})
    assert frames[-1][0] == 2 and frames[-1][1]["error"]["code"] == "deadline_exceeded"


def test_unary_errors_are_connect_json(envd):
    h = {"content-type": "application/json"}
    r = httpx.post(envd.url + "/process.Process/SendSignal", headers=h,
                   content=json.dumps({"process": {"pid": 999999}, "signal": "SIGNAL_SIGKILL"}))
    assert r.status_code == 404 and r.json()["code"] == "not_found"
    r = httpx.post(envd.url + "/filesystem.Filesystem/Stat", headers=h, content=b"{broken")
    assert r.status_code == 400 and r.json()["code"] == "invalid_argument"
    auth = {"authorization": "Basic bm9ib2R5LXN1Y2g6", **h}  # "nobody-such:"
    r = httpx.post(envd.url + "/process.Process/List", headers=auth, content=b"{}")
    assert r.status_code == 401 and r.json()["code"] == "unauthenticated"
    r = httpx.post(envd.url + "/process.Process/List", headers={"content-type": "text/plain"}, content=b"{}")
    assert r.status_code == 415
    r = httpx.post(envd.url + "/nope.Service/Method", headers=h, content=b"{}")
    assert r.status_code == 404


def test_stream_input_response_is_one_message_plus_trailer(envd):
    start = _stream(envd, "/process.Process/Start",
                    {"process": {"cmd": "/bin/sleep", "args": ["5"]}, "stdin": True},
                    headers={"connect-timeout-ms": "300"})
    pid = _frames(start.content)[0][1]["event"]["start"]["pid"]
    body = _env({"start": {"process": {"pid": pid}}}) + _env({"keepalive": {}})
    r = httpx.post(envd.url + "/process.Process/StreamInput", content=body,
                   headers={"content-type": "application/connect+json"})
    # Process already killed by its 300 ms lifetime -> error in trailer.
    frames = _frames(r.content)
    assert frames[-1][0] == 2 and frames[-1][1]["error"]["code"] == "not_found"


def test_files_missing_path_and_directory(envd, workdir):
    r = httpx.get(envd.url + "/files")
    assert r.status_code == 400 and r.json()["code"] == 400
    r = httpx.get(envd.url + "/files", params={"path": workdir})
    assert r.status_code == 400
    r = httpx.post(envd.url + "/files", params={"path": workdir}, content=b"x",
                   headers={"content-type": "application/octet-stream"})
    assert r.status_code == 400
    r = httpx.post(envd.url + "/files", content=b"x", headers={"content-type": "application/octet-stream"})
    assert r.status_code == 400
    r = httpx.post(envd.url + "/files", files={"file": ("", b"x")})
    assert r.status_code == 400
    r = httpx.get(envd.url + "/files", params={"path": "x", "username": "nobody-such"})
    assert r.status_code == 401 and r.json()["code"] == 401
    r = httpx.post(envd.url + "/files", params={"path": f"{workdir}/a", "username": "nobody-such"},
                   content=b"x", headers={"content-type": "application/octet-stream"})
    assert r.status_code == 401


def test_files_gzip_upload_raw_and_bad_gzip(envd, workdir):
    r = httpx.post(envd.url + "/files", params={"path": f"{workdir}/z.txt"}, content=gzip.compress(b"zipped"),
                   headers={"content-type": "application/octet-stream", "content-encoding": "gzip"})
    assert r.status_code == 200 and r.json() == [{"name": "z.txt", "type": "file", "path": f"{workdir}/z.txt"}]
    assert open(f"{workdir}/z.txt", "rb").read() == b"zipped"
    r = httpx.post(envd.url + "/files", params={"path": f"{workdir}/bad.txt"}, content=b"not gzip",
                   headers={"content-type": "application/octet-stream", "content-encoding": "gzip"})
    assert r.status_code == 400
    r = httpx.get(envd.url + "/files", params={"path": f"{workdir}/z.txt"}, headers={"accept-encoding": "gzip"})
    assert r.headers.get("content-encoding") == "gzip" and r.content == b"zipped"


def test_upload_limit_413(sandbox_user, workdir):
    from .conftest import EnvdServer

    server = EnvdServer("--max-upload-bytes", "1000")
    try:
        r = httpx.post(server.url + "/files", params={"path": f"{workdir}/big"}, content=b"x" * 5000,
                       headers={"content-type": "application/octet-stream"})
        assert r.status_code == 413 and r.json()["code"] == 413
        body = iter([b"y" * 600, b"y" * 600])  # chunked, no Content-Length
        r = httpx.post(server.url + "/files", params={"path": f"{workdir}/big2"}, content=body,
                       headers={"content-type": "application/octet-stream"})
        assert r.status_code == 413
        import os
        assert not os.path.exists(f"{workdir}/big2")
        r = httpx.post(server.url + "/files", params={"path": f"{workdir}/ok"}, content=b"z" * 900,
                       headers={"content-type": "application/octet-stream"})
        assert r.status_code == 200
    finally:
        server.stop()


def test_init_validation(envd):
    r = httpx.post(envd.url + "/init", content=b"[1]", headers={"content-type": "application/json"})
    assert r.status_code == 400
    r = httpx.post(envd.url + "/init", json={"envVars": {"A": 1}})
    assert r.status_code == 400
    r = httpx.post(envd.url + "/init", json={"timestamp": "not-a-time"})
    assert r.status_code == 204  # clock problems never fail /init


def test_init_entropy_seed_validation(envd):
    import base64

    for bad in ("not base64!", base64.b64encode(b"x" * 8).decode(), base64.b64encode(b"x" * 513).decode(), 42):
        r = httpx.post(envd.url + "/init", json={"entropySeed": bad})
        assert r.status_code == 400, bad
        assert "entropySeed" in r.json()["message"]
    # A bad seed fails the whole /init: nothing else in the body was applied.
    r = httpx.post(envd.url + "/init", json={"envVars": {"SEED_TEST": "1"}, "entropySeed": "%%%"})
    assert r.status_code == 400
    assert "SEED_TEST" not in httpx.get(envd.url + "/envs").json()
    r = httpx.post(envd.url + "/init", json={"entropySeed": base64.b64encode(b"\x01" * 64).decode()})
    assert r.status_code == 204


def test_sync_endpoint(envd):
    assert httpx.post(envd.url + "/aenv/sync").status_code == 204
    assert httpx.get(envd.url + "/aenv/sync").status_code in (401, 404)  # only POST is the sync


def test_multipart_parts_to_one_path_are_refused(envd, workdir):
    """A ``path`` parameter names the destination of every part (E2B's envd too), so two
    parts with it, or two parts whose filenames resolve alike, are a 400 before the second
    file is written (the first one stays, as with E2B's envd)."""
    r = httpx.post(envd.url + "/files", params={"path": f"{workdir}/p.txt"},
                   files=[("file", ("a.txt", b"first")), ("file", ("b.txt", b"second"))])
    assert r.status_code == 400 and f"'{workdir}/p.txt'" in r.json()["message"]
    assert open(f"{workdir}/p.txt", "rb").read() == b"first"
    name = workdir.rsplit("/", 1)[1]
    r = httpx.post(envd.url + "/files",
                   files=[("file", (f"{name}/d.txt", b"1")), ("file", (f"{workdir}/d.txt", b"2"))])
    assert r.status_code == 400 and open(f"{workdir}/d.txt", "rb").read() == b"1"
