"""Raw HTTP checks of the status codes and JSON error bodies on both planes."""

import httpx
import pytest

from envd import ENVD_PORT

from harness.stack import running_stack


def assert_error(resp: httpx.Response, status: int, text: str | None = None) -> dict:
    assert resp.status_code == status, (resp.status_code, resp.text)
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert isinstance(body["code"], int) and isinstance(body["message"], str) and body["message"]
    if text:
        assert text.lower() in body["message"].lower(), body
    return body


def test_api_auth_errors(stack):
    url = f"{stack.api_url}/v2/sandboxes"
    assert_error(httpx.get(url), 401)
    assert_error(httpx.get(url, headers={"X-API-Key": "e2b_" + "0" * 40}), 401)
    assert httpx.get(url, headers=stack.headers()).status_code == 200


def test_api_bad_input(stack):
    h = {**stack.headers(), "Content-Type": "application/json"}
    assert_error(httpx.post(f"{stack.api_url}/v2/sandboxes", content=b"{not json", headers=h), 400)
    assert_error(httpx.post(f"{stack.api_url}/v2/sandboxes", content=b"[1,2]", headers=h), 400)
    assert_error(httpx.post(f"{stack.api_url}/v2/sandboxes", json={"templateID": 5}, headers=h), 400)
    assert_error(httpx.post(f"{stack.api_url}/sandboxes", json={"templateID": "base", "timeout": "x"}, headers=h), 400)
    assert_error(httpx.post(f"{stack.api_url}/sandboxes", json={"templateID": "base", "metadata": {"a": 1}}, headers=h), 400)
    unknown = httpx.post(f"{stack.api_url}/v2/sandboxes", json={"templateID": "no-such-template"}, headers=h)
    assert unknown.status_code in (400, 404)
    assert_error(unknown, unknown.status_code, "no-such-template")
    assert_error(httpx.get(f"{stack.api_url}/v2/sandboxes?limit=0", headers=h), 400)
    assert_error(httpx.get(f"{stack.api_url}/v2/sandboxes?nextToken=garbage", headers=h), 400)


def test_api_health_is_204_without_a_body(stack):
    resp = httpx.get(f"{stack.api_url}/health")
    assert resp.status_code == 204 and resp.content == b""


def test_api_chunked_bodies_through_daphne(stack):
    """Node's fetch (the TS SDK) sends JSON with Transfer-Encoding: chunked and no length."""
    def chunked(data: bytes, n: int = 5):
        yield from (data[i:i + n] for i in range(0, len(data), n))

    h = {**stack.headers(), "Content-Type": "application/json"}
    body = b'{"templateID": "no-such-template", "metadata": {"a": "b"}}'
    # the body was read: the template it names is refused (a lost body says "templateID: required")
    assert_error(httpx.post(f"{stack.api_url}/v2/sandboxes", content=chunked(body), headers=h), 400,
                 "no-such-template")
    assert_error(httpx.post(f"{stack.api_url}/sandboxes/inope/timeout", content=chunked(b'{"timeout": 5}'),
                            headers=h), 404)
    big = b'{"templateID": "base", "metadata": {"a": "' + b"x" * 3_000_000 + b'"}}'
    assert_error(httpx.post(f"{stack.api_url}/v2/sandboxes", content=chunked(big, 65536), headers=h), 413)
    assert_error(httpx.post(f"{stack.api_url}/v2/sandboxes", content=big, headers=h), 413)


def test_api_unknown_sandbox(stack):
    h = stack.headers()
    assert_error(httpx.get(f"{stack.api_url}/sandboxes/inope", headers=h), 404)
    assert_error(httpx.delete(f"{stack.api_url}/sandboxes/inope", headers=h), 404)
    assert_error(httpx.post(f"{stack.api_url}/sandboxes/inope/timeout", json={"timeout": 5}, headers=h), 404)


