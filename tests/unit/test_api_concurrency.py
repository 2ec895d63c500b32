"""Creates wait for VMs asynchronously: 12 concurrent creates through the real ASGI
app (middleware included) must all be in flight at once, not queue behind a
handful of sync threads."""
import asyncio
import time

import pytest

from sandboxes.models import Sandbox

pytestmark = pytest.mark.django_db(transaction=True)

N = 12
BOOT_SECONDS = 0.5


async def test_12_creates_overlap(api, nodes_mock):
    in_flight = 0
    peak = 0

    async def slow_boot(node, **kw):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(BOOT_SECONDS)
        in_flight -= 1
        return {"envd_host": "127.0.0.1", "envd_port": 40000, "pid": 1, "accel": "tcg", "timings": {}}

    nodes_mock.client.boot_sandbox.side_effect = slow_boot
    t0 = time.monotonic()
    responses = await asyncio.gather(*(api.post("/v2/sandboxes", json={"templateID": "base"}) for _ in range(N)))
    elapsed = time.monotonic() - t0
    assert [r.status_code for r in responses] == [201] * N, [r.text for r in responses if r.status_code != 201]
    assert len({r.json()["sandboxID"] for r in responses}) == N
    assert peak == N, f"only {peak} boots were in flight at once"
    assert elapsed < N * BOOT_SECONDS / 2, f"{N} creates took {elapsed:.2f}s: they were serialized"
    assert await Sandbox.objects.filter(state="running").acount() == N
