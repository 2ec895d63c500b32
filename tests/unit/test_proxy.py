"""Data plane against a real local upstream: both uvicorn servers run in the test's
event loop; the sandbox rows live in the test database."""
import asyncio
import gzip
import json
import socket
from datetime import timedelta

import httpx
import pytest
import uvicorn
from asgiref.sync import sync_to_async
from django.db import connections
from django.db.models import F
from django.utils import timezone

from sandboxes.models import Sandbox, Team, Template
from dataplane import pools
from dataplane.proxy import EnvdProxy, Route

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
async def _close_async_orm_connections():
    """The async ORM runs on asgiref's shared thread; close its connection after each
    test, as Django's request cycle would, so PostgreSQL can drop the test database."""
    yield
    await sync_to_async(connections.close_all)()

GZ = gzip.compress(b"hello compressed world" * 10)


class Upstream:
    """A stand-in for envd whose routes expose what the proxy did."""

    def __init__(self):
        self.first_chunk = asyncio.Event()
        self.release = asyncio.Event()
        self.disconnected = asyncio.Event()
        self.seen_headers = None
        self.clients = []  # (host, port) of each request's connection

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        self.clients.append(tuple(scope["client"]))
        path = scope["path"]
        headers = [(n.decode(), v.decode()) for n, v in scope["headers"]]
        self.seen_headers = headers
        if path == "/health":
            return await self.reply(send, 204, b"")
        if path == "/upload":
            chunks = []
            while True:
                msg = await receive()
                if msg.get("body"):
                    chunks.append(msg["body"].decode())
                    self.first_chunk.set()
                if not msg.get("more_body"):
                    break
            return await self.reply(send, 200, json.dumps({"chunks": chunks}).encode())
        if path == "/stream":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/connect+json")]})
            await send({"type": "http.response.body", "body": b"one", "more_body": True})
            try:
                await asyncio.wait_for(self.release.wait(), 5)
            except asyncio.TimeoutError:
                pass
            await send({"type": "http.response.body", "body": b"two", "more_body": False})
            return
        if path == "/hang":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"tick", "more_body": True})
            while (await receive())["type"] != "http.disconnect":
                pass
            self.disconnected.set()
            return
        if path in ("/connect-stream", "/connect-partial"):  # a Connect stream that then goes silent
            from envd.wire import encode_json, envelope
            message = envelope(encode_json({"event": {"start": {"pid": 7}}}))
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/connect+json")]})
            body = message if path == "/connect-stream" else message[:3]
            await send({"type": "http.response.body", "body": body, "more_body": True})
            while (await receive())["type"] != "http.disconnect":
                pass
            self.disconnected.set()
            return
        if path == "/gzip":
            return await self.reply(send, 200, GZ, [(b"content-encoding", b"gzip"),
                                                   (b"content-type", b"application/x-weird; v=1")])
        if path == "/hop":
            return await self.reply(send, 200, b"ok", [(b"connection", b"x-listed"), (b"x-listed", b"1"),
                                                     (b"keep-alive", b"timeout=5"), (b"x-keep", b"yes")])
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        out = {"method": scope["method"], "path": path, "query": scope["query_string"].decode(),
               "headers": headers, "body": body.decode(), "connection": list(scope["client"])}
        return await self.reply(send, 200, json.dumps(out).encode())

    @staticmethod
    async def reply(send, status, body, headers=()):
        hdrs = [(b"content-type", b"application/json"), *headers] if body and not headers else list(headers)
        await send({"type": "http.response.start", "status": status, "headers": hdrs})
        await send({"type": "http.response.body", "body": body})


async def serve(app):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning", timeout_graceful_shutdown=2))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    return server, task, sock.getsockname()[1]


@pytest.fixture
async def stack():
    upstream = Upstream()
    proxy = EnvdProxy()
    up_server, up_task, up_port = await serve(upstream)
    px_server, px_task, px_port = await serve(proxy)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{px_port}", timeout=10) as client:
        yield type("Stack", (), dict(upstream=upstream, proxy=proxy, up_port=up_port, px_port=px_port,
                                     client=client, up_server=up_server))
    for server in (px_server, up_server):
        server.should_exit = True
    await asyncio.gather(px_task, up_task)
    await proxy.aclose()


