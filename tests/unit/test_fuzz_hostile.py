"""Hand-written hostile inputs for every API route that takes a path, a URL, an image reference,
template build steps, a tar archive or a command, plus hostile framing (invalid UTF-8 and NUL
bytes in bodies, headers and paths, oversized and deeply nested bodies, hostile Host headers on
both planes), against a real control plane whose node runs the fake driver (harness/fake_stack.py).

Each case: an answer within its timeout (no hang), below 500, an error as JSON ``{code, message}``
with its own status as ``code`` (or the documented answer: the data plane's 502 for a sandbox
it cannot find), and at the end nothing written outside where it belongs (the marker file the
traversal cases try to create exists nowhere; the stack's home only grew where the routes keep
their files). What only a guest answers (envd's paths and commands) is in
tests/integration/test_fuzz_envd.py, on a real VM."""
from __future__ import annotations

import asyncio
import gzip
import hashlib
import io
import json
import os
import socket
import subprocess
import tarfile
import time
import uuid
from pathlib import Path
from urllib.parse import quote, urlsplit

import httpx
import pytest

from harness.fake_stack import fake_stack, files_under

pytestmark = [pytest.mark.xdist_group("fuzz-hostile"), pytest.mark.timeout(600)]


def short(value) -> str:
    """A readable test id for a hostile value (some are megabytes)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:30]}...({len(text)})"

TIMEOUT = 20  # s: an answer later than this is a hang
MARK = f"fuzzmark-{uuid.uuid4().hex[:10]}"  # the file every traversal tries to create
TRAVERSALS = [
    f"../{MARK}", f"../../{MARK}", f"../../../{MARK}", f"{'../' * 16}tmp/{MARK}", f"/../{MARK}",
    f"a/../../{MARK}", f"./../{MARK}", f"..\\..\\{MARK}", f"%2e%2e/{MARK}", f"..%2f{MARK}",
    f"....//{MARK}", f"/proc/self/cwd/{MARK}", f"{'a/' * 2000}{MARK}", f"{'x' * 5000}",
]
BAD_STRINGS = ["a\x00b", "\x00", "\ud800", "\u202e" + "x", "x" * 10_000]


@pytest.fixture(scope="module")
def stack():
    with fake_stack("fuzz-hostile", AENV_TEMPLATE_FILE_MAX_UNPACKED_BYTES=str(UNPACKED_LIMIT)) as s:
        s.before = files_under(s.home)
        yield s


@pytest.fixture(scope="module")
def api(stack):
    with httpx.Client(base_url=stack.api_url, headers=stack.headers(), timeout=TIMEOUT) as c:
        yield c


def answered(resp: httpx.Response, allowed: set[int] | None = None, what: str = "") -> httpx.Response:
    """Below 500, in ``allowed`` when given; an error is E2B's JSON with its status as code."""
    what = what or f"{resp.request.method} {str(resp.request.url)[:200]}"
    assert resp.status_code < 500, f"{what}: {resp.status_code} {resp.text[:500]}"
    if allowed is not None:
        assert resp.status_code in allowed, f"{what}: {resp.status_code} {resp.text[:500]}"
    if resp.status_code >= 400:
        assert resp.headers.get("content-type", "").startswith("application/json"), \
            f"{what}: {resp.status_code} {resp.headers.get('content-type')} {resp.text[:300]}"
        body = resp.json()
        assert body.get("code") == resp.status_code and isinstance(body.get("message"), str) and body["message"], \
            f"{what}: {body}"
    return resp


def post_json(client: httpx.Client, path: str, obj) -> httpx.Response:
    """JSON as the wire carries it: ASCII with escapes, so lone surrogates get through too."""
    return client.post(path, content=json.dumps(obj).encode(), headers={"Content-Type": "application/json"})


def raw(url: str, request: bytes, wait: float = TIMEOUT) -> tuple[int | None, bytes]:
    """One raw HTTP/1.1 exchange (bytes no client library sends: invalid UTF-8 and NUL in the
    request line and headers), read until the server closes (``Connection: close``).
    (status or None if the server closed without answering, answer); a hang raises."""
    host, port = urlsplit(url).hostname, urlsplit(url).port
    with socket.create_connection((host, port), timeout=wait) as s:
        s.sendall(request)
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
        except ConnectionResetError:
            pass
    if not data:
        return None, b""
    return int(data.split(b" ", 2)[1]), data


