"""envd's /init answers before it steps the clock and credits the entropy seed (the slow part
in a guest just restored under TCG), and does both before the handler returns: nothing else
runs on envd's event loop meanwhile, so every later envd call sees the new clock and seed."""
import base64
import json
import os

import pytest

from envd import app as envd_app
from envd.app import EnvdApp
from envd.state import Settings


async def call_init(app, body: dict, events: list):
    messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        events.append(("send", message["type"], message.get("status")))

    scope = {"type": "http", "method": "POST", "path": "/init", "headers": [(b"content-type", b"application/json")],
             "query_string": b""}
    await app(scope, receive, send)
    events.append(("returned",))


@pytest.mark.asyncio
async def test_the_answer_goes_first_and_the_clock_and_seed_follow_before_the_handler_returns(tmp_path, monkeypatch):
    events = []
    monkeypatch.setattr(envd_app, "maybe_set_clock", lambda ts, mode: events.append(("clock", ts)))
    monkeypatch.setattr(envd_app, "credit", lambda seed, mode: events.append(("credit", len(seed))))
    settings = Settings(template_file=str(tmp_path / "none.json"))
    await call_init(EnvdApp(settings), {"timestamp": "2026-12-02T12:00:00Z", "envVars": {"A": "1"},
                                        "entropySeed": base64.b64encode(os.urandom(64)).decode()}, events)
    assert events == [("send", "http.response.start", 204), ("send", "http.response.body", None),
                      ("clock", "2026-12-02T12:00:00Z"), ("credit", 64), ("returned",)]
    assert settings.env() == {"A": "1"}  # what a later call reads was set before the answer


@pytest.mark.asyncio
async def test_a_bad_seed_is_refused_before_anything_changes(tmp_path, monkeypatch):
    events = []
    monkeypatch.setattr(envd_app, "maybe_set_clock", lambda ts, mode: events.append(("clock", ts)))
    settings = Settings(template_file=str(tmp_path / "none.json"))
    await call_init(EnvdApp(settings), {"timestamp": "2026-12-02T12:00:00Z", "envVars": {"A": "1"},
                                        "entropySeed": "not base64!"}, events)
    assert events[0] == ("send", "http.response.start", 400)
    assert ("clock", "2026-12-02T12:00:00Z") not in events and settings.env() == {}