def _make_sandbox(port, state="running", secure=False, token=""):
    team, _ = Team.objects.get_or_create(slug="t", defaults={"name": "t"})
    tpl, _ = Template.objects.get_or_create(id="base")
    return Sandbox.objects.create(team=team, template=tpl, state=state, envd_host="127.0.0.1", envd_port=port,
                                  secure=secure, envd_access_token=token,
                                  end_at=timezone.now() + timedelta(minutes=5))


make_sandbox = sync_to_async(_make_sandbox)


def hdr(sbx, port=49983, **extra):
    return {"E2b-Sandbox-Id": sbx.id, "E2b-Sandbox-Port": str(port), **extra}


async def test_header_routing_keeps_path_query_and_strips_routing_headers(stack):
    sbx = await make_sandbox(stack.up_port)
    r = await stack.client.post("/process.Process/List?a=1&b=%2F", content=b"{}",
                                headers=hdr(sbx, **{"content-type": "application/json", "x-access-token": "t",
                                                    "authorization": "Basic dXNlcjo="}))
    assert r.status_code == 200
    seen = r.json()
    assert (seen["method"], seen["path"], seen["query"], seen["body"]) == ("POST", "/process.Process/List",
                                                                           "a=1&b=%2F", "{}")
    seen_headers = {tuple(h) for h in seen["headers"]}
    names = {n for n, _ in seen_headers}
    assert "e2b-sandbox-id" not in names and "e2b-sandbox-port" not in names
    assert {("x-access-token", "t"), ("authorization", "Basic dXNlcjo="), ("content-length", "2")} <= seen_headers


async def test_host_routing(stack):
    sbx = await make_sandbox(stack.up_port)
    r = await stack.client.get("/health", headers={"host": f"49983-{sbx.id}.localhost:{stack.px_port}"})
    assert r.status_code == 204
    r = await stack.client.get("/x", headers={"host": f"8080-{sbx.id}.localhost"})
    assert r.status_code == 502 and "port is not open" in r.json()["message"]


async def test_no_routing_information_is_400(stack):
    r = await stack.client.get("/health")
    assert r.status_code == 400 and r.json()["code"] == 400


@pytest.mark.parametrize("state", [None, "killing", "killed", "error", "paused", "creating"])
async def test_unknown_or_not_running_is_502_not_found(stack, state):
    sbx_id = "inope"
    if state:
        sbx_id = (await make_sandbox(stack.up_port, state=state)).id
    r = await stack.client.get("/health", headers={"E2b-Sandbox-Id": sbx_id, "E2b-Sandbox-Port": "49983"})
    assert r.status_code == 502
    assert r.json() == {"sandboxId": sbx_id, "message": "The sandbox was not found", "code": 502}


async def test_other_port_is_502_port_not_open(stack):
    sbx = await make_sandbox(stack.up_port)
    r = await stack.client.get("/", headers=hdr(sbx, port=8000))
    assert r.status_code == 502 and r.json()["message"] == "The sandbox is running but port is not open"


async def test_killed_right_after_a_request_is_502_not_found(stack):
    sbx = await make_sandbox(stack.up_port)
    assert (await stack.client.get("/health", headers=hdr(sbx))).status_code == 204
    await sync_to_async(Sandbox.objects.filter(pk=sbx.pk).update)(state="killed")
    # even with its old address still answering, a killed sandbox is not served
    r = await stack.client.get("/health", headers=hdr(sbx))
    assert r.status_code == 502 and "was not found" in r.json()["message"]
    assert len(stack.proxy.pools) == 0  # its pool is closed


async def test_connections_are_pooled_per_vm_generation(stack):
    sbx = await make_sandbox(stack.up_port)
    for _ in range(3):
        assert (await stack.client.get("/health", headers=hdr(sbx))).status_code == 204
    assert len(set(stack.upstream.clients)) == 1  # one kept-alive connection served all three
    # a new VM process at the very same address (e.g. resumed onto the same port)
    await sync_to_async(Sandbox.objects.filter(pk=sbx.pk).update)(vm_generation=F("vm_generation") + 1)
    assert (await stack.client.get("/health", headers=hdr(sbx))).status_code == 204
    assert len(set(stack.upstream.clients)) == 2  # never the connection of the old generation