def raw_answered(url: str, request: bytes, allowed: set[int], closed_ok: bool = False) -> None:
    status, data = raw(url, request)
    if status is None:
        assert closed_ok, f"no answer to {request[:200]!r}"
        return
    head, _, body = data.partition(b"\r\n\r\n")
    assert status in allowed, f"{request[:200]!r}: {data[:600]!r}"
    if status >= 400 and b"application/json" in head.lower():
        if b"transfer-encoding: chunked" in head.lower():
            return  # framing of the body aside, the status is what counts here
        parsed = json.loads(body)
        assert parsed["code"] == status and parsed["message"], parsed


def request(method: str, path: bytes, headers: dict[bytes, bytes], body: bytes = b"") -> bytes:
    lines = [method.encode() + b" " + path + b" HTTP/1.1"]
    headers = {b"Connection": b"close", b"Content-Length": str(len(body)).encode(), **headers}
    lines += [k + b": " + v for k, v in headers.items()]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


# ---------------------------------------------------------------- JSON bodies and framing


@pytest.mark.parametrize("body", ids=short, argvalues=[
    b'{"templateID": "\xff\xfe"}',                       # invalid UTF-8
    b'{"templateID": "base", "metadata": {"a": "\xc3\x28"}}',
    b'{"templateID": "base\x00"}',                       # a raw NUL inside a JSON string
    b'\x00' * 64,
    b'[' * 100_000 + b']' * 100_000,                     # nesting deeper than any parser's stack
    b'{"a":' * 50_000 + b'1' + b'}' * 50_000,
    b'{"templateID": "base", "timeout": 1e999}',         # infinity
    b'{"templateID": "base", "timeout": -1}',
    b'{"templateID": "base", "timeout": ' + b'9' * 5000 + b'}',  # past int parsing's digit limit
    b'{"templateID": "base", "timeout": NaN}',
    b'null', b'"x"', b'1', b'[]', b'', b'{', b'{"templateID": "base",}',
    b'\xef\xbb\xbf{"templateID": "base"}',               # a byte order mark
    b'{"templateID": "base", "metadata": {"\\u0000": "x"}}',
    b'{"templateID": "base", "envVars": {"A\\u0000B": "x"}}',
    b'{"templateID": "base", "envVars": {"A=B": "x"}}',
    b'{"templateID": "base", "envVars": {"A": "x\\u0000y"}}',
    b'{"templateID": "base", "envVars": {"": "x"}}',
    b'{"templateID": "\\ud800"}',                       # a lone surrogate
    b'{"templateID": "../../../etc/passwd"}',
    b'{"templateID": "base", "network": {"allowOut": ["\\u0000"]}}',
    b'{"templateID": "base", "network": {"denyOut": ["999.1.1.1/99"]}}',
    b'{"templateID": "base", "network": {"maskRequestHost": "\\u0000"}}',
    b'{"templateID": "base", "volumeMounts": [{"name": "../../x", "path": "/mnt"}]}',
    b'{"templateID": "base", "volumeMounts": [{"name": "v", "path": "../../etc"}]}',
])
def test_create_bodies(api, body):
    resp = answered(api.post("/v2/sandboxes", content=body, headers={"Content-Type": "application/json"}))
    if resp.status_code == 201:  # what was accepted must be what was meant: kill it again
        answered(api.delete(f"/sandboxes/{resp.json()['sandboxID']}"), {204})
        assert body.startswith(b"\xef\xbb\xbf") is False, "a BOM-prefixed body is not JSON"
        pytest.fail(f"accepted: {body[:200]!r}")


