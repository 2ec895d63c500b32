"""AgentENV's proxy contract (issue 20 item 3), next to E2B's which must not change:
``x-agentenv-sandbox-id`` / ``x-agentenv-target-port`` on the data plane's port, the same
at ``/proxy[/…]`` on the API's port (the prefix is not forwarded), and AgentENV's own
statuses there — 400 for missing or bad routing headers, 404 for an unknown sandbox, 410
for a paused one without autoResume, 401 for a private or secured sandbox without its
token. Real uvicorn servers stand in for the data plane, the API and the guest's services
(the fixtures of test_proxy, test_proxy_ports and test_proxy_ws)."""
import asyncio

import httpx
import pytest
from asgiref.sync import sync_to_async
from websockets.asyncio.client import connect

from envd import ENVD_PORT
from sandboxes.models import ApiKey, Sandbox, Team
from tests.unit import test_proxy, test_proxy_ports, test_proxy_ws
from tests.unit.test_proxy import _paused_sandbox, hdr, make_sandbox, serve
from tests.unit.test_proxy_ports import TOKEN, user_sandbox

pytestmark = pytest.mark.django_db(transaction=True)

stack = test_proxy.stack
service = test_proxy_ports.service
echo = test_proxy_ws.echo
_close_async_orm_connections = test_proxy._close_async_orm_connections


def agentenv(sbx_id, port=ENVD_PORT, **extra) -> dict:
    return {"x-agentenv-sandbox-id": sbx_id, "x-agentenv-target-port": str(port), **extra}


@pytest.fixture
async def api(stack):
    """The API's ASGI app as ``config.asgi`` wires it for daphne, on uvicorn in the test's
    loop, with the stack's data plane behind its ``/proxy``."""
    from config.asgi import http_app
    from dataplane.mount import ApiProxyMount

    server, task, port = await serve(ApiProxyMount(http_app, stack.proxy))
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
        yield type("Api", (), dict(client=client, port=port))
    server.should_exit = True
    await task


@pytest.fixture(params=["dataplane", "api"])
def entry(request, stack, api):
    """Both ways in to AgentENV's contract: its headers on the data plane's port, and the
    same headers at ``/proxy`` on the API's port."""
    if request.param == "dataplane":
        return type("Entry", (), dict(client=stack.client, prefix=""))
    return type("Entry", (), dict(client=api.client, prefix="/proxy"))


def _body(r) -> dict:
    assert r.headers["content-type"] == "application/json"
    return r.json()


# --------------------------------------------------------------------------- reaching a sandbox


async def test_agentenv_headers_reach_a_user_port(stack, service, entry):
    sbx = await user_sandbox(stack.up_port)
    r = await entry.client.post(entry.prefix + "/api/items?x=1", content=b"payload",
                                headers=agentenv(sbx.id, service.port, **{"x-custom": "1"}))
    assert r.status_code == 200, r.text
    seen = r.json()
    assert (seen["method"], seen["path"], seen["query"], seen["body"]) == ("POST", "/api/items", "x=1", "payload")
    names = {n for n, _ in seen["headers"]}
    assert "x-custom" in names
    assert not names & {"x-agentenv-sandbox-id", "x-agentenv-target-port", "e2b-sandbox-id", "e2b-sandbox-port"}


async def test_agentenv_headers_reach_envd(stack, entry):
    sbx = await make_sandbox(stack.up_port)
    r = await entry.client.get(entry.prefix + "/health", headers=agentenv(sbx.id))
    assert r.status_code == 204


async def test_bare_proxy_path_forwards_to_the_root(stack, service, api):
    sbx = await user_sandbox(stack.up_port)
    r = await api.client.get("/proxy", headers=agentenv(sbx.id, service.port))
    assert r.status_code == 200 and r.json()["path"] == "/"


async def test_e2b_header_names_are_aliases_at_the_api_proxy(stack, service, api):
    """AgentENV documents ``E2B_SANDBOX_URL=<api>/proxy``: the E2B names address the
    sandbox there too, under AgentENV's contract."""
    sbx = await user_sandbox(stack.up_port)
    r = await api.client.get("/proxy/page", headers=hdr(sbx, port=service.port))
    assert r.status_code == 200 and r.json()["path"] == "/page"
    r = await api.client.get("/proxy/health", headers=hdr(sbx, port=ENVD_PORT))
    assert r.status_code == 204