async def test_each_client_connection_keeps_its_own_upstream_connection(stack):
    """Many clients at once: every answer right, and each client connection's requests reuse
    one upstream connection of its own (dataplane.pools' lanes) — no churn, no sharing."""
    sbx = await make_sandbox(stack.up_port)

    async def one_client(n):
        used = set()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{stack.px_port}", timeout=10) as c:
            for i in range(4):
                r = await c.post("/echo", content=f"{n}-{i}".encode(), headers=hdr(sbx))
                assert r.status_code == 200 and r.json()["body"] == f"{n}-{i}"
                used.add(tuple(r.json()["connection"]))
        return used

    used = await asyncio.gather(*(one_client(n) for n in range(20)))
    assert all(len(u) == 1 for u in used)  # a client connection's requests: one upstream connection
    assert len(set().union(*used)) == 20  # of its own


async def test_route_that_moved_between_lookup_and_connect_is_retried(stack):
    """A refused connection sent nothing: if the route changed meanwhile (a resume onto
    a new port), the request is sent once more to the new route."""
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    closed_port = free.getsockname()[1]
    free.close()
    sbx = await make_sandbox(stack.up_port)
    real_get = stack.proxy.routes.get
    stale = [Route(sbx.id, "running", "127.0.0.1", closed_port, False, "", generation=0)]

    async def get(sandbox_id):
        return stale.pop() if stale else await real_get(sandbox_id)

    stack.proxy.routes.get = get
    await sync_to_async(Sandbox.objects.filter(pk=sbx.pk).update)(vm_generation=1)
    r = await stack.client.post("/echo", content=b"payload", headers=hdr(sbx))
    assert r.status_code == 200 and r.json()["body"] == "payload"


async def test_running_but_envd_refusing_is_port_not_open(stack):
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    closed_port = free.getsockname()[1]
    free.close()
    sbx = await make_sandbox(closed_port)
    r = await stack.client.get("/health", headers=hdr(sbx))
    assert r.status_code == 502 and "port is not open" in r.json()["message"]


async def test_request_body_is_forwarded_before_it_completes(stack):
    sbx = await make_sandbox(stack.up_port)

    async def body():
        yield b"first"
        # A buffering proxy would hold "first" until the body ends: this would time out.
        await asyncio.wait_for(stack.upstream.first_chunk.wait(), 3)
        yield b"second"

    r = await stack.client.post("/upload", content=body(), headers=hdr(sbx))
    assert r.status_code == 200
    assert r.json()["chunks"] == ["first", "second"]
    assert ("transfer-encoding", "chunked") in stack.upstream.seen_headers


async def test_response_streams_incrementally(stack):
    sbx = await make_sandbox(stack.up_port)
    async with stack.client.stream("POST", "/stream", headers=hdr(sbx)) as r:
        assert r.headers["content-type"] == "application/connect+json"
        chunks = r.aiter_raw()
        assert await asyncio.wait_for(anext(chunks), 3) == b"one"  # before the upstream finished
        stack.upstream.release.set()
        rest = b"".join([c async for c in chunks])
    assert rest == b"two"


async def test_encoded_bodies_pass_verbatim(stack):
    sbx = await make_sandbox(stack.up_port)
    async with stack.client.stream("GET", "/gzip", headers=hdr(sbx, **{"accept-encoding": "identity"})) as r:
        raw = b"".join([c async for c in r.aiter_raw()])
    assert raw == GZ
    assert r.headers["content-encoding"] == "gzip" and r.headers["content-type"] == "application/x-weird; v=1"
    assert ("accept-encoding", "identity") in stack.upstream.seen_headers


async def test_hop_by_hop_headers_are_stripped(stack):
    sbx = await make_sandbox(stack.up_port)
    r = await stack.client.get("/anything", headers=hdr(sbx, **{
        "connection": "keep-alive, x-conn-listed", "x-conn-listed": "1", "te": "trailers",
        "proxy-authorization": "Basic eA==", "keep-alive": "timeout=5", "x-normal": "kept"}))
    names = {n for n, _ in r.json()["headers"]}
    assert "x-normal" in names
    assert not names & {"x-conn-listed", "te", "proxy-authorization", "keep-alive", "e2b-sandbox-id"}
    assert ["host", f"127.0.0.1:{stack.up_port}"] in r.json()["headers"]
    r = await stack.client.get("/hop", headers=hdr(sbx))
    assert r.headers["x-keep"] == "yes"
    assert "x-listed" not in r.headers and "keep-alive" not in r.headers