def test_oversized_bodies(api, stack):
    big = b'{"templateID": "base", "metadata": {"a": "' + b"x" * 3_000_000 + b'"}}'
    for path in ("/v2/sandboxes", "/sandboxes/nope/timeout", "/volumes", "/events/webhooks", "/v3/templates",
                 "/secrets"):
        answered(api.post(path, content=big, headers={"Content-Type": "application/json"}), {413})
    # a length that is not one: refused at once
    for length in (b"-1", b"abc", b"1, 2"):
        status, _ = raw(stack.api_url, request("POST", b"/v2/sandboxes", {
            b"Host": b"127.0.0.1", b"X-API-Key": stack.api_key.encode(), b"Content-Type": b"application/json",
            b"Content-Length": length}))
        assert status is None or 400 <= status < 500, (length, status)
    # a length past the limit whose body never comes: daphne waits for the body (it buffers a
    # request whole before the app sees it: docs/testing.md); the client's connection is held,
    # the server answers everyone else meanwhile
    with socket.create_connection(("127.0.0.1", urlsplit(stack.api_url).port), timeout=TIMEOUT) as held:
        held.sendall(request("POST", b"/v2/sandboxes", {b"Host": b"127.0.0.1", b"Content-Length": b"9" * 20}))
        answered(api.get("/v2/sandboxes"), {200})


@pytest.mark.parametrize("ctype", ids=short, argvalues=[b"text/plain", b"application/x-www-form-urlencoded", b"multipart/form-data",
                                   b"application/json; charset=\xff", b"application/json\x00"])
def test_content_types(stack, ctype):
    raw_answered(stack.api_url, request("POST", b"/v2/sandboxes", {
        b"Host": b"127.0.0.1", b"X-API-Key": stack.api_key.encode(), b"Content-Type": ctype},
        b'{"templateID": "no-such"}'), {400, 404, 415})


# ---------------------------------------------------------------- paths and query strings


@pytest.mark.parametrize("path", ids=short, argvalues=[
    b"/sandboxes/%00", b"/sandboxes/%ff%fe", b"/sandboxes/..%2f..%2fetc%2fpasswd", b"/sandboxes/" + b"a" * 8000,
    b"/sandboxes/%2e%2e", b"/sandboxes/x%0d%0aSet-Cookie:%20a=b", b"/templates/%00", b"/templates/%ff",
    b"/templates/..%2f..%2f", b"/snapshots/%00", b"/volumes/%00", b"/volumes/..%2f", b"/events/webhooks/%00",
    b"/events/sandboxes/%ff", b"/secrets/%00", b"/templates/aliases/%00", b"/sandboxes/%00/logs",
    b"/v2/sandboxes?limit=99999999999999999999999", b"/v2/sandboxes?state=%ff", b"/v2/sandboxes?metadata=%00%ff",
    b"/v2/sandboxes?metadata=" + b"a%3D" * 3000, b"/v2/sandboxes?nextToken=%00", b"/snapshots?limit=-1",
    b"/templates/base/files/%2e%2e%2f%2e%2e", b"/templates/base/files/" + b"0" * 63 + b"%00",
    b"/sandboxes/x/metrics?start=-99999999999999999999", b"/sandboxes/x/logs?limit=%ff",
    b"/%ff", b"/\x00", b"/" + b"%2f" * 3000,
])
def test_hostile_paths(stack, path):
    for method in ("GET", "DELETE", "POST"):
        raw_answered(stack.api_url, request(method, path, {
            b"Host": b"127.0.0.1", b"X-API-Key": stack.api_key.encode(), b"Content-Type": b"application/json"},
            b"{}"), {200, 400, 401, 404, 405, 409, 414}, closed_ok=path in (b"/\x00",))


def test_request_line_past_the_servers_limit(stack, api):
    """A request line longer than daphne's (Twisted's 16 KiB line limit): the connection is
    closed without an answer (no 5xx, no hang), and the server serves the next request."""
    status, _ = raw(stack.api_url, request("GET", b"/volumecontent/x/file?path=" + b"x" * 30_000,
                                           {b"Host": b"127.0.0.1"}))
    assert status is None or 400 <= status < 500
    answered(api.get("/v2/sandboxes"), {200})


# ---------------------------------------------------------------- headers