async def test_proxy_prefix_with_agentenv_headers_on_the_data_plane_port(stack, service):
    sbx = await user_sandbox(stack.up_port)
    r = await stack.client.get("/proxy/page?q=1", headers=agentenv(sbx.id, service.port))
    assert r.status_code == 200 and (r.json()["path"], r.json()["query"]) == ("/page", "q=1")


async def test_websocket_through_the_api_proxy(stack, echo, api):
    sbx = await user_sandbox(stack.up_port)
    url = f"ws://127.0.0.1:{api.port}/proxy/chat?room=1"
    async with connect(url, additional_headers=agentenv(sbx.id, echo.port), open_timeout=10) as ws:
        await ws.send("hello")
        assert await asyncio.wait_for(ws.recv(), 5) == "hello"
    request = echo.requests[0]
    assert request.path == "/chat?room=1" and "x-agentenv-sandbox-id" not in request.headers


async def test_header_routed_paths_the_api_has_no_route_for_reach_the_sandbox(stack, api):
    """AgentENV's ``aenv`` calls envd at the API's URL with the routing headers and no
    ``/proxy``; a real API route still wins (``/health`` is the API's)."""
    sbx = await make_sandbox(stack.up_port)
    r = await api.client.post("/process.Process/List", content=b"{}", headers=agentenv(sbx.id))
    assert r.status_code == 200 and r.json()["path"] == "/process.Process/List"
    r = await api.client.get("/files?path=/x", headers=hdr(sbx))
    assert r.status_code == 200 and (r.json()["path"], r.json()["query"]) == ("/files", "path=/x")
    r = await api.client.get("/nope", headers=agentenv("inope"))
    assert r.status_code == 404 and r.json() == {"code": 404, "message": "sandbox not found"}
    clients = len(stack.upstream.clients)
    r = await api.client.get("/health", headers=agentenv(sbx.id))
    assert r.status_code == 204 and len(stack.upstream.clients) == clients  # the API answered
    r = await api.client.get("/nope")
    assert r.status_code == 404 and r.json()["message"] != "sandbox not found"  # the API's own 404


async def test_the_deployed_api_app_serves_proxy():
    """``config.asgi.application`` (what daphne runs) sends ``/proxy`` to the data plane."""
    from config.asgi import application

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=application), base_url="http://api") as c:
        r = await c.get("/proxy/health")
    assert r.status_code == 400 and _body(r) == {"code": 400, "message": "missing sandbox routing header"}


# --------------------------------------------------------------------------- AgentENV's statuses


@pytest.mark.parametrize("path", ["/init", "/aenv/sync", "/x/../init"])
async def test_envds_node_only_routes_stay_refused_behind_the_prefix(stack, entry, path):
    sbx = await make_sandbox(stack.up_port)
    r = await entry.client.post((entry.prefix or "/proxy") + path, content=b"{}", headers=agentenv(sbx.id))
    assert r.status_code == 403 and stack.upstream.clients == []


async def test_400_without_a_sandbox_header(entry):
    r = await entry.client.get((entry.prefix or "/proxy") + "/health")
    assert r.status_code == 400 and _body(r) == {"code": 400, "message": "missing sandbox routing header"}


async def test_400_without_or_with_a_bad_target_port(stack, entry):
    sbx = await make_sandbox(stack.up_port)
    r = await entry.client.get(entry.prefix + "/health", headers={"x-agentenv-sandbox-id": sbx.id})
    assert r.status_code == 400 and _body(r)["message"] == "missing target port routing header"
    for bad in ("0", "65536", "http", "-1"):
        r = await entry.client.get(entry.prefix + "/health", headers=agentenv(sbx.id, bad))
        assert r.status_code == 400 and _body(r)["message"] == "invalid target port routing header", bad


async def test_400_for_a_malformed_sandbox_id(entry):
    r = await entry.client.get(entry.prefix + "/health", headers=agentenv("../../etc"))
    assert r.status_code == 400 and _body(r)["message"] == "invalid sandbox routing header"


