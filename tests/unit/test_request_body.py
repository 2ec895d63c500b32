"""Request bodies without a Content-Length (Transfer-Encoding: chunked, as Node's fetch
and so the TypeScript SDK sends them) reach every view whole; one size limit for both
framings (413), and a body that cannot be read is an error, never an empty default."""
import json
from unittest import mock

import pytest

from config.request_body import BoundedRequestBody
from sandboxes.models import Sandbox

pytestmark = pytest.mark.django_db(transaction=True)


def chunked(payload, piece: int = 7):
    """An httpx body without a length: httpx sends it as several ASGI messages with
    Transfer-Encoding: chunked and no Content-Length, like Node's fetch."""
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()

    async def gen():
        for i in range(0, len(data), piece):
            yield data[i:i + piece]

    return gen()


JSON = {"content-type": "application/json"}


async def test_chunked_create_keeps_template_metadata_and_timeout(api, nodes_mock):
    resp = await api.post("/v2/sandboxes", headers=JSON,
                          content=chunked({"templateID": "base", "metadata": {"who": "ts"}, "timeout": 77}))
    assert resp.status_code == 201, resp.text
    row = await Sandbox.objects.aget(pk=resp.json()["sandboxID"])
    assert row.metadata == {"who": "ts"}
    assert 70 <= (row.end_at - row.started_at).total_seconds() <= 78


async def test_chunked_set_timeout(api, create):
    sid = (await create(timeout=600))["sandboxID"]
    resp = await api.post(f"/sandboxes/{sid}/timeout", headers=JSON, content=chunked({"timeout": 30}))
    assert resp.status_code == 204, resp.text
    row = await Sandbox.objects.aget(pk=sid)
    assert (row.end_at - row.started_at).total_seconds() < 600 - 60


async def test_chunked_fork_count_is_not_lost(api, create, nodes_mock):
    async def fork(node, *, sandbox_id, env_vars, access_token, children, deadline=None):
        return {"parent": {"ok": True}, "timings": {},
                "children": [{"sandbox_id": c["sandbox_id"], "ok": True, "envd_host": "127.0.0.1",
                              "envd_port": 41000 + i, "pid": 1, "accel": "tcg"} for i, c in enumerate(children)]}

    nodes_mock.client.fork_sandbox = mock.AsyncMock(side_effect=fork)
    sid = (await create())["sandboxID"]
    resp = await api.post(f"/sandboxes/{sid}/fork", headers=JSON, content=chunked({"count": 2}))
    assert resp.status_code == 201, resp.text
    assert len(resp.json()) == 2
    assert len(nodes_mock.client.fork_sandbox.await_args.kwargs["children"]) == 2


async def test_chunked_malformed_json_is_400_not_a_default(api, nodes_mock, assert_error):
    assert_error(await api.post("/v2/sandboxes", headers=JSON, content=chunked(b'{"templateID": "ba')), 400)
    assert nodes_mock.client.boot_sandbox.await_count == 0


@pytest.mark.parametrize("framing", ["chunked", "length"])
async def test_body_over_the_limit_is_413_either_way(api, nodes_mock, assert_error, settings, framing):
    settings.AENV_API_MAX_BODY_BYTES = 1000
    body = json.dumps({"templateID": "base", "metadata": {"pad": "x" * 2000}}).encode()
    content = chunked(body, piece=300) if framing == "chunked" else body
    assert_error(await api.post("/v2/sandboxes", headers=JSON, content=content), 413, "limit of 1000 bytes")
    assert nodes_mock.client.boot_sandbox.await_count == 0
    # just under the limit still works, whatever the framing
    ok = json.dumps({"templateID": "base", "metadata": {"pad": "x" * 900}}).encode()
    resp = await api.post("/v2/sandboxes", headers=JSON, content=chunked(ok, 300) if framing == "chunked" else ok)
    assert resp.status_code == 201, resp.text


async def test_dashboard_sign_in_posted_chunked(asgi_app, user):
    """The dashboard's forms see a chunked body's fields: signing in works (a lost body
    would re-show the form with 'this field is required')."""
    import httpx  # noqa: PLC0415

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi_app), base_url="http://testserver") as c:
        await c.get("/dashboard/login/")
        form = f"csrfmiddlewaretoken={c.cookies['csrftoken']}&username=alice&password=pw-alice-123".encode()
        r = await c.post("/dashboard/login/", content=chunked(form),
                         headers={"content-type": "application/x-www-form-urlencoded",
                                  "referer": "http://testserver/dashboard/login/"})
    assert r.status_code == 302 and r.headers["location"].startswith("/dashboard/"), r.text[:300]


# The middleware alone, with hand-made ASGI messages.

async def _run(app_mw, headers, messages):
    seen, sent = {}, []
    queue = list(messages)

    async def app(scope, receive, send):
        seen["headers"] = dict(scope["headers"])
        seen["body"] = (await receive())["body"]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def receive():
        return queue.pop(0) if queue else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/x", "headers": headers}
    await app_mw(app)(scope, receive, send)
    return seen, sent


async def test_middleware_replays_chunked_body_with_a_length():
    seen, sent = await _run(lambda app: BoundedRequestBody(app, max_bytes=100),
                            [(b"transfer-encoding", b"chunked")],
                            [{"type": "http.request", "body": b"ab", "more_body": True},
                             {"type": "http.request", "body": b"cd", "more_body": False}])
    assert seen["body"] == b"abcd"
    assert seen["headers"] == {b"content-length": b"4"}
    assert sent[0]["status"] == 200


async def test_middleware_client_gone_mid_body_runs_nothing():
    seen, sent = await _run(lambda app: BoundedRequestBody(app, max_bytes=100),
                            [(b"transfer-encoding", b"chunked")],
                            [{"type": "http.request", "body": b"ab", "more_body": True}])
    assert seen == {} and sent == []


@pytest.mark.parametrize("value", [b"-1", b"abc", b"1e3"])
async def test_middleware_bad_content_length_is_400(value):
    seen, sent = await _run(lambda app: BoundedRequestBody(app, max_bytes=100), [(b"content-length", value)], [])
    assert seen == {} and sent[0]["status"] == 400
    assert json.loads(sent[1]["body"])["code"] == 400


async def test_middleware_conflicting_content_lengths_are_400():
    seen, sent = await _run(lambda app: BoundedRequestBody(app, max_bytes=100),
                            [(b"content-length", b"3"), (b"content-length", b"4")], [])
    assert seen == {} and sent[0]["status"] == 400