@pytest.mark.parametrize("headers", ids=short, argvalues=[
    {b"X-API-Key": b"e2b_\xff\xfe"}, {b"X-API-Key": b"e2b_\x00"}, {b"X-API-Key": b"x" * 60_000},
    {b"Authorization": b"Bearer \xff\x00"}, {b"Authorization": b"Bearer " + b"a" * 60_000},
    {b"X-API-Key": b"", b"Authorization": b"Basic Zm9vOmJhcg=="},
    {b"Host": b"evil.example"}, {b"Host": b"127.0.0.1\x00.evil"}, {b"Host": b"\xff\xfe"},
    {b"Host": b"a" * 10_000}, {b"Host": b""}, {b"Host": b"127.0.0.1:99999999"},
    {b"X-Forwarded-Host": b"evil.example", b"X-Forwarded-Proto": b"\xff"},
    {b"Cookie": b"sessionid=\xff\x00; csrftoken=" + b"a" * 5000},
])
def test_hostile_headers(stack, headers):
    base = {b"Host": b"127.0.0.1", b"X-API-Key": stack.api_key.encode()}
    for method, path in (("GET", b"/v2/sandboxes"), ("GET", b"/sandboxes/nope")):
        raw_answered(stack.api_url, request(method, path, {**base, **headers}), {200, 400, 401, 404, 431},
                     closed_ok=True)  # a header the HTTP parser refuses may close the connection


# ---------------------------------------------------------------- the data plane


@pytest.mark.parametrize("headers", ids=short, argvalues=[
    {b"Host": b"49983-../../etc.localhost"}, {b"Host": b"49983-x\x00y.localhost"}, {b"Host": b"49983-\xff.localhost"},
    {b"Host": b"99999999999999-abc.localhost"}, {b"Host": b"-1-abc.localhost"}, {b"Host": b"0-abc.localhost"},
    {b"Host": b"49983-" + b"a" * 10_000 + b".localhost"}, {b"Host": b""}, {b"Host": b"[::1]:49983"},
    {b"Host": b"49983-abc.localhost", b"X-Forwarded-Host": b"49983-other.localhost"},
    {b"E2b-Sandbox-Id": b"../../etc", b"E2b-Sandbox-Port": b"49983"},
    {b"E2b-Sandbox-Id": b"a\x00b", b"E2b-Sandbox-Port": b"49983"},
    {b"E2b-Sandbox-Id": b"\xff", b"E2b-Sandbox-Port": b"49983"},
    {b"E2b-Sandbox-Id": b"abc", b"E2b-Sandbox-Port": b"-1"},
    {b"E2b-Sandbox-Id": b"abc", b"E2b-Sandbox-Port": b"65536"},
    {b"E2b-Sandbox-Id": b"abc", b"E2b-Sandbox-Port": b"99999999999999999999999"},
    {b"E2b-Sandbox-Id": b"abc", b"E2b-Sandbox-Port": b"1e3"},
    {b"E2b-Sandbox-Id": b"abc", b"E2b-Sandbox-Port": b"\xff"},
    {b"E2b-Sandbox-Id": b"a" * 10_000, b"E2b-Sandbox-Port": b"49983"},
])
def test_dataplane_hostile_host(stack, headers):
    """The data plane's 502 "not found" is E2B's documented answer for a sandbox it cannot find."""
    for path in (b"/health", b"/files?path=%2e%2e%2f%2e%2e%2fetc%2fpasswd", b"/%00", b"/files?path=%ff"):
        raw_answered(stack.sandbox_url, request("GET", path, {b"Host": b"127.0.0.1", **headers}),
                     {400, 401, 403, 404, 421, 431, 502}, closed_ok=True)


