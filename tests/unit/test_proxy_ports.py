"""The data plane's user ports (issue 10): any guest port at ``guest_host:N``, the
client's Host (or maskRequestHost), connect retries, the traffic access token, envd's
node-only routes and CORS. Real uvicorn servers on 127.0.0.1 stand in for the guest's
services; the sandbox rows live in the test database (the fixtures of test_proxy)."""
import asyncio
import json
import socket

import httpx
import pytest
import uvicorn
from asgiref.sync import sync_to_async

from sandboxes.models import Sandbox
from tests.unit import test_proxy
from tests.unit.test_proxy import Upstream, _make_sandbox, hdr, serve

pytestmark = pytest.mark.django_db(transaction=True)

# test_proxy's fixtures: the data plane and an envd stand-in on uvicorn, async ORM cleanup.
stack = test_proxy.stack
_close_async_orm_connections = test_proxy._close_async_orm_connections

TOKEN = "tr4ffic-t0ken"


def _user_sandbox(envd_port, guest_host="127.0.0.1", traffic_token="", network=None, **kwargs):
    sbx = _make_sandbox(envd_port, **kwargs)
    Sandbox.objects.filter(pk=sbx.pk).update(guest_host=guest_host, traffic_access_token=traffic_token,
                                             network=network)
    return Sandbox.objects.get(pk=sbx.pk)


user_sandbox = sync_to_async(_user_sandbox)


@pytest.fixture
async def service():
    """A guest service on its own port (not envd's): echoes what it received."""
    app = Upstream()
    server, task, port = await serve(app)
    yield type("Service", (), dict(app=app, port=port))
    server.should_exit = True
    await task


