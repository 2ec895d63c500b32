"""Signed file URLs that name no sandbox (``E2B_SANDBOX_URL``): finding their signer costs
O(1) per request beyond a fixed hash budget, never blocks the event loop, and reads the
database a bounded number of times (``dataplane.signers``). The data plane and an
envd stand-in on uvicorn (the fixtures of test_proxy)."""
import asyncio
import secrets
import threading

import pytest
from asgiref.sync import sync_to_async
from django.db.backends import utils as db_utils

from dataplane import access as proxy_access
from tests.unit import test_proxy
from tests.unit.test_proxy import _make_sandbox, _signed_url

pytestmark = pytest.mark.django_db(transaction=True)

stack = test_proxy.stack
_close_async_orm_connections = test_proxy._close_async_orm_connections

SECURED = 40
FLOOD = 120


@pytest.fixture
def counters(monkeypatch):
    """Counts the signature hashes (on the event loop's thread and elsewhere) and the
    database queries made from here on."""
    seen = {"loop_hashes": 0, "thread_hashes": 0, "queries": 0}
    loop_thread = threading.main_thread()
    real_sign, real_execute = proxy_access.make_signature, db_utils.CursorWrapper._execute

    def make_signature(*args, **kwargs):
        seen["loop_hashes" if threading.current_thread() is loop_thread else "thread_hashes"] += 1
        return real_sign(*args, **kwargs)

    def execute(self, *args, **kwargs):
        seen["queries"] += 1
        return real_execute(self, *args, **kwargs)

    monkeypatch.setattr(proxy_access, "make_signature", make_signature)
    monkeypatch.setattr(db_utils.CursorWrapper, "_execute", execute)
    return seen


def _secured(stack, count):
    return [_make_sandbox(stack.up_port, secure=True, token=f"tok-{i}") for i in range(count)]


async def test_a_flood_of_random_signatures_costs_o1_per_request(settings, stack, counters):
    settings.AENV_SIGNED_URL_SCAN_RATE = 100  # hashes a second: two scans of 40 sandboxes
    stack.proxy.__init__()  # picks the setting up (the fixture made it before the test ran)
    await sync_to_async(_secured)(stack, SECURED)
    counters.update(loop_hashes=0, thread_hashes=0, queries=0)

    async def forged():
        r = await stack.client.get(f"/files?path=%2Fa&signature=v1_{secrets.token_urlsafe(32)}")
        return r.status_code, r.json()

    started = asyncio.get_running_loop().time()
    answers = await asyncio.gather(*(forged() for _ in range(FLOOD)))
    elapsed = asyncio.get_running_loop().time() - started
    hashes = counters["loop_hashes"] + counters["thread_hashes"]
    print(f"{FLOOD} forged signatures, {SECURED} secured sandboxes, {elapsed:.2f} s: {hashes} hashes, "
          f"{counters['queries']} queries (unbounded: {FLOOD * SECURED} hashes, {FLOOD} queries)")
    # the budget's worth (a second's saved up, what refilled meanwhile, one scan past it), not FLOOD * SECURED
    assert hashes <= 100 * (1 + elapsed) + SECURED
    assert counters["loop_hashes"] == 0  # every scan ran off the event loop
    assert counters["queries"] <= 4  # the token list, read once (or twice: a miss waits for a newer read)
    statuses = sorted({status for status, _ in answers})
    assert set(statuses) <= {401, 429}, statuses
    assert all(body == {"code": 401, "message": "invalid signature"} for status, body in answers if status == 401)
    assert any(status == 429 for status, _ in answers)  # past the budget (Retry-After: 1)

    # The budget refills; a genuine URL of a sandbox made after the flood is found, then
    # remembered: its next use costs one hash and no scan.
    await asyncio.sleep(1.1)
    newcomer = await sync_to_async(_make_sandbox)(stack.up_port, secure=True, token="newcomer")
    url = _signed_url("/a", "read", "newcomer")
    r = await stack.client.get(url)
    assert r.status_code == 200 and r.json()["path"] == "/files", r.text
    assert stack.proxy.signers._hints[url.rsplit("signature=", 1)[1].replace("%2B", "+")
                                      .replace("%2F", "/")] == newcomer.id
    counters.update(loop_hashes=0, thread_hashes=0)
    assert (await stack.client.get(url)).status_code == 200
    assert counters["thread_hashes"] == 0 and counters["loop_hashes"] <= 2  # hint check (+ envd-side policy)


async def test_a_url_naming_its_sandbox_never_scans(stack, counters):
    sbx, *_ = await sync_to_async(_secured)(stack, 5)
    counters.update(loop_hashes=0, thread_hashes=0, queries=0)
    r = await stack.client.get("/files?path=%2Fa&signature=v1_forged", headers=test_proxy.hdr(sbx))
    assert r.status_code == 401 and r.json()["message"] == "invalid signature"
    assert counters["thread_hashes"] == 0 and counters["loop_hashes"] == 1  # its own token only