@pytest.mark.parametrize("state", [None, "killed", "error"])
async def test_404_for_an_unknown_or_gone_sandbox(stack, entry, state):
    sbx_id = (await make_sandbox(stack.up_port, state=state)).id if state else "inope"
    r = await entry.client.get(entry.prefix + "/health", headers=agentenv(sbx_id))
    assert r.status_code == 404 and _body(r) == {"code": 404, "message": "sandbox not found"}


async def test_410_for_a_paused_sandbox_without_auto_resume(stack, entry, nodes_mock):
    sbx = await _paused_sandbox(stack, nodes_mock.node, auto_resume=False)
    r = await entry.client.get(entry.prefix + "/health", headers=agentenv(sbx.id))
    assert r.status_code == 410
    assert _body(r) == {"code": 410, "message": "sandbox is not proxyable in its current state (paused)"}
    nodes_mock.client.resume_sandbox.assert_not_awaited()
    assert (await sync_to_async(Sandbox.objects.get)(pk=sbx.pk)).state == "paused"


@pytest.mark.parametrize("state", ["creating", "killing"])
async def test_410_for_a_sandbox_in_passing(stack, entry, state):
    sbx = await make_sandbox(stack.up_port, state=state)
    r = await entry.client.get(entry.prefix + "/health", headers=agentenv(sbx.id))
    assert r.status_code == 410 and state in _body(r)["message"]


async def test_auto_resume_is_honoured(stack, entry, nodes_mock):
    nodes_mock.client.resume_sandbox.return_value = {
        "envd_host": "127.0.0.1", "envd_port": stack.up_port, "pid": 1, "accel": "tcg", "timings": {}}
    sbx = await _paused_sandbox(stack, nodes_mock.node, auto_resume=True)
    r = await entry.client.post(entry.prefix + "/echo", content=b"wake", headers=agentenv(sbx.id))
    assert r.status_code == 200 and r.json()["body"] == "wake"
    assert nodes_mock.client.resume_sandbox.await_count == 1
    assert (await sync_to_async(Sandbox.objects.get)(pk=sbx.pk)).state == "running"


async def test_failed_auto_resume_is_502(stack, entry, nodes_mock):
    nodes_mock.client.resume_sandbox.side_effect = nodes_mock.client.NodeTaskFailed("no memory", kind="VMError")
    sbx = await _paused_sandbox(stack, nodes_mock.node, auto_resume=True)
    r = await entry.client.get(entry.prefix + "/health", headers=agentenv(sbx.id))
    assert r.status_code == 502 and "auto-resume failed" in _body(r)["message"]


async def test_secured_envd_needs_its_access_token(stack, entry):
    sbx = await make_sandbox(stack.up_port, secure=True, token="s3cret")
    r = await entry.client.post(entry.prefix + "/process.Process/List", content=b"{}", headers=agentenv(sbx.id))
    assert r.status_code == 401 and _body(r)["code"] == 401
    r = await entry.client.post(entry.prefix + "/process.Process/List", content=b"{}",
                                headers=agentenv(sbx.id, **{"x-access-token": "wrong"}))
    assert r.status_code == 401
    r = await entry.client.post(entry.prefix + "/process.Process/List", content=b"{}",
                                headers=agentenv(sbx.id, **{"x-access-token": "s3cret"}))
    assert r.status_code == 200 and r.json()["path"] == "/process.Process/List"


async def test_secured_paused_sandbox_without_its_token_is_not_woken(stack, entry, nodes_mock):
    sbx = await _paused_sandbox(stack, nodes_mock.node, auto_resume=True)
    await sync_to_async(Sandbox.objects.filter(pk=sbx.pk).update)(secure=True, envd_access_token="s3cret")
    r = await entry.client.post(entry.prefix + "/process.Process/List", content=b"{}", headers=agentenv(sbx.id))
    assert r.status_code == 401
    nodes_mock.client.resume_sandbox.assert_not_awaited()


async def test_private_sandbox_needs_its_traffic_token(stack, service, entry):
    sbx = await user_sandbox(stack.up_port, traffic_token=TOKEN)
    r = await entry.client.get(entry.prefix + "/p", headers=agentenv(sbx.id, service.port))
    assert r.status_code == 401 and "e2b-traffic-access-token" in _body(r)["message"]
    r = await entry.client.get(entry.prefix + "/p", headers=agentenv(
        sbx.id, service.port, **{"e2b-traffic-access-token": "nope"}))
    assert r.status_code == 401
    r = await entry.client.get(entry.prefix + "/p", headers=agentenv(
        sbx.id, service.port, **{"e2b-traffic-access-token": TOKEN}))
    assert r.status_code == 200
    assert "e2b-traffic-access-token" not in {n for n, _ in r.json()["headers"]}