def test_dataplane_signed_file_urls(stack, api):
    """Signed ``/files`` URLs that name no sandbox (the data plane finds the signer by hashing,
    dataplane/signers.py): forged, malformed, expired and a flood of random ones are 4xx (429
    past the hash budget), never a 5xx or a hang."""
    sbx = answered(api.post("/v2/sandboxes", json={"templateID": "base", "secure": True}), {201}).json()
    try:
        queries = [f"path=/etc/passwd&signature=v1_{'0' * 64}&signature_expiration=99999999999",
                   "path=x&signature=%00", "path=x&signature=%ff%fe", f"path=x&signature={'a' * 10_000}",
                   "path=x&signature=v1_x&signature_expiration=-1", "path=x&signature=v1_x&signature_expiration=1e9",
                   "path=x&signature=v1_x&signature_expiration=" + "9" * 400, "path=%00&signature=v1_x",
                   "path=../../etc/shadow&username=root&signature=v1_" + "f" * 64, "signature=", "path=&signature=&"]
        with httpx.Client(base_url=stack.sandbox_url, timeout=TIMEOUT) as dp:
            for q in queries:
                for method in ("GET", "POST"):
                    answered(dp.request(method, f"/files?{q}", content=b"x" if method == "POST" else None),
                             {400, 401, 403, 404, 429, 502})

            async def flood() -> list[httpx.Response]:
                """50 made-up signatures at once: each may wait for the signers' next token read."""
                async with httpx.AsyncClient(base_url=stack.sandbox_url, timeout=TIMEOUT) as client:
                    return await asyncio.gather(*(client.get(f"/files?path=/x{i}&signature=v1_{uuid.uuid4().hex * 2}")
                                                  for i in range(50)))
            for resp in asyncio.run(flood()):
                answered(resp, {401, 403, 429, 502})
    finally:
        answered(api.delete(f"/sandboxes/{sbx['sandboxID']}"), {204})


# ---------------------------------------------------------------- URLs: webhooks, egress proxies


@pytest.mark.parametrize("url", ids=short, argvalues=[
    "file:///etc/passwd", "gopher://127.0.0.1:6379/_FLUSHALL", "http://127.0.0.1:6379/", "http://[::1]/",
    "http://0x7f000001/", "http://2130706433/", "http://169.254.169.254/latest/meta-data/", "http://localhost/",
    "http://user:pw@127.0.0.1/", "http://exa\x00mple.com/", "http://example.com\r\nX: y/", "javascript:alert(1)",
    "", "http://", "http://" + "a" * 100_000 + ".com/", "http://[::ffff:127.0.0.1]/", "http://0/",
    "http://10.0.0.1/", "https://example.com:99999/", "ftp://example.com/", "http://\ud800.com/",
])
def test_webhook_urls(api, url):
    resp = answered(post_json(api, "/events/webhooks", {"name": "w", "url": url,
                                                         "events": ["sandbox.lifecycle.created"]}), {400, 413})
    assert resp.status_code in (400, 413)


@pytest.mark.parametrize("proxy", ids=short, argvalues=[
    {"address": "127.0.0.1:6379"}, {"address": "file:///etc/passwd"}, {"address": "http://169.254.169.254:80"},
    {"address": "socks5://[::1]:1080"}, {"address": "\x00"}, {"address": "x" * 10_000},
    {"address": "proxy.example:3128", "username": "a\r\nb", "password": "x"},
    {"address": "proxy.example:3128", "password": "\x00"}, {"address": 5}, "http://127.0.0.1:3128", [],
])
def test_egress_proxy_addresses(api, proxy):
    answered(post_json(api, "/v2/sandboxes", {"templateID": "base", "network": {"egressProxy": proxy}}), {400})


# ---------------------------------------------------------------- image references and build steps


def new_build(api) -> tuple[str, str]:
    """A template waiting for its build start (POST /v3/templates)."""
    resp = answered(api.post("/v3/templates", json={"name": f"fuzz-{uuid.uuid4().hex[:6]}", "cpuCount": 1,
                                                    "memoryMB": 512}), {202})
    return resp.json()["templateID"], resp.json()["buildID"]


def start_answered(api, body: dict, final: tuple[str, ...] = ("error",)) -> None:
    """A hostile start body: refused (400, 413), or taken (202, the documented answer: a build
    is checked where it runs) and then the build reaches a final state in ``final`` within
    the timeout, with its reason in the log."""
    template_id, build_id = new_build(api)
    resp = answered(post_json(api, f"/v2/templates/{template_id}/builds/{build_id}", body), {202, 400, 413})
    if resp.status_code != 202:
        return
    deadline = time.monotonic() + 60
    while True:
        status = answered(api.get(f"/templates/{template_id}/builds/{build_id}/status"), {200}).json()
        if status["status"] not in ("waiting", "building") or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert status["status"] in final, (short(body), status["status"], status["logEntries"][-3:])