def test_dataplane_unknown_sandbox_is_502_not_found(stack):
    for path in ("/health", "/files?path=/etc/hostname"):
        resp = httpx.get(f"{stack.sandbox_url}{path}", headers={"E2b-Sandbox-Id": "inope", "E2b-Sandbox-Port": str(ENVD_PORT)})
        assert_error(resp, 502, "was not found")
    resp = httpx.post(
        f"{stack.sandbox_url}/process.Process/List",
        headers={"E2b-Sandbox-Id": "inope", "E2b-Sandbox-Port": str(ENVD_PORT), "Content-Type": "application/json"},
        content=b"{}",
    )
    assert_error(resp, 502, "was not found")
    assert httpx.get(f"{stack.sandbox_url}/health").status_code == 400


@pytest.mark.vm
def test_files_bad_requests_through_the_data_plane(stack):
    h = {**stack.headers(), "Content-Type": "application/json"}
    created = httpx.post(f"{stack.api_url}/v2/sandboxes", json={"templateID": "base"}, headers=h, timeout=300)
    assert created.status_code == 201, created.text
    sid = created.json()["sandboxID"]
    token = created.json()["envdAccessToken"]
    route = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(ENVD_PORT)}
    try:
        assert_error(httpx.get(f"{stack.sandbox_url}/files?path=/etc/hostname", headers=route), 401)
        route["X-Access-Token"] = token
        assert httpx.get(f"{stack.sandbox_url}/health", headers=route).status_code == 204
        assert_error(httpx.get(f"{stack.sandbox_url}/files", headers=route), 400)
        assert_error(httpx.get(f"{stack.sandbox_url}/files?path=/home/user", headers=route), 400)
        assert_error(httpx.get(f"{stack.sandbox_url}/files?path=/nope/x", headers=route), 404)
        assert_error(httpx.get(f"{stack.sandbox_url}/files?path=x&username=mallory", headers=route), 401)
        # a traversal to a file `user` may not read is refused, not served and not a 500
        resp = httpx.get(f"{stack.sandbox_url}/files?path=../../etc/shadow", headers=route)
        assert 400 <= resp.status_code < 500, resp.status_code
        assert_error(resp, resp.status_code)
        # root may read it: the path resolves against the home, like E2B
        assert httpx.get(f"{stack.sandbox_url}/files?path=../../etc/hostname&username=root", headers=route).status_code == 200
    finally:
        assert httpx.delete(f"{stack.api_url}/sandboxes/{sid}", headers=h, timeout=120).status_code == 204
    assert_error(httpx.get(f"{stack.sandbox_url}/health", headers=route), 502, "was not found")
    assert_error(httpx.delete(f"{stack.api_url}/sandboxes/{sid}", headers=h), 404)


def test_no_alive_node_gives_clear_error_fast():
    """A stack without any node worker: create answers 503 JSON at once, never hangs."""
    with running_stack("nonode", with_node=False, extra_env={"AENV_NODE_TASK_DEADLINE": "3"}) as s:
        h = {**s.headers(), "Content-Type": "application/json"}
        resp = httpx.post(f"{s.api_url}/v2/sandboxes", json={"templateID": "base"}, headers=h, timeout=30)
        assert_error(resp, 503, "node")
        # a node that is registered and "alive" but whose worker never answers: deadline → 504
        s.manage("shell", "-c", (
            "from django.utils import timezone; from nodes.models import Node; "
            "Node.objects.create(id='ghost', address='127.0.0.1', vcpu_capacity=64, memory_mb_capacity=65536, "
            "last_heartbeat_at=timezone.now() + timezone.timedelta(minutes=5))"
        ))
        resp = httpx.post(f"{s.api_url}/v2/sandboxes", json={"templateID": "base"}, headers=h, timeout=30)
        assert_error(resp, 504)
        listed = httpx.get(f"{s.api_url}/v2/sandboxes", headers=h).json()
        assert listed == [], "a failed create must not show up as a live sandbox"