def _unlistened_port():
    """A bound socket that does not listen: a connect to it is refused, and no other
    process can take its port meanwhile."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock, sock.getsockname()[1]


def _count_attempts(proxy):
    """Wraps proxy.attempts; the returned list grows by one per connect attempt."""
    seen = []
    real = proxy.attempts

    async def attempts(route, port, failures=None):
        async for r in real(route, port, failures):
            seen.append(port)
            yield r

    proxy.attempts = attempts
    return seen


def _seen(service) -> dict:
    return {n: v for n, v in service.app.seen_headers}


# --------------------------------------------------------------------------- any port


async def test_user_port_through_the_routing_headers(stack, service):
    sbx = await user_sandbox(stack.up_port)
    r = await stack.client.post("/api/items?x=1", content=b"payload",
                                headers=hdr(sbx, port=service.port, **{"x-custom": "1"}))
    assert r.status_code == 200
    seen = r.json()
    assert (seen["method"], seen["path"], seen["query"], seen["body"]) == ("POST", "/api/items", "x=1", "payload")
    headers = dict(seen["headers"])
    assert headers["x-custom"] == "1" and "e2b-sandbox-id" not in headers and "e2b-sandbox-port" not in headers
    # E2B forwards the client's Host to user ports (here: the data plane's own address)
    assert headers["host"] == f"127.0.0.1:{stack.px_port}"
    assert stack.upstream.clients == []  # envd was not involved
    assert "access-control-allow-origin" not in r.headers  # the service's answer, untouched


async def test_user_port_through_the_host_form_keeps_the_clients_host(stack, service):
    sbx = await user_sandbox(stack.up_port)
    host = f"{service.port}-{sbx.id}.sbx.example.test:{stack.px_port}"
    r = await stack.client.get("/page", headers={"host": host})
    assert r.status_code == 200 and r.json()["path"] == "/page"
    assert _seen(service)["host"] == host


async def test_envd_port_still_gets_the_upstream_address_as_host(stack):
    sbx = await user_sandbox(stack.up_port)
    r = await stack.client.get("/x", headers={"host": f"49983-{sbx.id}.sbx.example.test"})
    assert ["host", f"127.0.0.1:{stack.up_port}"] in r.json()["headers"]


async def test_mask_request_host_replaces_the_port_and_keeps_the_original(stack, service):
    sbx = await user_sandbox(stack.up_port, network={"maskRequestHost": "custom-host.example.com:${PORT}"})
    host = f"{service.port}-{sbx.id}.sbx.example.test"
    r = await stack.client.get("/", headers={"host": host, "x-forwarded-host": "spoofed.example"})
    assert r.status_code == 200
    headers = r.json()["headers"]
    assert ["host", f"custom-host.example.com:{service.port}"] in headers
    assert [v for n, v in headers if n == "x-forwarded-host"] == [host]
    assert [v for n, v in headers if n == "host"] == [f"custom-host.example.com:{service.port}"]


async def test_mask_request_host_does_not_apply_to_envd(stack):
    sbx = await user_sandbox(stack.up_port, network={"maskRequestHost": "custom-host.example.com:${PORT}"})
    r = await stack.client.get("/x", headers=hdr(sbx))
    names = dict(r.json()["headers"])
    assert names["host"] == f"127.0.0.1:{stack.up_port}" and "x-forwarded-host" not in names


async def test_user_port_without_guest_host_is_502_port_not_open(stack, service):
    sbx = await user_sandbox(stack.up_port, guest_host="")
    attempts = _count_attempts(stack.proxy)
    r = await stack.client.get("/", headers=hdr(sbx, port=service.port))
    assert r.status_code == 502
    assert r.json() == {"sandboxId": sbx.id, "message": "The sandbox is running but port is not open", "code": 502,
                        "port": service.port}
    assert attempts == [] and service.app.seen_headers is None


async def test_closed_user_port_is_502_after_five_tries(stack):
    sock, port = _unlistened_port()
    try:
        sbx = await user_sandbox(stack.up_port)
        attempts = _count_attempts(stack.proxy)
        r = await stack.client.get("/", headers=hdr(sbx, port=port))
    finally:
        sock.close()
    assert r.status_code == 502
    assert r.json() == {"sandboxId": sbx.id, "message": "The sandbox is running but port is not open", "code": 502,
                        "port": port}
    assert len(attempts) == 5  # E2B's 5 tries; the route did not move, so no 6th


async def test_closed_envd_port_is_tried_once(stack):
    sock, port = _unlistened_port()
    try:
        sbx = await user_sandbox(port)
        attempts = _count_attempts(stack.proxy)
        r = await stack.client.get("/health", headers=hdr(sbx))
    finally:
        sock.close()
    assert r.status_code == 502 and r.json()["message"] == "The sandbox is running but port is not open"
    assert len(attempts) == 1


async def test_a_service_that_listens_300ms_late_is_reached(stack):
    sock, port = _unlistened_port()
    app = Upstream()
    sbx = await user_sandbox(stack.up_port)
    attempts = _count_attempts(stack.proxy)
    request = asyncio.ensure_future(stack.client.post("/late", content=b"hi", headers=hdr(sbx, port=port)))
    await asyncio.sleep(0.3)
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning", timeout_graceful_shutdown=2))
    serving = asyncio.create_task(server.serve(sockets=[sock]))  # starts listening now
    try:
        r = await request
    finally:
        server.should_exit = True
        await serving
        sock.close()
    assert r.status_code == 200 and r.json()["body"] == "hi"
    assert len(attempts) >= 2  # the first connect was refused, a later one served


# --------------------------------------------------------------------------- strict ports

# Not ports: a Unicode digit ('²'.isdigit() is True; int('²') raised: a 500), a sign, a
# space inside, out of range, hex, too long, empty; the raw UTF-8 and Latin-1 bytes of '²'.
BAD_PORTS = [b"\xc2\xb2", b"\xb2", b"-1", b"0", b"65536", b"70000", b"+80", b"8 0", b"0x50", b"000080", b""]


async def raw_request(port: int, head: bytes, close: bool = True) -> tuple[int, dict]:
    """Sends ``head`` (request line and headers, bytes as they are: httpx will not send
    non-ASCII header bytes) and returns the status and JSON body of the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head + (b"Connection: close\r\n" if close else b"") + b"\r\n")
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    status_line, _, rest = data.partition(b"\r\n")
    body = rest.split(b"\r\n\r\n", 1)[1]
    return int(status_line.split()[1]), json.loads(body)


def test_parse_port_takes_ascii_digits_from_1_to_65535_only():
    from dataplane.addressing import parse_port

    assert [parse_port(p) for p in (b"1", b"80", "080", b"49983", "65535")] == [1, 80, 80, 49983, 65535]
    for bad in (*BAD_PORTS, "²", "\u0668\u0660", " 80", "80 ", "\t80", "1e3", "８０"):
        assert parse_port(bad) is None, bad


@pytest.mark.parametrize("bad", BAD_PORTS)
async def test_a_bad_e2b_port_header_is_400_and_reaches_nothing(stack, bad):
    sbx = await user_sandbox(stack.up_port)
    status, body = await raw_request(stack.px_port, b"GET /health HTTP/1.1\r\nHost: x\r\nE2b-Sandbox-Id: "
                                     + sbx.id.encode() + b"\r\nE2b-Sandbox-Port: " + bad + b"\r\n")
    assert (status, body["code"]) == (400, 400) and "invalid sandbox port" in body["message"], body
    assert stack.upstream.seen_headers is None  # envd's /health was not asked (it answered 204 before)


