"""WebSocket upgrades through the data plane (issue 10): a real uvicorn serving the proxy
(its default ``--ws auto``, as deployed) in front of a real ``websockets`` echo server
standing in for a guest service; the sandbox rows live in the test database."""
import asyncio
import json
import socket

import pytest
from websockets.asyncio.client import connect
from websockets.asyncio.server import serve as ws_serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.http11 import Response

from tests.unit import test_proxy
from tests.unit.test_proxy_ports import TOKEN, user_sandbox

pytestmark = pytest.mark.django_db(transaction=True)

# test_proxy's fixtures: the data plane and an envd stand-in on uvicorn, async ORM cleanup.
stack = test_proxy.stack
_close_async_orm_connections = test_proxy._close_async_orm_connections


class EchoService:
    """Echoes every message; "close-me" makes it close with 4001 "bye", "drop" breaks its
    connection without a close frame. Records each
    handshake request and the close code the client side sent."""

    def __init__(self):
        self.requests = []
        self.client_closes = []
        self.closed = asyncio.Event()

    async def handler(self, ws):
        self.requests.append(ws.request)
        try:
            async for message in ws:
                if message == "drop":
                    ws.transport.abort()  # the service's connection breaks: no close frame
                    return
                if message == "close-me":
                    await ws.close(4001, "bye")
                    return
                await ws.send(message)
        except ConnectionClosed:
            pass
        finally:
            if ws.close_code is not None:
                self.client_closes.append((ws.close_code, ws.close_reason))
            self.closed.set()

    @staticmethod
    def select_subprotocol(connection, offered):
        return next((p for p in ("chat.v2", "chat.v1") if p in offered), None)  # none offered: none chosen

    @staticmethod
    def process_request(connection, request):
        if request.path.startswith("/nope"):
            return Response(404, "Not Found", Headers([("Content-Type", "text/plain"), ("X-Why", "no such thing")]),
                            b"no such socket")
        return None


@pytest.fixture
async def echo():
    service = EchoService()
    async with ws_serve(service.handler, "127.0.0.1", 0, select_subprotocol=service.select_subprotocol,
                        process_request=service.process_request) as server:
        service.port = server.sockets[0].getsockname()[1]
        yield service


def ws_url(stack, path="/"):
    return f"ws://127.0.0.1:{stack.px_port}{path}"


def route(sbx, port, **extra):
    return {"E2b-Sandbox-Id": sbx.id, "E2b-Sandbox-Port": str(port), **extra}


async def test_echo_text_binary_subprotocol_and_close_codes(stack, echo):
    sbx = await user_sandbox(stack.up_port)
    async with connect(ws_url(stack, "/socket?room=a%2Fb"), additional_headers=route(sbx, echo.port),
                       subprotocols=["chat.v1", "chat.v2"]) as ws:
        assert ws.subprotocol == "chat.v2"  # the service's choice, passed back
        await ws.send("hello")
        assert await ws.recv() == "hello"
        await ws.send(b"\x00\x01binary\xff")
        assert await ws.recv() == b"\x00\x01binary\xff"
        big = bytes(range(256)) * 4096  # 1 MiB
        await ws.send(big)
        assert await ws.recv() == big
        await ws.send("close-me")
        with pytest.raises(ConnectionClosed) as closed:
            await ws.recv()
    assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (4001, "bye")  # the service's close, passed on
    request = echo.requests[0]
    assert request.path == "/socket?room=a%2Fb"
    assert "E2b-Sandbox-Id" not in request.headers and "E2b-Sandbox-Port" not in request.headers
    assert request.headers["Host"] == f"127.0.0.1:{stack.px_port}"  # the client's Host


async def test_client_close_code_reaches_the_service(stack, echo):
    sbx = await user_sandbox(stack.up_port)
    async with connect(ws_url(stack), additional_headers=route(sbx, echo.port)) as ws:
        await ws.send("ping")
        assert await ws.recv() == "ping"
        await ws.close(4002, "done here")
    await asyncio.wait_for(echo.closed.wait(), 10)
    assert echo.client_closes == [(4002, "done here")]