async def test_client_disconnect_closes_upstream(stack):
    sbx = await make_sandbox(stack.up_port)
    async with stack.client.stream("GET", "/hang", headers=hdr(sbx)) as r:
        assert await asyncio.wait_for(anext(r.aiter_raw()), 3) == b"tick"
    await asyncio.wait_for(stack.upstream.disconnected.wait(), 3)
    await asyncio.sleep(0.1)
    leftovers = [t for t in asyncio.all_tasks()
                 if t.get_coro().__name__ in ("_pump_request", "_exchange", "_forward", "wait")]
    assert not leftovers


@pytest.mark.parametrize("path", ["/connect-stream", "/connect-partial", "/hang"])
@pytest.mark.parametrize("move", ["killed", "new VM"])
async def test_a_response_whose_sandbox_moves_on_is_broken_off_at_once(stack, path, move):
    """The VM of a killed sandbox says nothing on the wire; its streams must not hang until
    the client's timeout: the data plane sees the sandbox gone (or behind a new VM: resumed
    elsewhere) and resets the client's connection (RST, not FIN: a reset, like the
    RST_STREAM of E2B's proxy over HTTP/2, is what every SDK generation takes for a dropped
    connection; a FIN mid-body is a protocol error to pyqwest that some never probe for),
    and /health then says the sandbox was not found (what the SDKs probe)."""
    stack.proxy.watch.interval = 0.1
    sbx = await make_sandbox(stack.up_port)
    method = "POST" if path.startswith("/connect") else "GET"
    async with stack.client.stream(method, path, headers=hdr(sbx)) as r:
        chunks = r.aiter_raw()
        await asyncio.wait_for(anext(chunks), 3)
        change = {"state": "killing"} if move == "killed" else {"vm_generation": F("vm_generation") + 1}
        await sync_to_async(Sandbox.objects.filter(pk=sbx.pk).update)(**change)
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(httpx.ReadError):  # ECONNRESET (a FIN would be RemoteProtocolError)
            await asyncio.wait_for(anext(chunks), 3)
        assert asyncio.get_running_loop().time() - t0 < 2
    await asyncio.wait_for(stack.upstream.disconnected.wait(), 3)  # the upstream request was closed too
    health = await stack.client.get("/health", headers=hdr(sbx))
    if move == "killed":
        assert health.status_code == 502 and "was not found" in health.json()["message"]
    for _ in range(100):  # a relay leaves the watch once its response is done
        if not len(stack.proxy.watch):
            break
        await asyncio.sleep(0.01)
    assert len(stack.proxy.watch) == 0


async def test_access_token_enforced_for_secure_sandboxes(stack):
    sbx = await make_sandbox(stack.up_port, secure=True, token="s3cret")
    rpc = "/process.Process/List"
    for headers in ({}, {"x-access-token": "wrong"}):
        r = await stack.client.post(rpc, content=b"{}", headers=hdr(sbx, **headers))
        assert r.status_code == 401 and r.json()["code"] == 401 and r.json()["message"]
    r = await stack.client.post(rpc, content=b"{}", headers=hdr(sbx, **{"x-access-token": "s3cret"}))
    assert r.status_code == 200 and ["x-access-token", "s3cret"] in r.json()["headers"]
    assert (await stack.client.get("/health", headers=hdr(sbx))).status_code == 204
    signed = _signed_url("a.txt", "read", "s3cret")
    r = await stack.client.get(signed, headers=hdr(sbx))
    assert r.status_code == 200 and r.json()["query"] == signed.split("?", 1)[1]
    # a signature the token did not make is envd's 401, answered here (envd never sees it)
    r = await stack.client.get("/files?path=a.txt&signature=v1_abc", headers=hdr(sbx))
    assert r.status_code == 401 and r.json() == {"code": 401, "message": "invalid signature"}
    assert (await stack.client.get("/files?path=a.txt", headers=hdr(sbx))).status_code == 401


def _signed_url(path, operation, token, username="", expiration=None):
    from urllib.parse import urlencode

    from envd.auth import make_signature
    query = {"path": path, **({"username": username} if username else {}),
             "signature": make_signature(path, operation, username, token, expiration)}
    if expiration is not None:
        query["signature_expiration"] = str(expiration)
    return "/files?" + urlencode(query)


