"""Webhooks end to end on the shared stack: a webhook registered through the API, a real
sandbox created and killed, and both lifecycle events POSTed by the events worker
(``manage.py run_events_worker`` on the stack's own queue, handed out by the sweeper) to a
receiver on 127.0.0.1, each signed with the HMAC of its exact body under the webhook's secret;
the delivery history the API serves says the same. One sandbox, no command run in it."""
import json
import time
import uuid

import httpx
import pytest
from e2b import Sandbox

from events.signing import verify
from tests.unit.test_webhook_delivery import Receiver

pytestmark = pytest.mark.vm

CREATED, KILLED = "sandbox.lifecycle.created", "sandbox.lifecycle.killed"


def _bodies_for(rx: Receiver, sandbox_id: str) -> list[dict]:
    """What the receiver got about one sandbox (the team's other sandboxes may report too)."""
    return [got for got in list(rx.got) if json.loads(got["body"]).get("sandboxId") == sandbox_id]


def test_create_and_kill_are_delivered_signed(stack, sdk_env):
    assert stack.events_alive(), stack.log("events")
    rx = Receiver()
    secret = "e2e-webhook-secret-" + uuid.uuid4().hex
    api = httpx.Client(base_url=stack.api_url, headers=stack.headers(), timeout=30)
    hook = api.post("/events/webhooks", json={"name": "e2e", "url": rx.url, "events": [CREATED, KILLED],
                                              "signatureSecret": secret})
    assert hook.status_code == 201, hook.text
    hook_id = hook.json()["id"]
    try:
        sbx = Sandbox.create(timeout=120)
        sbx.kill()
        deadline = time.monotonic() + 90  # the sweeper's tick (1 s) + the worker's attempt
        while len(_bodies_for(rx, sbx.sandbox_id)) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        got = _bodies_for(rx, sbx.sandbox_id)
        assert sorted(json.loads(g["body"])["type"] for g in got) == [CREATED, KILLED], (
            got, stack.log("events"), stack.log("lifecycle"))
        for delivered in got:
            headers = delivered["headers"]
            assert verify(secret, delivered["body"], headers["aenv-signature"])
            assert not verify(secret, delivered["body"] + b" ", headers["aenv-signature"])
            assert not verify("another-secret-0123456789", delivered["body"], headers["aenv-signature"])
            assert headers["e2b-webhook-id"] == hook_id and delivered["path"] == "/hook?x=1"
            body = json.loads(delivered["body"])
            assert body["sandboxTeamId"] and body["sandboxTemplateId"] == "base"
        assert secret not in json.dumps([g["headers"] for g in got])  # the secret itself never travels

        mine = {}
        while time.monotonic() < deadline:  # recorded once the receiver's answer is read
            history = api.get(f"/events/webhooks/{hook_id}/deliveries", params={"limit": 100}).json()["data"]
            mine = {d["eventType"]: d for d in history if d["sandboxId"] == sbx.sandbox_id}
            if [d["status"] for d in mine.values()] == ["success", "success"]:
                break
            time.sleep(0.5)
        assert set(mine) == {CREATED, KILLED}
        assert all(d["status"] == "success" and d["attempts"][0]["responseHttpStatusCode"] == 200
                   for d in mine.values()), mine
    finally:
        api.delete(f"/events/webhooks/{hook_id}")
        api.close()
        rx.close()
