"""Creates wait for VMs asynchronously: 12 concurrent creates through the real ASGI
app (middleware included) must all be in flight at once, not queue behind a
handful of sync threads."""
import asyncio
import time
from unittest import mock

import pytest

from sandboxes.models import Sandbox

pytestmark = pytest.mark.django_db(transaction=True)

N = 12
BOOT_SECONDS = 0.5
ALL_IN_SECONDS = 10  # serialized creates would wait this long each: N × 10 s


async def test_12_creates_overlap(api, nodes_mock):
    in_flight = 0
    peak = 0
    all_in = asyncio.Event()

    async def slow_boot(node, **kw):
        # Each boot lasts until all N are in flight (at most ALL_IN_SECONDS): on a loaded host a
        # fixed sleep could end before the last create got there, although nothing queued them.
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        if in_flight == N:
            all_in.set()
        try:
            await asyncio.wait_for(all_in.wait(), ALL_IN_SECONDS)
        except asyncio.TimeoutError:
            pass
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
    assert elapsed < 2 * ALL_IN_SECONDS, f"{N} creates took {elapsed:.2f}s: they were serialized"
    assert await Sandbox.objects.filter(state="running").acount() == N


async def test_50_creates_racing_for_20_slots_get_exactly_20(api, nodes_mock):
    """Issue 12's placement race through the API: two nodes with room for 10 default
    sandboxes each, 50 creates at once (each boot takes a while, so all are in flight
    together) → exactly 20 are created, 30 answer 503, and no node is over-committed."""
    from asgiref.sync import sync_to_async  # noqa: PLC0415
    from django.utils import timezone  # noqa: PLC0415

    from nodes import placement  # noqa: PLC0415
    from nodes.models import Node  # noqa: PLC0415

    await Node.objects.filter(pk=nodes_mock.node.pk).aupdate(vcpu_capacity=20, memory_mb_capacity=20 * 512)
    await Node.objects.acreate(id="n2", address="127.0.0.2", vcpu_capacity=20, memory_mb_capacity=20 * 512,
                               last_heartbeat_at=timezone.now())

    async def slow_boot(node, **kw):
        await asyncio.sleep(0.3)
        return {"envd_host": "127.0.0.1", "envd_port": 40000, "pid": 1, "accel": "tcg", "timings": {}}

    nodes_mock.client.boot_sandbox.side_effect = slow_boot
    with mock.patch("lifecycle.sandboxes.core.node_api", return_value=(nodes_mock.client, placement)):
        responses = await asyncio.gather(*(api.post("/v2/sandboxes", json={"templateID": "base"})
                                           for _ in range(50)))
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [201] * 20 + [503] * 30, statuses
    refused = [r.json() for r in responses if r.status_code == 503]
    assert all(body["code"] == 503 and "no node available" in body["message"] for body in refused), refused[:2]
    # admission refusals (issue 27): each says when to try again
    assert {r.headers.get("Retry-After") for r in responses if r.status_code == 503} == {"5"}

    @sync_to_async
    def per_node():
        return {n.pk: (n.cpu_reserved, n.vcpu_capacity)
                for n in placement.with_reservations(Node.objects.all())}
    assert await per_node() == {"n1": (20, 20), "n2": (20, 20)}
    assert await Sandbox.objects.filter(state="running").acount() == 20


async def test_creates_waiting_for_their_node_hold_no_pooled_connection(api, nodes_mock):
    """With PostgreSQL's pool (AENV_DB_POOL_SIZE per process), a request waiting for its
    node gives its connection back meanwhile: concurrent slow creates are not capped by the
    pool's size (beyond it they would wait for a connection and fail after its timeout: the
    3-node cluster benchmark's 500s)."""
    from django.db import connection  # noqa: PLC0415

    if connection.vendor != "postgresql" or connection.pool is None:
        pytest.skip("only PostgreSQL uses a connection pool")
    pool = connection.pool
    waiting, all_waiting, sampled = 0, asyncio.Event(), asyncio.Event()
    in_use = []

    async def slow_boot(node, **kw):
        nonlocal waiting
        waiting += 1
        if waiting == N:
            all_waiting.set()
        await sampled.wait()
        return {"envd_host": "127.0.0.1", "envd_port": 40000, "pid": 1, "accel": "tcg", "timings": {}}

    async def sample():  # while every create waits for its node (each polls its row twice a second)
        await asyncio.wait_for(all_waiting.wait(), timeout=30)
        for _ in range(20):
            stats = pool.get_stats()
            in_use.append(stats["pool_size"] - stats["pool_available"])
            await asyncio.sleep(0.05)
        sampled.set()

    nodes_mock.client.boot_sandbox.side_effect = slow_boot
    *responses, _ = await asyncio.gather(*(api.post("/v2/sandboxes", json={"templateID": "base"}) for _ in range(N)),
                                         sample())
    assert [r.status_code for r in responses] == [201] * N, [r.text for r in responses if r.status_code != 201]
    # the test's own connection and the requests polling their row at that moment, never
    # one per waiting create (N + 1 without the release)
    assert sorted(in_use)[len(in_use) // 2] <= 2, in_use