async def test_signed_file_urls_without_a_sandbox_id_reach_the_sandbox_that_signed_them(stack):
    """E2B_SANDBOX_URL: the SDK's download_url / upload_url carry no sandbox id; the
    sandbox whose envd token made the signature is the one served (envd checks it again)."""
    import time
    other = await make_sandbox(stack.up_port + 1, secure=True, token="other-token")  # never reached
    sbx = await make_sandbox(stack.up_port, secure=True, token="s3cret")
    for _ in range(2):  # the second time from the remembered match
        r = await stack.client.get(_signed_url("/home/user/a.txt", "read", "s3cret"))
        assert r.status_code == 200, r.text
        assert r.json()["path"] == "/files" and "signature=v1_" in r.json()["query"]
    url = _signed_url("b.txt", "write", "s3cret", username="root", expiration=int(time.time()) + 60)
    r = await stack.client.post(url, content=b"data")
    assert r.status_code == 200 and r.json()["method"] == "POST" and r.json()["body"] == "data"
    assert all(name.lower() != "x-access-token" for name, _ in r.json()["headers"])
    # the other sandbox's signature reaches the other sandbox (here: nothing listens there)
    r = await stack.client.get(_signed_url("/x", "read", "other-token"))
    assert r.status_code == 502 and r.json()["sandboxId"] == other.id


async def test_signed_file_urls_refused_with_envds_401s(stack):
    import time
    sbx = await make_sandbox(stack.up_port, secure=True, token="s3cret")
    cases = [
        (_signed_url("/a", "read", "wrong-token"), "invalid signature"),
        (_signed_url("/a", "write", "s3cret"), "invalid signature"),  # a write signature used to read
        (_signed_url("/a", "read", "s3cret", expiration=int(time.time()) - 10), "signature is already expired"),
        (_signed_url("/a", "read", "wrong", expiration=int(time.time()) - 10), "invalid signature"),
        ("/files?path=%2Fa&signature=v1_x&signature_expiration=soon", "invalid signature expiration"),
    ]
    for url, message in cases:
        r = await stack.client.get(url)
        assert r.status_code == 401 and r.json() == {"code": 401, "message": message}, (url, r.text)
    # a killed sandbox's URL (remembered or not) is refused too
    assert (await stack.client.get(_signed_url("/a", "read", "s3cret"))).status_code == 200
    await sync_to_async(Sandbox.objects.filter(pk=sbx.pk).update)(state="killed")
    r = await stack.client.get(_signed_url("/a", "read", "s3cret"))
    assert r.status_code == 401 and r.json()["message"] == "invalid signature"


async def test_unsigned_file_urls_without_a_sandbox_id_are_400(stack):
    await make_sandbox(stack.up_port)  # not secured: its URLs carry no signature
    for method, url in (("GET", "/files?path=%2Fa"), ("PUT", _signed_url("/a", "read", "t")),
                        ("GET", "/filesx?path=a&signature=v1_x")):
        r = await stack.client.request(method, url)
        assert r.status_code == 400 and "signature" in r.json()["message"], (method, url, r.text)


async def test_insecure_sandbox_needs_no_token(stack):
    sbx = await make_sandbox(stack.up_port)
    r = await stack.client.post("/filesystem.Filesystem/Stat", content=b"{}", headers=hdr(sbx))
    assert r.status_code == 200


# --------------------------------------------------------------------------- autoResume


async def _paused_sandbox(stack, node, auto_resume=True):
    sbx = await make_sandbox(stack.up_port, state="paused")
    await sync_to_async(Sandbox.objects.filter(pk=sbx.pk).update)(auto_resume=auto_resume, node=node)
    return sbx


async def test_auto_resume_on_traffic_resumes_once_and_serves(stack, nodes_mock):
    from sandboxes.models import SandboxEvent

    gate = asyncio.Event()

    async def slow_resume(node, **kwargs):
        await gate.wait()
        return {"envd_host": "127.0.0.1", "envd_port": stack.up_port, "pid": 1, "accel": "tcg", "timings": {}}

    nodes_mock.client.resume_sandbox.side_effect = slow_resume
    sbx = await _paused_sandbox(stack, nodes_mock.node)
    requests = [asyncio.ensure_future(stack.client.post("/echo", content=f"r{i}".encode(), headers=hdr(sbx)))
                for i in range(3)]
    await asyncio.sleep(0.5)
    assert not any(r.done() for r in requests)  # they wait for the resume
    gate.set()
    answers = await asyncio.gather(*requests)
    assert [r.status_code for r in answers] == [200, 200, 200]
    assert sorted(r.json()["body"] for r in answers) == ["r0", "r1", "r2"]
    assert nodes_mock.client.resume_sandbox.await_count == 1
    row = await sync_to_async(Sandbox.objects.get)(pk=sbx.pk)
    assert row.state == "running" and row.end_at > timezone.now() + timedelta(seconds=250)
    events = await sync_to_async(list)(SandboxEvent.objects.filter(sandbox_id=sbx.id, operation="resume")
                                       .order_by("id").values_list("outcome", "to_state", "actor", "details"))
    assert [(o, t, a) for o, t, a, _ in events] == [("started", "resuming", "autoresume"),
                                                    ("ok", "running", "autoresume")]
    assert events[0][3]["via"] == "connect"