@pytest.mark.parametrize("bad", BAD_PORTS)
async def test_a_bad_agentenv_port_header_is_400(stack, bad):
    sbx = await user_sandbox(stack.up_port)
    status, body = await raw_request(stack.px_port, b"GET /health HTTP/1.1\r\nHost: x\r\nx-agentenv-sandbox-id: "
                                     + sbx.id.encode() + b"\r\nx-agentenv-target-port: " + bad + b"\r\n")
    assert (status, body) == (400, {"code": 400, "message": "invalid target port routing header"})
    assert stack.upstream.seen_headers is None


@pytest.mark.parametrize("bad", [b"0", b"65536", b"99999999", b"-1", b"+80", b"\xc2\xb2", b"\xb2", b"0x50"])
async def test_a_bad_port_in_the_host_name_is_400(stack, bad):
    sbx = await user_sandbox(stack.up_port)
    status, body = await raw_request(stack.px_port, b"GET /health HTTP/1.1\r\nHost: " + bad + b"-"
                                     + sbx.id.encode() + b".localhost\r\n")
    assert (status, body["code"]) == (400, 400), body
    assert stack.upstream.seen_headers is None


async def test_a_good_port_with_http_whitespace_around_it_is_served(stack):
    """HTTP strips optional whitespace around a header value before the app sees it."""
    sbx = await user_sandbox(stack.up_port)
    reader, writer = await asyncio.open_connection("127.0.0.1", stack.px_port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nE2b-Sandbox-Id: " + sbx.id.encode()
                 + b"\r\nE2b-Sandbox-Port:  49983 \r\nConnection: close\r\n\r\n")
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    assert data.startswith(b"HTTP/1.1 204")


@pytest.mark.parametrize("bad", [b"\xc2\xb2", b"-1", b"0", b"65536"])
async def test_a_websocket_upgrade_with_a_bad_port_is_400(stack, bad):
    sbx = await user_sandbox(stack.up_port)
    status, body = await raw_request(stack.px_port, (
        b"GET /socket HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
        b"E2b-Sandbox-Id: " + sbx.id.encode() + b"\r\nE2b-Sandbox-Port: " + bad + b"\r\n"), close=False)
    assert (status, body["code"]) == (400, 400), body


async def test_killed_sandbox_user_port_is_502_not_found(stack, service):
    sbx = await user_sandbox(stack.up_port, state="killed")
    r = await stack.client.get("/", headers=hdr(sbx, port=service.port))
    assert r.status_code == 502 and r.json()["message"] == "The sandbox was not found"


async def test_user_ports_share_one_pool_per_vm_generation(stack, service):
    other = Upstream()
    server, task, other_port = await serve(other)
    try:
        sbx = await user_sandbox(stack.up_port)
        for port in (service.port, other_port, service.port, 49983, other_port):
            assert (await stack.client.get("/", headers=hdr(sbx, port=port))).status_code in (200, 204)
        assert len(stack.proxy.pools) == 1
        # one kept-alive connection per port: switching ports did not retire the pool
        assert len(set(service.app.clients)) == 1 and len(set(other.clients)) == 1
    finally:
        server.should_exit = True
        await task


# --------------------------------------------------------------------------- traffic token


async def test_traffic_token_missing_is_403(stack, service):
    sbx = await user_sandbox(stack.up_port, traffic_token=TOKEN)
    r = await stack.client.get("/", headers=hdr(sbx, port=service.port))
    assert r.status_code == 403
    assert r.json() == {"sandboxId": sbx.id, "code": 403, "message": (
        "Sandbox is secured with traffic access token. Token header 'e2b-traffic-access-token' is missing")}
    assert service.app.seen_headers is None


async def test_traffic_token_wrong_is_403(stack, service):
    sbx = await user_sandbox(stack.up_port, traffic_token=TOKEN)
    r = await stack.client.get("/", headers=hdr(sbx, port=service.port, **{"e2b-traffic-access-token": "nope"}))
    assert r.status_code == 403
    assert r.json()["message"] == ("Sandbox is secured with traffic access token. "
                                   "Provided token in header 'e2b-traffic-access-token' is invalid")
    assert service.app.seen_headers is None


async def test_traffic_token_right_is_served_and_stripped(stack, service):
    sbx = await user_sandbox(stack.up_port, traffic_token=TOKEN)
    r = await stack.client.get("/ok", headers=hdr(sbx, port=service.port, **{"e2b-traffic-access-token": TOKEN}))
    assert r.status_code == 200 and r.json()["path"] == "/ok"
    assert "e2b-traffic-access-token" not in dict(r.json()["headers"])


async def test_traffic_token_is_not_needed_on_envd_port(stack):
    sbx = await user_sandbox(stack.up_port, traffic_token=TOKEN)
    assert (await stack.client.get("/health", headers=hdr(sbx))).status_code == 204
    r = await stack.client.post("/process.Process/List", content=b"{}", headers=hdr(sbx))
    assert r.status_code == 200