# --------------------------------------------------------------------------- teams


def _key_of(slug: str) -> str:
    team, _ = Team.objects.get_or_create(slug=slug, defaults={"name": slug})
    return ApiKey.generate(team)[1]


key_of = sync_to_async(_key_of)


async def test_another_teams_api_key_finds_nothing(stack, service, entry):
    sbx = await user_sandbox(stack.up_port)  # team "t"
    stranger = await key_of("someone-else")
    r = await entry.client.get(entry.prefix + "/p", headers=agentenv(sbx.id, service.port, **{"x-api-key": stranger}))
    unknown = await entry.client.get(entry.prefix + "/p", headers=agentenv("inope", service.port,
                                                                          **{"x-api-key": stranger}))
    assert (r.status_code, r.json()) == (unknown.status_code, unknown.json()) == (
        404, {"code": 404, "message": "sandbox not found"})


async def test_own_api_key_is_not_forwarded_and_foreign_values_are(stack, service, entry):
    sbx = await user_sandbox(stack.up_port)
    own = await key_of("t")
    r = await entry.client.get(entry.prefix + "/p", headers=agentenv(sbx.id, service.port, **{"x-api-key": own}))
    assert r.status_code == 200 and "x-api-key" not in {n for n, _ in r.json()["headers"]}
    r = await entry.client.get(entry.prefix + "/p", headers=agentenv(sbx.id, service.port,
                                                                     **{"x-api-key": "the-apps-own-key"}))
    assert r.status_code == 200 and ["x-api-key", "the-apps-own-key"] in r.json()["headers"]


async def test_another_teams_api_key_finds_nothing_with_e2b_headers(stack):
    sbx = await make_sandbox(stack.up_port)
    stranger = await key_of("someone-else")
    r = await stack.client.get("/health", headers=hdr(sbx, **{"x-api-key": stranger}))
    assert r.status_code == 502 and r.json()["message"] == "The sandbox was not found"


# --------------------------------------------------------------------------- E2B's contract, unchanged


async def test_e2b_headers_keep_e2bs_statuses(stack, service, nodes_mock):
    r = await stack.client.get("/health", headers={"E2b-Sandbox-Id": "inope", "E2b-Sandbox-Port": "49983"})
    assert (r.status_code, r.json()) == (502, {"sandboxId": "inope", "message": "The sandbox was not found",
                                               "code": 502})
    paused = await _paused_sandbox(stack, nodes_mock.node, auto_resume=False)
    r = await stack.client.get("/health", headers=hdr(paused))
    assert r.status_code == 502 and r.json()["message"] == "The sandbox was not found"
    private = await user_sandbox(stack.up_port, traffic_token=TOKEN)
    r = await stack.client.get("/p", headers=hdr(private, port=service.port))
    assert r.status_code == 403
    r = await stack.client.get("/health")
    assert r.status_code == 400 and "E2b-Sandbox-Id" in r.json()["message"]


async def test_e2b_headers_default_to_envds_port_and_keep_a_proxy_path(stack, service):
    sbx = await user_sandbox(stack.up_port)
    r = await stack.client.get("/health", headers={"E2b-Sandbox-Id": sbx.id})
    assert r.status_code == 204
    r = await stack.client.get("/proxy/page", headers=hdr(sbx, port=service.port))
    assert r.status_code == 200 and r.json()["path"] == "/proxy/page"  # a guest path like any other


async def test_host_routing_keeps_e2bs_semantics(stack, service):
    sbx = await user_sandbox(stack.up_port)
    r = await stack.client.get("/proxy/page", headers={"host": f"{service.port}-{sbx.id}.sbx.example.test"})
    assert r.status_code == 200 and r.json()["path"] == "/proxy/page"
    r = await stack.client.get("/x", headers={"host": "49983-inope.sbx.example.test"})
    assert r.status_code == 502 and r.json()["message"] == "The sandbox was not found"