async def test_paused_without_auto_resume_stays_502(stack, nodes_mock):
    sbx = await _paused_sandbox(stack, nodes_mock.node, auto_resume=False)
    r = await stack.client.get("/health", headers=hdr(sbx))
    assert r.status_code == 502 and r.json()["message"] == "The sandbox was not found"
    nodes_mock.client.resume_sandbox.assert_not_awaited()
    assert (await sync_to_async(Sandbox.objects.get)(pk=sbx.pk)).state == "paused"


async def test_failed_auto_resume_is_502_and_stays_paused(stack, nodes_mock):
    nodes_mock.client.resume_sandbox.side_effect = nodes_mock.client.NodeTaskFailed("no memory", kind="VMError")
    sbx = await _paused_sandbox(stack, nodes_mock.node)
    r = await stack.client.get("/health", headers=hdr(sbx))
    assert r.status_code == 502 and "auto-resume failed" in r.json()["message"] and "no memory" in r.json()["message"]
    assert (await sync_to_async(Sandbox.objects.get)(pk=sbx.pk)).state == "paused"


async def test_traffic_right_after_a_pause_auto_resumes_onto_the_new_vm(stack, nodes_mock):
    """The route used a moment ago is not trusted: a pause is seen on the very next
    request (even while the old address still answers) and the resumed VM serves it."""
    new_vm = Upstream()
    server, task, new_port = await serve(new_vm)
    try:
        nodes_mock.client.resume_sandbox.return_value = {
            "envd_host": "127.0.0.1", "envd_port": new_port, "pid": 2, "accel": "tcg", "timings": {}}
        sbx = await make_sandbox(stack.up_port)
        await sync_to_async(Sandbox.objects.filter(pk=sbx.pk).update)(auto_resume=True, node=nodes_mock.node)
        assert (await stack.client.post("/echo", content=b"before", headers=hdr(sbx))).status_code == 200
        await sync_to_async(Sandbox.objects.filter(pk=sbx.pk).update)(state="paused")  # paused just now
        r = await stack.client.post("/echo", content=b"after", headers=hdr(sbx))
        assert r.status_code == 200 and r.json()["body"] == "after"
        assert len(stack.upstream.clients) == 1 and len(new_vm.clients) == 1
        assert nodes_mock.client.resume_sandbox.await_count == 1
        row = await sync_to_async(Sandbox.objects.get)(pk=sbx.pk)
        assert row.state == "running" and row.envd_port == new_port and row.vm_generation == 1
    finally:
        server.should_exit = True
        await task


def _connects_time_out(monkeypatch, port: int, times: int) -> list:
    """The first ``times`` connects to ``port`` time out, as to a guest too busy to
    answer its SYN; returns the list of connect attempts seen."""
    real_send = pools.Connections.send
    seen = []

    async def send(self, request):
        if request.url.port == port:
            seen.append(request.url.path)
            if len(seen) <= times:
                raise httpx.ConnectTimeout("timed out", request=request)
        return await real_send(self, request)
    monkeypatch.setattr(pools.Connections, "send", send)
    return seen


async def test_a_running_guest_slow_to_accept_is_given_time(stack, monkeypatch):
    seen = _connects_time_out(monkeypatch, stack.up_port, times=3)
    sbx = await make_sandbox(stack.up_port)
    r = await stack.client.get("/health", headers=hdr(sbx))
    assert r.status_code == 204, r.text  # the test upstream's /health
    assert len(seen) == 4