@pytest.mark.parametrize("image", ids=short, argvalues=[
    "../../etc/passwd", "docker://127.0.0.1:1/x", "127.0.0.1:1/x@sha256:zz", "127.0.0.1:1/UPPER", "a" * 5000,
    "127.0.0.1:99999/x", "127.0.0.1:1/x\x00y", "file:///etc/passwd", "-oProxyCommand=touch /tmp/" + MARK,
    "--src-creds=a:b", "127.0.0.1:1/x:tag;touch /tmp/" + MARK, "127.0.0.1:1/x:\ud800", " ",
    "oci:/etc/passwd", "dir:/etc", "docker-archive:/etc/shadow", "127.0.0.1:1/x$(touch /tmp/" + MARK + ")",
])
def test_image_references(api, image):
    start_answered(api, {"fromImage": image, "steps": []})


@pytest.mark.parametrize("registry", ids=short, argvalues=[
    {"type": "file"}, {"type": "registry"}, {"type": "registry", "username": 5, "password": "x"},
    {"type": "registry", "username": "a\x00", "password": "x"}, {"type": "registry", "username": "a", "password": "x" * 100_000},
    {"type": "registry", "username": "a:b@127.0.0.1", "password": "x\r\nHost: evil"}, {"type": "aws"}, {"type": "gcp"},
    {"type": "gcp", "serviceAccountJson": 5}, "registry", [],
])
def test_image_registry_credentials(api, registry):
    """Private-registry credentials with hostile fields, for an image on a port of 127.0.0.1
    where nothing listens (aws / gcp only incomplete: a complete one would make the node call
    the cloud)."""
    start_answered(api, {"fromImage": "127.0.0.1:1/x:1", "fromImageRegistry": registry, "steps": []})


HASH = "0" * 64


@pytest.mark.parametrize("steps", ids=short, argvalues=[
    [{"type": "COPY", "args": ["../../etc/passwd", "/x"], "filesHash": HASH}],
    [{"type": "COPY", "args": ["a", "b"], "filesHash": "../../x"}],
    [{"type": "COPY", "args": ["a", "b"], "filesHash": "z" * 64}],
    [{"type": "RUN", "args": ["a\x00b"]}], [{"type": "RUN", "args": ["\ud800"]}],
    [{"type": "RUN", "args": ["x" * 2_000_000]}], [{"type": "FROM", "args": ["/etc"]}], [{"type": "\x00"}],
    [{"type": "ENV", "args": ["A\x00", "b"]}], [{"type": "WORKDIR", "args": ["\x00"]}],
    [{"type": "USER", "args": ["root\x00"]}], [{"type": "RUN", "args": "not a list"}],
    [{"type": "RUN", "args": ["true"]}] * 20_000, "steps", [None], [[]],
])
def test_build_steps(api, steps):
    start_answered(api, {"fromTemplate": "base", "steps": steps}, final=("error", "ready"))


@pytest.mark.parametrize("cmd", ids=short, argvalues=["\x00", "a\x00b", "\ud800", "x" * 2_000_000, 5])
@pytest.mark.parametrize("field", ["startCmd", "readyCmd"])
def test_build_start_and_ready_commands(api, cmd, field):
    start_answered(api, {"fromTemplate": "base", "steps": [], field: cmd}, final=("error", "ready"))


# ---------------------------------------------------------------- COPY archives


def tar_of(*members: tuple[tarfile.TarInfo, bytes | None], gz: bool = False) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if gz else "w", format=tarfile.GNU_FORMAT) as t:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            t.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def member(name: str, kind=tarfile.REGTYPE, linkname: str = "", mode: int = 0o644) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, linkname, mode
    return info


UNPACKED_LIMIT = 64 << 20  # the stack's AENV_TEMPLATE_FILE_MAX_UNPACKED_BYTES (8 GiB by default)


def zip_bomb() -> bytes:
    """A gzipped tar whose one member holds 4x the unpacked limit in zeros: ~250 KiB on the wire."""
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", compresslevel=9) as gz:
        info = member("zeros")
        info.size = 4 * UNPACKED_LIMIT
        gz.write(info.tobuf(format=tarfile.GNU_FORMAT))
        block = b"\0" * (1 << 20)
        for _ in range(info.size >> 20):
            gz.write(block)
    return buf.getvalue()


