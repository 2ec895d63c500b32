"""A client that goes away mid-transition, as a real server tells Django (``http.disconnect``
on the ASGI receive): the transition still ends (its shielded task), and its ORM calls after the
request ended must not run on a thread nothing ends. They did: asgiref gave the ended request's
context a new thread whose connection nobody closed, one pooled PostgreSQL connection lost per
such client until the API's pool ran dry (lifecycle.own_thread). On
PostgreSQL the autouse check of tests/unit/conftest.py catches the held connection; everywhere,
the left-over thread context.

The transition is shielded from its first state write on: a client gone right after that write
(while the placement's claim or the move to ``pausing`` is in its thread) used to leave the
sandbox in that state, its node's room reserved, with nothing to finish it."""
import asyncio
import gc
import threading

import pytest
from asgiref.sync import SyncToAsync, sync_to_async

from sandboxes.models import Sandbox

pytestmark = pytest.mark.django_db(transaction=True)


def _request(asgi_app, raw_key: str, path: str, body: bytes = b""):
    """A POST through the ASGI app whose client goes away once ``gone`` is set:
    (the app's task, gone, the messages sent)."""
    gone, sent, body_sent = asyncio.Event(), [], []

    async def receive():
        if not body_sent:
            body_sent.append(True)
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    headers = [(b"host", b"testserver"), (b"x-api-key", raw_key.encode())]
    if body:
        headers.append((b"content-type", b"application/json"))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": b"", "query_string": b"", "root_path": "",
             "headers": headers, "client": ("127.0.0.1", 1), "server": ("testserver", 80)}
    return asyncio.ensure_future(asgi_app(scope, receive, send)), gone, sent


def _slow_claim(nodes_mock) -> tuple[threading.Event, threading.Event]:
    """The placement makes its claim, then holds its transaction open until released:
    (claimed, release)."""
    claimed, release = threading.Event(), threading.Event()

    async def place(cpu_count, memory_mb, *, on=None, prefer=None, claim=None):
        def slow(node):
            claim(node)
            claimed.set()
            release.wait(10)
        await sync_to_async(slow)(nodes_mock.node)
        return nodes_mock.node

    nodes_mock.placement.place.side_effect = place
    return claimed, release


async def _leave_at(app, gone, reached: threading.Event, release: threading.Event, sent) -> None:
    """Once ``reached``, the client goes away; then the held step goes on."""
    assert await asyncio.to_thread(reached.wait, 10), sent
    gone.set()
    await asyncio.wait_for(app, 5)
    release.set()


async def _state_after(sandbox_id: str, leaving: str) -> str:
    for _ in range(100):
        state = (await Sandbox.objects.aget(pk=sandbox_id)).state
        if state != leaving:
            return state
        await asyncio.sleep(0.05)
    return leaving


async def test_a_pause_whose_client_went_away_ends_and_leaves_no_thread_or_connection(asgi_app, raw_key, create, nodes_mock):
    sb = await create()
    gate = asyncio.Event()

    async def slow_pause(*args, **kwargs):
        await gate.wait()
        return {"timings": {}, "paused": True}

    nodes_mock.client.pause_sandbox.side_effect = slow_pause
    gc.collect()  # a context an earlier test left to the collector must not count (it goes at the first collect)
    contexts_before = len(SyncToAsync.context_to_thread_executor)
    app, gone, sent = _request(asgi_app, raw_key, f"/sandboxes/{sb['sandboxID']}/pause")
    for _ in range(100):
        if (await Sandbox.objects.aget(pk=sb["sandboxID"])).state == "pausing":
            break
        await asyncio.sleep(0.02)
    gone.set()
    await asyncio.wait_for(app, 5)
    gate.set()
    assert await _state_after(sb["sandboxID"], "pausing") == "paused"  # the transition ended
    assert not [m for m in sent if m["type"] == "http.response.start"]  # nobody left to answer
    # the shielded task holds the ended request's context until it has finished, a moment after
    # its last write: then no thread may be left to it
    for _ in range(100):
        gc.collect()
        if len(SyncToAsync.context_to_thread_executor) == contexts_before:
            break
        await asyncio.sleep(0.05)
    assert len(SyncToAsync.context_to_thread_executor) == contexts_before, "a thread left to a context that ended"


async def test_a_create_whose_client_went_away_while_it_was_placed_still_boots(asgi_app, raw_key, nodes_mock,
                                                                               base_template):
    """The client goes away while the placement is inserting the create's row: the create goes
    on and ends ``running``; no row is left in ``creating`` with its node's room reserved and
    nothing to boot it."""
    claimed, release = _slow_claim(nodes_mock)
    app, gone, sent = _request(asgi_app, raw_key, "/sandboxes", b'{"templateID": "base"}')
    await _leave_at(app, gone, claimed, release, sent)
    sandbox_id = (await Sandbox.objects.aget()).pk
    assert await _state_after(sandbox_id, "creating") == "running"  # booted although nobody is left to answer
    assert nodes_mock.client.boot_sandbox.await_count == 1
    assert not [m for m in sent if m["type"] == "http.response.start"]


async def test_a_resume_whose_client_went_away_while_it_was_claimed_still_resumes(asgi_app, raw_key, api, create,
                                                                                   nodes_mock):
    """The client goes away while the placement's claim moves the sandbox to ``resuming``: the
    resume goes on and ends ``running``, never left ``resuming`` with its node's room reserved
    and nothing resuming it."""
    sb = await create()
    assert (await api.post(f"/sandboxes/{sb['sandboxID']}/pause", json={})).status_code == 204
    claimed, release = _slow_claim(nodes_mock)
    app, gone, sent = _request(asgi_app, raw_key, f"/sandboxes/{sb['sandboxID']}/connect", b'{"timeout": 60}')
    await _leave_at(app, gone, claimed, release, sent)
    assert await _state_after(sb["sandboxID"], "resuming") == "running"
    assert nodes_mock.client.resume_sandbox.await_count == 1
    assert not [m for m in sent if m["type"] == "http.response.start"]


async def test_a_pause_whose_client_went_away_as_it_began_still_pauses(asgi_app, raw_key, create, nodes_mock,
                                                                       monkeypatch):
    """The client goes away right after the move to ``pausing`` was written: the pause goes on
    and ends ``paused``, never left ``pausing`` with nothing pausing it."""
    from lifecycle.sandboxes import core

    sb = await create()
    moved, release = threading.Event(), threading.Event()
    real_transition = core.transition

    async def transition(*args, **kwargs):
        done = await real_transition(*args, **kwargs)
        moved.set()
        await asyncio.to_thread(release.wait, 10)  # where the request was cancelled, before the shield
        return done

    monkeypatch.setattr(core, "transition", transition)
    app, gone, sent = _request(asgi_app, raw_key, f"/sandboxes/{sb['sandboxID']}/pause")
    await _leave_at(app, gone, moved, release, sent)
    assert await _state_after(sb["sandboxID"], "pausing") == "paused"
    assert nodes_mock.client.pause_sandbox.await_count == 1