async def test_a_guest_that_never_accepts_is_port_not_open_after_the_patience(stack, monkeypatch):
    seen = _connects_time_out(monkeypatch, stack.up_port, times=10**6)
    monkeypatch.setattr(stack.proxy, "slow_guest_patience", 0.3)
    sbx = await make_sandbox(stack.up_port)
    r = await stack.client.get("/health", headers=hdr(sbx))
    assert r.status_code == 502 and "port is not open" in r.json()["message"]
    assert len(seen) >= 2


async def test_a_refused_connect_is_not_retried_for_patience(stack, monkeypatch):
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    closed_port = free.getsockname()[1]
    free.close()
    real_send = pools.Connections.send
    seen = []

    async def send(self, request):
        if request.url.port == closed_port:
            seen.append(1)
        return await real_send(self, request)
    monkeypatch.setattr(pools.Connections, "send", send)
    sbx = await make_sandbox(closed_port)
    r = await stack.client.get("/health", headers=hdr(sbx))
    assert r.status_code == 502 and "port is not open" in r.json()["message"]
    assert len(seen) == 1


# --------------------------------------------------------------------------- waking a secured sandbox


async def _paused_secured(stack, node):
    sbx = await _paused_sandbox(stack, node)
    await sync_to_async(Sandbox.objects.filter(pk=sbx.pk).update)(secure=True, envd_access_token="s3cret")
    return sbx


def _envd_401(message):
    return 401, {"code": 401, "message": message}


async def test_a_paused_secured_sandbox_is_not_woken_without_its_token_or_signature(stack, nodes_mock):
    """Every way in to envd's port of a paused secured autoResume sandbox without a valid
    X-Access-Token (or, on /files, a signature its token made) is answered as envd would
    answer it — or, for /health (which envd answers without a token), as a sandbox that
    is not running — and nothing is resumed."""
    import time
    sbx = await _paused_secured(stack, nodes_mock.node)
    unauthorized = "unauthorized access, please provide a valid access token or method signing if supported"
    cases = [
        ("POST", "/process.Process/List", hdr(sbx), _envd_401(unauthorized)),
        ("POST", "/process.Process/List", hdr(sbx, **{"x-access-token": "wrong"}), _envd_401(unauthorized)),
        ("GET", "/files?path=%2Fa", hdr(sbx), _envd_401(unauthorized)),
        ("GET", "/files?path=%2Fa&signature=v1_forged", hdr(sbx), _envd_401("invalid signature")),
        ("GET", "/files?path=%2Fa&signature=", hdr(sbx), (502, {"sandboxId": sbx.id, "code": 502,
                                                              "message": "The sandbox was not found"})),
        ("GET", "/x/files?path=%2Fa&signature=v1_x", hdr(sbx), _envd_401(unauthorized)),
        ("POST", _signed_url("/a", "read", "s3cret"), hdr(sbx), _envd_401("invalid signature")),  # read, not write
        ("GET", _signed_url("/a", "read", "s3cret", expiration=int(time.time()) - 5), hdr(sbx),
         _envd_401("signature is already expired")),
        ("GET", "/files?path=%2Fa&signature=v1_forged", {"host": f"49983-{sbx.id}.localhost"},
         _envd_401("invalid signature")),
        ("GET", "/health", hdr(sbx), (502, {"sandboxId": sbx.id, "code": 502, "message": "The sandbox was not found"})),
        ("GET", "/health", hdr(sbx, **{"x-access-token": "wrong"}),
         (502, {"sandboxId": sbx.id, "code": 502, "message": "The sandbox was not found"})),
        ("GET", "/health", {"x-agentenv-sandbox-id": sbx.id, "x-agentenv-target-port": "49983"},
         (410, {"code": 410, "message": "sandbox is not proxyable in its current state (paused)"})),
    ]
    for method, url, headers, (status, body) in cases:
        r = await stack.client.request(method, url, headers=headers)
        assert (r.status_code, r.json()) == (status, body), (method, url, headers)
    nodes_mock.client.resume_sandbox.assert_not_awaited()
    assert (await sync_to_async(Sandbox.objects.get)(pk=sbx.pk)).state == "paused"
    assert stack.upstream.seen_headers is None


async def test_a_websocket_to_a_paused_secured_sandbox_without_its_token_wakes_nothing(stack, nodes_mock):
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    sbx = await _paused_secured(stack, nodes_mock.node)
    with pytest.raises(InvalidStatus) as refused:
        async with connect(f"ws://127.0.0.1:{stack.px_port}/ws", additional_headers=hdr(sbx)):
            pass
    assert refused.value.response.status_code == 401
    nodes_mock.client.resume_sandbox.assert_not_awaited()