def many_members() -> bytes:
    """Members of size 0 declared, each a header: the sizes that add up are what counts."""
    return tar_of(*[(member(f"f{i}"), b"x" * 1024) for i in range(20)],
                  (member("big"), b"\0" * (UNPACKED_LIMIT + 1)), gz=True)


BAD_ARCHIVES = {
    "traversal": lambda: tar_of((member(f"../{MARK}"), b"x")),
    "deep traversal": lambda: tar_of((member(f"a/../../../{MARK}"), b"x")),
    "absolute": lambda: tar_of((member(f"/tmp/{MARK}"), b"x")),
    "hard link out": lambda: tar_of((member("pw", tarfile.LNKTYPE, "../../../../etc/passwd"), None)),
    "absolute hard link": lambda: tar_of((member("pw", tarfile.LNKTYPE, "/etc/passwd"), None)),
    "char device": lambda: tar_of((member("null", tarfile.CHRTYPE), None)),
    "block device": lambda: tar_of((member("sda", tarfile.BLKTYPE), None)),
    "fifo": lambda: tar_of((member("fifo", tarfile.FIFOTYPE), None)),
    "not a tar": lambda: b"hello" * 1000,
    "empty": lambda: b"",
    "truncated gzip": lambda: tar_of((member("a"), b"x" * 10000), gz=True)[:50],
    "zip bomb": zip_bomb,
    "over the unpacked limit": many_members,
}
# Accepted by design: the archive is unpacked inside the build's guest, where a link can only
# reach the guest's own files (docs/templates.md); the host never unpacks it.
GUEST_SIDE = {
    "symlink out": lambda: tar_of((member("etc", tarfile.SYMTYPE, "/etc"), None)),
    "symlink then through it": lambda: tar_of((member("up", tarfile.SYMTYPE, "../../.."), None),
                                              (member(f"up/{MARK}"), b"x")),
}


@pytest.fixture(scope="module")
def upload_url(api):
    template_id, _ = new_build(api)

    def url(files_hash: str) -> str:
        resp = answered(api.get(f"/templates/{template_id}/files/{files_hash}"), {201})
        return resp.json()["url"]
    return url


@pytest.mark.parametrize("name", list(BAD_ARCHIVES))
def test_copy_archives_refused(upload_url, stack, name):
    files_hash = hashlib.sha256(name.encode()).hexdigest()
    data = BAD_ARCHIVES[name]()
    resp = answered(httpx.put(upload_url(files_hash), content=data, timeout=120), {400, 411, 413})
    store = stack.home / "template-files"
    assert not list(store.rglob(f"{files_hash}*")), f"{name}: kept"


@pytest.mark.parametrize("name", list(GUEST_SIDE))
def test_copy_archives_guest_side(upload_url, stack, name):
    files_hash = hashlib.sha256(name.encode()).hexdigest()
    answered(httpx.put(upload_url(files_hash), content=GUEST_SIDE[name](), timeout=60), {200})


def test_upload_url_tampering(upload_url, stack):
    files_hash = "1" * 64
    url = upload_url(files_hash)
    good = tar_of((member("a"), b"x"))
    for bad in (url.replace(files_hash, "2" * 64), url + "x", url.split("?")[0],
                url.split("?")[0] + "?token=%00%ff", url.replace(files_hash, "..%2f..%2f" + MARK),
                url.replace(files_hash, "%00")):
        answered(httpx.put(bad, content=good, timeout=TIMEOUT), {400, 403, 404})


# ---------------------------------------------------------------- volume content paths


@pytest.fixture(scope="module")
def volume(api, stack):
    resp = answered(api.post("/volumes", json={"name": f"fuzz{uuid.uuid4().hex[:6]}"}), {201})
    body = resp.json()
    roots = list((stack.home / "volumes").glob(f"*/{body['volumeID']}"))
    assert len(roots) == 1, roots
    return body["volumeID"], body["token"], roots[0]


