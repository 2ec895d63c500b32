"""A client that goes away mid-transition, as a real server tells Django (``http.disconnect``
on the ASGI receive): the transition still ends (its shielded task), and its ORM calls after the
request ended must not run on a thread nothing ends. They did: asgiref gave the ended request's
context a new thread whose connection nobody closed, one pooled PostgreSQL connection lost per
such client until the API's pool ran dry (lifecycle.own_thread). On
PostgreSQL the autouse check of tests/unit/conftest.py catches the held connection; everywhere,
the left-over thread context."""
import asyncio

import pytest
from asgiref.sync import SyncToAsync

from sandboxes.models import Sandbox

pytestmark = pytest.mark.django_db(transaction=True)


async def test_a_pause_whose_client_went_away_ends_and_leaves_no_thread_or_connection(asgi_app, raw_key, create, nodes_mock):
    sb = await create()
    gate, gone = asyncio.Event(), asyncio.Event()

    async def slow_pause(*args, **kwargs):
        await gate.wait()
        return {"timings": {}, "paused": True}

    nodes_mock.client.pause_sandbox.side_effect = slow_pause
    sent = []
    body_sent = False

    async def receive():
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": f"/sandboxes/{sb['sandboxID']}/pause", "raw_path": b"", "query_string": b"",
             "root_path": "", "headers": [(b"host", b"testserver"), (b"x-api-key", raw_key.encode())],
             "client": ("127.0.0.1", 1), "server": ("testserver", 80)}
    contexts_before = len(SyncToAsync.context_to_thread_executor)
    app = asyncio.ensure_future(asgi_app(scope, receive, send))
    for _ in range(100):
        if (await Sandbox.objects.aget(pk=sb["sandboxID"])).state == "pausing":
            break
        await asyncio.sleep(0.02)
    gone.set()
    await asyncio.wait_for(app, 5)
    gate.set()
    for _ in range(100):
        if (await Sandbox.objects.aget(pk=sb["sandboxID"])).state != "pausing":
            break
        await asyncio.sleep(0.05)
    assert (await Sandbox.objects.aget(pk=sb["sandboxID"])).state == "paused"  # the transition ended
    assert not [m for m in sent if m["type"] == "http.response.start"]  # nobody left to answer
    assert len(SyncToAsync.context_to_thread_executor) == contexts_before, "a thread left to a context that ended"