async def test_public_sandbox_needs_no_traffic_token(stack, service):
    sbx = await user_sandbox(stack.up_port)
    assert (await stack.client.get("/", headers=hdr(sbx, port=service.port))).status_code == 200


async def test_paused_sandbox_without_traffic_token_is_not_resumed(stack, service, nodes_mock):
    sbx = await user_sandbox(stack.up_port, traffic_token=TOKEN, state="paused")
    await sync_to_async(Sandbox.objects.filter(pk=sbx.pk).update)(auto_resume=True, node=nodes_mock.node)
    r = await stack.client.get("/", headers=hdr(sbx, port=service.port))
    assert r.status_code == 403
    nodes_mock.client.resume_sandbox.assert_not_awaited()


# --------------------------------------------------------------------------- envd's node-only routes


@pytest.mark.parametrize("method,path", [("POST", "/init"), ("POST", "//init"), ("POST", "/%69nit"),
                                         ("POST", "/init/"), ("POST", "/x/../init"), ("POST", "/aenv/sync"),
                                         ("GET", "/aenv"), ("POST", "/AENV/../aenv/sync")])
async def test_node_only_envd_routes_are_refused(stack, method, path):
    sbx = await user_sandbox(stack.up_port)
    url = httpx.URL(f"http://127.0.0.1:{stack.px_port}").copy_with(raw_path=path.encode())  # verbatim
    r = await stack.client.request(method, url, content=b"{}", headers=hdr(sbx))
    assert r.status_code == 403 and r.json()["code"] == 403 and r.json()["sandboxId"] == sbx.id
    assert stack.upstream.clients == []


@pytest.mark.parametrize("method,path", [("GET", "/health"), ("GET", "/files?path=/a"), ("POST", "/files"),
                                         ("GET", "/envs"), ("GET", "/metrics"), ("POST", "/process.Process/Start"),
                                         ("POST", "/filesystem.Filesystem/Stat"), ("GET", "/initialize"),
                                         ("GET", "/aenvx")])
async def test_sdk_envd_routes_pass(stack, method, path):
    sbx = await user_sandbox(stack.up_port)
    r = await stack.client.request(method, path, content=b"{}" if method == "POST" else None, headers=hdr(sbx))
    assert r.status_code in (200, 204)
    assert len(stack.upstream.clients) == 1


async def test_node_only_paths_on_a_user_port_are_the_services_own(stack, service):
    sbx = await user_sandbox(stack.up_port)
    r = await stack.client.post("/init", content=b"{}", headers=hdr(sbx, port=service.port))
    assert r.status_code == 200 and r.json()["path"] == "/init"


# --------------------------------------------------------------------------- CORS


PREFLIGHT = {"origin": "https://app.example", "access-control-request-method": "POST",
             "access-control-request-headers": "authorization, connect-protocol-version, content-type, "
                                               "e2b-sandbox-id, e2b-sandbox-port, x-access-token"}


async def test_preflight_without_routing_headers_is_answered_here(stack):
    r = await stack.client.options("/process.Process/Start", headers=PREFLIGHT)
    assert r.status_code == 204
    assert r.headers["access-control-allow-origin"] == "*"
    assert set(r.headers["access-control-allow-methods"].replace(" ", "").split(",")) >= {
        "GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"}
    assert r.headers["access-control-allow-headers"] == PREFLIGHT["access-control-request-headers"]
    assert r.headers["access-control-expose-headers"] == "*"
    assert int(r.headers["access-control-max-age"]) > 0
    assert stack.upstream.clients == []


async def test_preflight_for_envd_by_host_is_not_forwarded(stack):
    sbx = await user_sandbox(stack.up_port)
    r = await stack.client.options("/files", headers={**PREFLIGHT, "host": f"49983-{sbx.id}.sbx.example.test"})
    assert r.status_code == 204 and r.headers["access-control-allow-origin"] == "*"
    assert stack.upstream.clients == []


async def test_preflight_for_a_user_port_goes_to_the_service(stack, service):
    sbx = await user_sandbox(stack.up_port)
    r = await stack.client.options("/api", headers={**PREFLIGHT, "host": f"{service.port}-{sbx.id}.sbx.example.test"})
    assert r.status_code == 200 and r.json()["method"] == "OPTIONS"


async def test_envd_answers_and_our_errors_are_readable_cross_origin(stack):
    sbx = await user_sandbox(stack.up_port)
    r = await stack.client.post("/process.Process/List", content=b"{}",
                                headers=hdr(sbx, origin="https://app.example"))
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "*" and r.headers["access-control-expose-headers"] == "*"
    r = await stack.client.get("/health", headers={"E2b-Sandbox-Id": "inope", "origin": "https://app.example"})
    assert r.status_code == 502 and r.headers["access-control-allow-origin"] == "*"
    assert r.headers.get_list("access-control-allow-origin") == ["*"]