@pytest.mark.parametrize("credential", ["token", "signature"])
async def test_a_paused_secured_sandbox_is_woken_by_its_token_or_signature(stack, nodes_mock, credential):
    nodes_mock.client.resume_sandbox.return_value = {
        "envd_host": "127.0.0.1", "envd_port": stack.up_port, "pid": 1, "accel": "tcg", "timings": {}}
    sbx = await _paused_secured(stack, nodes_mock.node)
    if credential == "token":
        r = await stack.client.get("/health", headers=hdr(sbx, **{"x-access-token": "s3cret"}))
        assert r.status_code == 204
    else:
        r = await stack.client.get(_signed_url("/a", "read", "s3cret"), headers=hdr(sbx))
        assert r.status_code == 200 and r.json()["path"] == "/files"
    assert nodes_mock.client.resume_sandbox.await_count == 1
    assert (await sync_to_async(Sandbox.objects.get)(pk=sbx.pk)).state == "running"


# --------------------------------------------------------------------------- signed-URL policy


@pytest.mark.parametrize("named", [True, False])
async def test_the_deployments_signed_url_policy_is_enforced(settings, stack, named):
    """AENV_SIGNED_URL_REQUIRE_EXPIRATION / AENV_SIGNED_URL_MAX_TTL: E2B's SDK signs without
    an expiration unless asked; a deployment may refuse those, and far-off ones, at the data
    plane (envd in the guest does not know the policy). A valid X-Access-Token is not a URL."""
    import time
    sbx = await make_sandbox(stack.up_port, secure=True, token="s3cret")
    route = hdr(sbx) if named else {}
    forever = _signed_url("/a", "read", "s3cret")
    soon = _signed_url("/a", "read", "s3cret", expiration=int(time.time()) + 60)
    later = _signed_url("/a", "read", "s3cret", expiration=int(time.time()) + 7200)
    assert [(await stack.client.get(u, headers=route)).status_code for u in (forever, soon, later)] == [200] * 3
    settings.AENV_SIGNED_URL_REQUIRE_EXPIRATION = True
    settings.AENV_SIGNED_URL_MAX_TTL = 3600
    r = await stack.client.get(forever, headers=route)
    assert (r.status_code, r.json()) == _envd_401("signature expiration is required (signed URLs must expire here)")
    r = await stack.client.get(later, headers=route)
    assert (r.status_code, r.json()) == _envd_401("signature expiration is too far in the future (at most 3600 s ahead)")
    assert (await stack.client.get(soon, headers=route)).status_code == 200
    # forged stays "invalid signature" whatever the policy (judged first, as envd does)
    r = await stack.client.get("/files?path=%2Fa&signature=v1_forged", headers=route)
    assert r.json()["message"] == "invalid signature"
    r = await stack.client.get("/files?path=%2Fa", headers={**hdr(sbx), "x-access-token": "s3cret"})
    assert r.status_code == 200


def test_a_misspelt_flag_setting_is_refused(monkeypatch):
    from django.core.exceptions import ImproperlyConfigured

    from config.settings import _env_bool

    monkeypatch.setenv("AENV_SIGNED_URL_REQUIRE_EXPIRATION", "treu")
    with pytest.raises(ImproperlyConfigured):
        _env_bool("AENV_SIGNED_URL_REQUIRE_EXPIRATION", False)
    monkeypatch.setenv("AENV_SIGNED_URL_REQUIRE_EXPIRATION", "ON")
    assert _env_bool("AENV_SIGNED_URL_REQUIRE_EXPIRATION", False) is True


@pytest.mark.parametrize("name", ["AENV_CONSOLE_LOG_MAX_KB", "AENV_DISK_BPS_MAX_MB", "AENV_DISK_IOPS_MAX",
                                  "AENV_BUILD_LOG_MAX_MB"])
def test_a_negative_guest_bound_stops_the_settings(name):
    """A negative bound is refused when the settings load, not later inside a VM start or a build."""
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import config.settings"], capture_output=True, text=True,
                          env={**os.environ, name: "-1"}, timeout=60)
    assert done.returncode != 0 and f"{name} must be >= 0" in done.stderr, done.stderr[-500:]