def test_volume_paths(stack, volume):
    volume_id, token, root = volume
    with httpx.Client(base_url=f"{stack.api_url}/volumecontent/{volume_id}", timeout=TIMEOUT,
                      headers={"Authorization": f"Bearer {token}"}) as c:
        for path in [*TRAVERSALS, *(b for b in BAD_STRINGS if b != "\ud800"), "", "/", ".", "..", "~", "//", "\\"]:
            p = {"path": path}
            answered(c.put("/file", params=p, content=b"x"))
            answered(c.post("/dir", params=p))
            answered(c.get("/file", params=p))
            answered(c.get("/dir", params=p))
            answered(c.get("/path", params=p))
            answered(c.patch("/path", params=p, json={"mode": 0o777}))
            answered(c.delete("/path", params=p))
        for q in (b"path=%00", b"path=%ff%fe", b"path=%ed%a0%80", b"path=a&path=../b", b"path=" + b"%2e%2e%2f" * 500 + MARK.encode(),
                  b"path=x&depth=-1", b"path=x&depth=99999999999999999999", b"path=x&uid=-1&gid=%ff"):
            for method, route in (("GET", "file"), ("PUT", "file"), ("GET", "dir"), ("DELETE", "path")):
                answered(c.request(method, f"/{route}?{q.decode()}", content=b"x" if method == "PUT" else None))


def test_volume_symlinks_stay_inside(stack, volume, tmp_path):
    """Links a guest made in its volume (here made on the host, as the guest's NFS writes
    would) never lead the content API outside: no read, write, chmod or delete of the target."""
    volume_id, token, root = volume
    outside = tmp_path / "outside.txt"
    outside.write_text("host secret")
    outside.chmod(0o600)
    (tmp_path / "outdir").mkdir()
    os.symlink(outside, root / "file-link")
    os.symlink(tmp_path / "outdir", root / "dir-link")
    os.symlink("../../../../../../../../../../" + str(tmp_path).lstrip("/"), root / "rel-link")
    with httpx.Client(base_url=f"{stack.api_url}/volumecontent/{volume_id}", timeout=TIMEOUT,
                      headers={"Authorization": f"Bearer {token}"}) as c:
        for path in ("file-link", "dir-link/x", "rel-link/outside.txt", "/file-link", "dir-link/../file-link"):
            resp = answered(c.get("/file", params={"path": path}))
            assert b"host secret" not in resp.content, path
        for path in ("dir-link/" + MARK, "rel-link/outdir/" + MARK, "file-link"):
            answered(c.put("/file", params={"path": path}, content=b"overwritten"))
            answered(c.post("/dir", params={"path": path + "-d"}))
        for path in ("file-link", "rel-link/outside.txt", "dir-link"):
            answered(c.patch("/path", params={"path": path}, json={"mode": 0o777}))
            answered(c.get("/dir", params={"path": path}))
        for path in ("rel-link/outside.txt", "dir-link/../file-link"):
            answered(c.delete("/path", params={"path": path}))
    assert outside.read_text() == "host secret"
    assert outside.stat().st_mode & 0o777 == 0o600
    assert list((tmp_path / "outdir").iterdir()) == []


# ---------------------------------------------------------------- nothing written outside


def test_nothing_written_outside(stack, volume):
    """Last in the module: the marker exists nowhere near the stack, the repository or /tmp,
    and the stack's home only grew where its routes keep files."""
    places = [stack.home, stack.home.parent, Path("/tmp"), Path("/"), Path.cwd()]
    found = subprocess.run(["find", *map(str, places), "-maxdepth", "3", "-name", f"*{MARK}*"],
                           capture_output=True, text=True, timeout=120).stdout.split()
    assert found == [], found
    grown = files_under(stack.home) - stack.before
    # where the routes the cases called keep files: volumes, COPY archives, the fake node's
    # sandboxes and snapshots, the database and the logs
    allowed = {"volumes", "template-files", "sandboxes", "snapshots", "templates", "builds"}
    stray = sorted(p for p in grown if p.split("/")[0] not in allowed
                   and not p.startswith("db.sqlite3") and not p.endswith(".log"))
    assert stray == [], stray
    # under volumes/: only the fuzzed volume's own tree (and the directories leading to it)
    root = str(volume[2].relative_to(stack.home))
    outside = sorted(p for p in grown if p.startswith("volumes/") and not (
        p == root or p.startswith((root + "/", root + ".")) or root.startswith(p + "/")))  # .img: its backing file
    assert outside == [], outside
    staging = stack.home / "template-files" / ".staging"
    assert not staging.exists() or list(staging.iterdir()) == []
