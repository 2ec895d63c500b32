"""The wire itself, with a plain HTTP client: status codes and bodies of bad requests,
the NDJSON stream (one ASCII-only object per line, headers before the cell ends,
keepalives, ``end_of_execution`` last), query strings ignored, ``/health``."""
from __future__ import annotations

import json
import time

import httpx
import pytest


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def lines(response: httpx.Response) -> list[dict]:
    raw = response.content
    assert raw.endswith(b"\n") and b"\n\n" not in raw
    assert all(b < 0x80 for b in raw), "every line is ASCII-only JSON"
    return [json.loads(line) for line in raw.split(b"\n")[:-1]]


def test_health(client):
    r = client.get("/health")
    assert (r.status_code, r.json()) == (200, "OK")


def test_stream_of_a_simple_cell(client):
    r = client.post("/execute", json={"code": "print('é'); 6 * 7", "context_id": None, "language": None,
                                      "env_vars": None})
    assert r.status_code == 200
    events = lines(r)
    assert [e["type"] for e in events] == ["number_of_executions", "stdout", "result", "end_of_execution"]
    assert events[1]["text"] == "é\n" and events[1]["timestamp"]
    assert events[2] == {"type": "result", "is_main_result": True, "text": "42", "extra": {}}


def test_headers_come_before_the_cell_ends_and_keepalives_fill_the_silence(client):
    t0 = time.monotonic()
    with client.stream("POST", "/execute?source=js-sdk", json={"code": "import time; time.sleep(5); 'done'"}) as r:
        headers_at = time.monotonic() - t0
        events = [json.loads(line) for line in r.iter_lines()]
    assert r.status_code == 200 and headers_at < 2
    kinds = [e["type"] for e in events]
    assert kinds.count("keepalive") >= 1 and kinds[-1] == "end_of_execution"
    assert [e for e in events if e["type"] == "result"][0]["text"] == "done"


@pytest.mark.parametrize("body, status, text", [
    ({"code": "1", "context_id": "x", "language": "python"}, 400, "Only one of context_id or language"),
    ({"code": 1}, 422, "code"),
    ({}, 422, "code"),
    ({"code": "1", "language": 3}, 422, "language"),
    ({"code": "1", "env_vars": {"A": 1}}, 422, "env_vars"),
    ({"code": "1", "context_id": "missing"}, 404, "Context missing not found"),
    ({"code": "1", "language": "cobol"}, 500, "Failed to create context"),
])
def test_bad_execute_requests(client, body, status, text):
    r = client.post("/execute", json=body)
    assert r.status_code == status and text in r.text, r.text


def test_not_json(client):
    assert client.post("/execute", content=b"{nope").status_code == 422
    assert client.post("/contexts", content=b"[1]").status_code == 422


def test_contexts_routes(client, server):
    made = client.post("/contexts", content=b"")  # the JS SDK may send {} or nothing
    assert made.status_code == 200 and set(made.json()) == {"id", "language", "cwd"}
    assert made.json()["language"] == "python" and made.json()["cwd"] == str(server.cwd)
    js = client.post("/contexts?source=x", json={"language": " JS "}).json()
    assert js["language"] == "javascript"
    ids = [c["id"] for c in client.get("/contexts").json()]
    assert ids[-2:] == [made.json()["id"], js["id"]]
    assert client.post(f"/contexts/{js['id']}/restart").status_code == 200
    assert client.delete(f"/contexts/{js['id']}").status_code == 200
    assert client.delete(f"/contexts/{js['id']}").status_code == 404
    assert client.post("/contexts/nope/restart").status_code == 404
    assert client.post("/contexts", json={"cwd": "/no/such/dir"}).status_code == 500


def test_a_language_default_is_made_on_first_use_and_after_removal(client):
    first = lines(client.post("/execute", json={"code": "echo one", "language": "bash"}))
    assert [e["text"] for e in first if e["type"] == "stdout"] == ["one\n"]
    bash = [c for c in client.get("/contexts").json() if c["language"] == "bash"]
    client.delete(f"/contexts/{bash[0]['id']}")
    again = lines(client.post("/execute", json={"code": "echo two", "language": "bash"}))
    assert [e["text"] for e in again if e["type"] == "stdout"] == ["two\n"]