async def test_host_form_and_mask_request_host(stack, echo):
    sbx = await user_sandbox(stack.up_port, network={"maskRequestHost": "masked.example:${PORT}"})
    host = f"{echo.port}-{sbx.id}.sbx.example.test"
    async with connect(f"ws://{host}:{stack.px_port}/x", host="127.0.0.1", port=stack.px_port) as ws:
        await ws.send("hi")
        assert await ws.recv() == "hi"
    headers = echo.requests[0].headers
    assert headers.get_all("Host") == [f"masked.example:{echo.port}"]
    assert headers["X-Forwarded-Host"] == f"{host}:{stack.px_port}"


async def test_without_traffic_token_the_upgrade_is_refused(stack, echo):
    sbx = await user_sandbox(stack.up_port, traffic_token=TOKEN)
    with pytest.raises(InvalidStatus) as refused:
        async with connect(ws_url(stack), additional_headers=route(sbx, echo.port)):
            pass
    assert refused.value.response.status_code == 403
    assert json.loads(refused.value.response.body)["message"].endswith("'e2b-traffic-access-token' is missing")
    with pytest.raises(InvalidStatus) as refused:
        async with connect(ws_url(stack), additional_headers=route(sbx, echo.port,
                                                                   **{"e2b-traffic-access-token": "bad"})):
            pass
    assert refused.value.response.status_code == 403
    assert echo.requests == []


async def test_with_traffic_token_the_upgrade_passes_and_the_token_is_stripped(stack, echo):
    sbx = await user_sandbox(stack.up_port, traffic_token=TOKEN)
    async with connect(ws_url(stack), additional_headers=route(sbx, echo.port,
                                                               **{"e2b-traffic-access-token": TOKEN})) as ws:
        await ws.send("ok")
        assert await ws.recv() == "ok"
    assert "e2b-traffic-access-token" not in echo.requests[0].headers


async def test_closed_port_is_502_after_retries(stack):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    try:
        sbx = await user_sandbox(stack.up_port)
        with pytest.raises(InvalidStatus) as refused:
            async with connect(ws_url(stack), additional_headers=route(sbx, port)):
                pass
    finally:
        sock.close()
    assert refused.value.response.status_code == 502
    assert json.loads(refused.value.response.body) == {
        "sandboxId": sbx.id, "message": "The sandbox is running but port is not open", "code": 502, "port": port}


async def test_unknown_sandbox_is_502_not_found(stack, echo):
    with pytest.raises(InvalidStatus) as refused:
        async with connect(ws_url(stack), additional_headers={"E2b-Sandbox-Id": "inope",
                                                              "E2b-Sandbox-Port": str(echo.port)}):
            pass
    assert refused.value.response.status_code == 502
    assert json.loads(refused.value.response.body)["message"] == "The sandbox was not found"


async def test_a_rejected_upgrade_is_relayed(stack, echo):
    sbx = await user_sandbox(stack.up_port)
    with pytest.raises(InvalidStatus) as refused:
        async with connect(ws_url(stack, "/nope"), additional_headers=route(sbx, echo.port)):
            pass
    response = refused.value.response
    assert (response.status_code, response.body, response.headers["X-Why"]) == (404, b"no such socket",
                                                                                  "no such thing")


async def test_a_service_that_never_answers_the_handshake_is_504(stack, monkeypatch):
    from dataplane import websockets as proxy_ws

    monkeypatch.setattr(proxy_ws, "HANDSHAKE_TIMEOUT", 0.5)
    accepted = []

    async def silent(reader, writer):
        accepted.append(writer)
        await reader.read()  # reads the handshake, never answers

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        sbx = await user_sandbox(stack.up_port)
        with pytest.raises(InvalidStatus) as refused:
            async with connect(ws_url(stack), additional_headers=route(sbx, port)):
                pass
    finally:
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()
    assert refused.value.response.status_code == 504 and json.loads(refused.value.response.body)["code"] == 504


async def test_a_broken_service_connection_closes_the_client_with_1014(stack, echo):
    sbx = await user_sandbox(stack.up_port)
    async with connect(ws_url(stack), additional_headers=route(sbx, echo.port)) as ws:
        await ws.send("drop")
        with pytest.raises(ConnectionClosed) as closed:
            await ws.recv()
    assert closed.value.rcvd.code == 1014  # Bad Gateway: the far side vanished


async def test_no_guest_address_is_502(stack, echo):
    sbx = await user_sandbox(stack.up_port, guest_host="")
    with pytest.raises(InvalidStatus) as refused:
        async with connect(ws_url(stack), additional_headers=route(sbx, echo.port)):
            pass
    assert refused.value.response.status_code == 502 and echo.requests == []
