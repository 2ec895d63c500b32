"""A guest's Set-Cookie through the data plane (issue 21, item 10): a cookie reached
through the sandbox's own host ``{port}-{id}.{domain}`` passes as a host-only cookie (no
``Domain``: a guest cannot set cookies for the shared sandbox domain, other sandboxes or
the API's host); through a host shared by every sandbox (routing headers, the API's
``/proxy`` mount) it is dropped. HTTP responses and WebSocket handshakes alike. Real
uvicorn servers stand in for the guest's services (test_proxy's fixtures)."""
import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.asyncio.server import serve as ws_serve
from websockets.datastructures import Headers
from websockets.exceptions import InvalidStatus
from websockets.http11 import Response

from dataplane.mount import ApiProxyMount
from dataplane import cookies as proxy_cookies
from tests.unit import test_proxy
from tests.unit.test_proxy import serve
from tests.unit.test_proxy_ports import user_sandbox

pytestmark = pytest.mark.django_db(transaction=True)

stack = test_proxy.stack
_close_async_orm_connections = test_proxy._close_async_orm_connections

COOKIES = [
    b"sid=abc; Domain=sbx.example.test; Path=/; HttpOnly",   # the whole sandbox domain
    b"wide=1; path=/; DOMAIN=.example.test; Secure",          # a parent, any case
    b"mine=2; Domain=%s; SameSite=Lax",                       # its own host, spelled out
    b"plain=3; Path=/app",                                    # already host-only
]


async def cookie_app(scope, receive, send):
    """A guest service answering every request with COOKIES (its own host filled in)."""
    if scope["type"] != "http":
        return
    host = dict(scope["headers"]).get(b"host", b"").split(b":")[0]
    headers = [(b"set-cookie", c.replace(b"%s", host)) for c in COOKIES]
    headers += [(b"set-cookie2", b"old=1; Domain=example.test"), (b"content-type", b"text/plain")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
async def service():
    server, task, port = await serve(cookie_app)
    yield port
    server.should_exit = True
    await task


def set_cookies(response: httpx.Response) -> list[str]:
    return response.headers.get_list("set-cookie")


async def test_own_host_keeps_cookies_without_their_domain(stack, service):
    sbx = await user_sandbox(stack.up_port)
    host = f"{service}-{sbx.id}.sbx.example.test"
    r = await stack.client.get("/", headers={"host": f"{host}:{stack.px_port}"})
    assert r.status_code == 200 and r.text == "ok"
    assert set_cookies(r) == ["sid=abc; Path=/; HttpOnly", "wide=1; path=/; Secure", "mine=2; SameSite=Lax",
                              "plain=3; Path=/app"]
    assert "set-cookie2" not in r.headers
    # the browser's view: every cookie belongs to that exact host only
    jar = httpx.Cookies()
    jar.extract_cookies(httpx.Response(200, headers=r.headers.multi_items(),
                                       request=httpx.Request("GET", f"http://{host}/")))
    assert {(c.name, c.domain, c.domain_specified) for c in jar.jar} == {
        (n, host, False) for n in ("sid", "wide", "mine", "plain")}


async def test_header_routing_drops_the_guests_cookies(stack, service):
    sbx = await user_sandbox(stack.up_port)
    r = await stack.client.get("/", headers={"E2b-Sandbox-Id": sbx.id, "E2b-Sandbox-Port": str(service)})
    assert r.status_code == 200 and r.text == "ok"
    assert set_cookies(r) == [] and "set-cookie2" not in r.headers


async def test_a_sandbox_host_naming_another_sandbox_drops_them(stack, service):
    """Routing headers win over the Host: the host then names another sandbox (or port)
    than the one that answers, which must not set cookies for it."""
    mine, other = await user_sandbox(stack.up_port), await user_sandbox(stack.up_port)
    for host in (f"{service}-{other.id}.sbx.example.test", f"8080-{mine.id}.sbx.example.test"):
        r = await stack.client.get("/", headers={"host": host, "E2b-Sandbox-Id": mine.id,
                                                 "E2b-Sandbox-Port": str(service)})
        assert r.status_code == 200 and set_cookies(r) == [], host


async def test_the_api_proxy_mount_drops_them(stack, service):
    """AgentENV's /proxy on the API's port: that host is the dashboard's."""
    sbx = await user_sandbox(stack.up_port)
    app = ApiProxyMount(app=None, proxy=stack.proxy)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api.example.test") as c:
        r = await c.get("/proxy/", headers={"host": f"{service}-{sbx.id}.sbx.example.test",
                                            "x-agentenv-sandbox-id": sbx.id, "x-agentenv-target-port": str(service)})
    assert r.status_code == 200 and r.text == "ok" and set_cookies(r) == []


@pytest.fixture
async def ws_service():
    """A WebSocket service whose handshake answers set COOKIES; /nope rejects it (403)."""

    def process_request(connection, request):
        if request.path.startswith("/nope"):
            host = request.headers["Host"].split(":")[0].encode()
            return Response(403, "Forbidden", Headers([("Set-Cookie", c.replace(b"%s", host).decode())
                                                       for c in COOKIES]), b"no")
        return None

    def process_response(connection, request, response):
        host = request.headers["Host"].split(":")[0].encode()
        for c in COOKIES:
            response.headers["Set-Cookie"] = c.replace(b"%s", host).decode()

    async def handler(ws):
        async for message in ws:
            await ws.send(message)

    async with ws_serve(handler, "127.0.0.1", 0, process_request=process_request,
                        process_response=process_response) as server:
        yield server.sockets[0].getsockname()[1]


async def test_websocket_handshakes_confine_cookies_alike(stack, ws_service):
    sbx = await user_sandbox(stack.up_port)
    host = f"{ws_service}-{sbx.id}.sbx.example.test"
    async with connect(f"ws://{host}:{stack.px_port}/", host="127.0.0.1", port=stack.px_port) as ws:
        assert ws.response.headers.get_all("Set-Cookie") == [
            "sid=abc; Path=/; HttpOnly", "wide=1; path=/; Secure", "mine=2; SameSite=Lax", "plain=3; Path=/app"]
    async with connect(f"ws://127.0.0.1:{stack.px_port}/",
                       additional_headers={"E2b-Sandbox-Id": sbx.id, "E2b-Sandbox-Port": str(ws_service)}) as ws:
        assert ws.response.headers.get_all("Set-Cookie") == []
    with pytest.raises(InvalidStatus) as refused:  # a rejected handshake, relayed
        async with connect(f"ws://{host}:{stack.px_port}/nope", host="127.0.0.1", port=stack.px_port):
            pass
    assert refused.value.response.status_code == 403
    assert refused.value.response.headers.get_all("Set-Cookie")[0] == "sid=abc; Path=/; HttpOnly"


def test_host_only_keeps_every_other_attribute_as_sent():
    assert proxy_cookies.host_only(b"a=b;Domain=x;domain = y ; Max-Age=5;Path=/") == b"a=b; Max-Age=5;Path=/"
    assert proxy_cookies.host_only(b"a=b=c") == b"a=b=c"
    assert proxy_cookies.host_only(b"domain=value; Path=/") == b"domain=value; Path=/"  # a cookie named domain
