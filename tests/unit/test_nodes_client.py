"""Node client ↔ a real Celery worker (thread pool, Redis broker and results) running
the real node tasks with the VM driver replaced by a stub."""
import asyncio
import http.server
import json
import threading
import time
import uuid
from datetime import timedelta
from importlib import import_module
from types import SimpleNamespace

import pytest
import redis
from asgiref.sync import sync_to_async
from celery import Celery
from celery.contrib.testing.worker import start_worker
from django.conf import settings
from django.db import connections
from django.utils import timezone

from nodes.celery_app import app as celery_app
from agent import driver as node_driver
from nodes import client
from nodes.client import NodeTaskFailed, NodeTimeout, NodeUnavailable, boot_sandbox, kill_sandbox, update_network
from nodes.models import Node
from vmm.errors import UnsupportedNetworkPolicy, VMNotFound

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
async def _close_async_orm_connections():
    """The async ORM runs on asgiref's shared thread; close its connection after each
    test, as Django's request cycle would, so PostgreSQL can drop the test database."""
    yield
    await sync_to_async(connections.close_all)()


class ImageNotFound(Exception):
    pass


class EnvdStub(http.server.BaseHTTPRequestHandler):
    """Answers POST /init like envd (204) and records the bodies."""

    bodies: list = []
    status = 204

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        type(self).bodies.append((self.path, json.loads(body)))
        self.send_response(type(self).status)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


class StubDriver:
    accel = "tcg"

    def __init__(self, envd_port):
        self.envd_port = envd_port
        self.killed = []
        self.running = {}
        self.policies = {}

    def boot(self, spec):
        if spec.image == "missing":
            raise ImageNotFound(f"image {spec.image!r} is not built")
        if spec.image == "slow":
            time.sleep(2)
        self.running[spec.sandbox_id] = spec
        return SimpleNamespace(sandbox_id=spec.sandbox_id, pid=4242, envd_host="127.0.0.1",
                               envd_port=self.envd_port, guest_host="", accel="tcg", state_dir="/nonexistent",
                               timings={"qemu_start": 12.5, "envd_ready": 300.0})

    def update_network(self, sandbox_id, network):
        if sandbox_id not in self.running:
            raise VMNotFound(f"no VM for sandbox {sandbox_id}")
        if network.allow_out == ("10.9.9.9/32",):  # plays a backend that cannot enforce it
            raise UnsupportedNetworkPolicy("the stub network backend cannot restrict egress")
        self.policies[sandbox_id] = network

    def kill(self, sandbox_id):
        self.killed.append(sandbox_id)
        return self.running.pop(sandbox_id, None) is not None

    def list(self):
        return list(self.running)

    def capacity(self):
        return {"vcpus": 2, "memory_mb": 4096}

    def fingerprint(self):  # no booted template matches it: creates cold-boot
        return {"driver": "stub"}


@pytest.fixture(scope="module")
def envd_stub():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), EnvdStub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


@pytest.fixture(scope="module")
def node_worker(envd_stub):
    """A Celery worker thread consuming one unique node queue with the real tasks."""
    import_module("agent.tasks")  # registers the node tasks with the worker (also when this file runs alone)
    node_id = f"unit-{uuid.uuid4().hex[:8]}"
    stub = StubDriver(envd_stub.server_address[1])
    node_driver.set_driver(stub)
    with start_worker(celery_app, pool="threads", concurrency=4, perform_ping_check=False,
                      queues=[f"node.{node_id}"], loglevel="WARNING", shutdown_timeout=15):
        yield SimpleNamespace(node_id=node_id, driver=stub)
    node_driver.set_driver(None)
    redis.Redis.from_url(settings.CELERY_BROKER_URL).delete(f"node.{node_id}")


def alive_node(node_id):
    return Node.objects.create(id=node_id, address="127.0.0.1", vcpu_capacity=8, memory_mb_capacity=8192,
                               last_heartbeat_at=timezone.now())


BOOT = dict(image="base", cpu_count=2, memory_mb=512, disk_size_mb=2048)


async def test_boot_returns_endpoint_and_inits_envd(node_worker, envd_stub, monkeypatch):
    sent = []
    real_publish = client._publish
    monkeypatch.setattr(client, "_publish", lambda *a: sent.append(real_publish(*a)) or sent[-1])
    node = await sync_to_async(alive_node)(node_worker.node_id)
    EnvdStub.bodies.clear()
    t0 = time.perf_counter()
    out = await boot_sandbox(node, sandbox_id="sbx1", env_vars={"A": "1"}, access_token="tok", **BOOT)
    elapsed = time.perf_counter() - t0
    assert out["envd_host"] == "127.0.0.1" and out["envd_port"] == envd_stub.server_address[1]
    assert out["pid"] == 4242 and out["accel"] == "tcg"
    assert out["timings"]["qemu_start"] == 12.5 and out["timings"]["init"] >= 0
    path, body = EnvdStub.bodies[-1]
    assert path == "/init"
    assert body["envVars"] == {"A": "1"} and body["accessToken"] == "tok"
    assert "defaultUser" not in body and "defaultWorkdir" not in body  # the template's disk says them
    assert body["timestamp"].endswith("Z")
    assert elapsed < 2.0
    # the result is forgotten after reading (once the answer is out: the call does not wait for it)
    await asyncio.gather(*client._cleanups)
    assert len(sent) == 1 and not await client._result_redis().exists(client._result_key(sent[0]))


async def test_no_access_token_is_omitted_from_init(node_worker):
    node = await sync_to_async(alive_node)(node_worker.node_id)
    EnvdStub.bodies.clear()
    await boot_sandbox(node, sandbox_id="sbx2", env_vars={}, access_token=None, **BOOT)
    assert "accessToken" not in EnvdStub.bodies[-1][1]


async def test_task_exception_carries_kind_and_message(node_worker):
    node = await sync_to_async(alive_node)(node_worker.node_id)
    with pytest.raises(NodeTaskFailed) as info:
        await boot_sandbox(node, sandbox_id="sbx3", env_vars={}, access_token=None,
                           **{**BOOT, "image": "missing"})
    assert info.value.kind == "ImageNotFound"
    assert str(info.value) == "image 'missing' is not built"


async def test_failed_init_kills_the_vm_and_raises(node_worker):
    node = await sync_to_async(alive_node)(node_worker.node_id)
    EnvdStub.status = 500
    try:
        with pytest.raises(NodeTaskFailed) as info:
            await boot_sandbox(node, sandbox_id="sbx4", env_vars={}, access_token=None, **BOOT)
    finally:
        EnvdStub.status = 204
    assert info.value.kind == "EnvdInitFailed" and "500" in str(info.value)
    assert "sbx4" in node_worker.driver.killed and "sbx4" not in node_worker.driver.running


async def test_kill(node_worker):
    node = await sync_to_async(alive_node)(node_worker.node_id)
    await boot_sandbox(node, sandbox_id="sbx5", env_vars={}, access_token=None, **BOOT)
    assert await kill_sandbox(node, sandbox_id="sbx5") == {"killed": True}
    assert await kill_sandbox(node, sandbox_id="sbx5") == {"killed": False}


async def test_calls_share_one_result_subscription(node_worker, monkeypatch):
    """Concurrent and later calls wait on the loop's one subscription connection (no
    connection of their own per call), and leave no waiter behind."""
    from redis.asyncio.connection import AbstractConnection  # noqa: PLC0415

    node = await sync_to_async(alive_node)(node_worker.node_id)
    await kill_sandbox(node, sandbox_id="warm")  # the loop's clients exist now
    opened = []
    real_connect = AbstractConnection.connect

    async def counting(self, *a, **k):
        if self._reader is None:
            opened.append(self)
        return await real_connect(self, *a, **k)

    monkeypatch.setattr(AbstractConnection, "connect", counting)
    listener = client._listener()
    outs = await asyncio.gather(*[kill_sandbox(node, sandbox_id=f"none{i}") for i in range(6)])
    outs.append(await kill_sandbox(node, sandbox_id="none6"))
    assert outs == [{"killed": False}] * 7
    assert client._listener() is listener and listener.waiters == {}
    await asyncio.gather(*client._cleanups)  # (every result channel unsubscribed, every key deleted)
    # concurrent GETs may open a few pooled connections; before, every call opened one more
    assert len(opened) < 6, opened


async def test_a_broken_subscription_falls_back_to_polling(node_worker, monkeypatch):
    node = await sync_to_async(alive_node)(node_worker.node_id)
    await kill_sandbox(node, sandbox_id="warm")
    listener = client._listener()

    async def broken(*a, **k):
        raise redis.ConnectionError("gone")

    monkeypatch.setattr(listener.pubsub, "get_message", broken)
    t0 = time.perf_counter()
    assert await kill_sandbox(node, sandbox_id="sbx-poll") == {"killed": False}
    assert time.perf_counter() - t0 < 5
    assert client._listener() is not listener  # the next call gets a fresh connection


async def test_an_answer_on_the_subscription_takes_no_read_of_its_key(node_worker, monkeypatch):
    """The result comes on the loop's subscription: the call reads no key for it (a GET right
    after every send was one Redis round trip of the API's CPU per node call, issue 26)."""
    node = await sync_to_async(alive_node)(node_worker.node_id)
    await kill_sandbox(node, sandbox_id="warm")
    r = client._result_redis()
    gets = []
    real_get = r.get

    async def counting(key, *a, **k):
        gets.append(key)
        return await real_get(key, *a, **k)

    monkeypatch.setattr(r, "get", counting)
    for i in range(5):
        assert await kill_sandbox(node, sandbox_id=f"quiet{i}") == {"killed": False}
    assert gets == []


async def test_a_result_the_subscription_missed_is_read_from_its_key(node_worker, monkeypatch):
    """A result published before the subscription took effect (or lost with it) is still found:
    the call reads its key once no answer came on the subscription for FIRST_LOOK."""
    node = await sync_to_async(alive_node)(node_worker.node_id)
    await kill_sandbox(node, sandbox_id="warm")
    listener = client._listener()
    real_subscribe = listener.subscribe

    async def deaf(key):  # subscribed to a channel nobody publishes on: every message missed
        return await real_subscribe(key + ".never")

    monkeypatch.setattr(listener, "subscribe", deaf)
    monkeypatch.setattr(client, "POLL_FALLBACK", 30.0)  # only the first look can find it in time
    out = await asyncio.wait_for(kill_sandbox(node, sandbox_id="missed"), timeout=20)
    assert out == {"killed": False}


async def test_concurrent_boots_run_in_parallel(node_worker):
    node = await sync_to_async(alive_node)(node_worker.node_id)
    t0 = time.perf_counter()
    outs = await asyncio.gather(*[
        boot_sandbox(node, sandbox_id=f"par{i}", env_vars={}, access_token=None, **{**BOOT, "image": "slow"})
        for i in range(4)
    ])
    assert len(outs) == 4
    assert time.perf_counter() - t0 < 3.5  # 4 × 2 s serially would be 8 s


async def test_slow_task_times_out_at_deadline(node_worker):
    node = await sync_to_async(alive_node)(node_worker.node_id)
    t0 = time.perf_counter()
    with pytest.raises(NodeTimeout, match="within 0.5s"):
        await boot_sandbox(node, sandbox_id="late", env_vars={}, access_token=None,
                           deadline=0.5, **{**BOOT, "image": "slow"})
    assert 0.45 < time.perf_counter() - t0 < 1.5
    await asyncio.sleep(2)  # let the worker finish it before the next test


async def test_node_without_worker_times_out():
    node = await sync_to_async(alive_node)(f"unit-gone-{uuid.uuid4().hex[:6]}")
    t0 = time.perf_counter()
    try:
        with pytest.raises(NodeTimeout, match=f"node {node.id} did not finish"):
            await kill_sandbox(node, sandbox_id="x", deadline=0.4)
    finally:
        redis.Redis.from_url(settings.CELERY_BROKER_URL).delete(node.queue)
    assert time.perf_counter() - t0 < 1.5


async def test_dead_node_is_unavailable_without_sending():
    def make():
        return Node.objects.create(id="stale", address="x", last_heartbeat_at=timezone.now() - timedelta(hours=1))

    node = await sync_to_async(make)()
    t0 = time.perf_counter()
    with pytest.raises(NodeUnavailable, match="not alive"):
        await boot_sandbox(node, sandbox_id="s", env_vars={}, access_token=None, **BOOT)
    assert time.perf_counter() - t0 < 0.5
    assert redis.Redis.from_url(settings.CELERY_BROKER_URL).llen("node.stale") == 0


async def test_broker_down_is_unavailable_not_a_hang(monkeypatch):
    node = await sync_to_async(alive_node)("nobroker")
    down = Celery("down", broker="redis://127.0.0.1:1/0", backend="redis://127.0.0.1:1/1")
    down.conf.broker_connection_timeout = 1
    monkeypatch.setattr(client.celery_app, "send_task",
                        lambda name, **kw: down.send_task(name, ignore_result=True, **kw))
    t0 = time.perf_counter()
    with pytest.raises(NodeUnavailable, match="broker"):
        await kill_sandbox(node, sandbox_id="x", deadline=30)
    assert time.perf_counter() - t0 < 6


async def test_network_spec_reaches_the_driver_and_update_network_round_trips(node_worker):
    """boot's ``network`` becomes BootSpec.network; update_network replaces it; the driver's
    refusal comes back as its kind (what the API maps to 400), a missing VM as VMNotFound."""
    node = await sync_to_async(alive_node)(node_worker.node_id)
    spec = {"allow_internet_access": False, "allow_out": ["1.1.1.1/32"], "deny_out": ["0.0.0.0/0"],
            "forward_ports": [49983]}
    out = await boot_sandbox(node, sandbox_id="net1", env_vars={}, access_token=None, network=spec, **BOOT)
    assert out["guest_host"] == ""
    booted = node_worker.driver.running["net1"].network
    assert (booted.allow_internet_access, booted.allow_out, booted.deny_out) == (False, ("1.1.1.1/32",),
                                                                                ("0.0.0.0/0",))
    result = await update_network(node, sandbox_id="net1", network={**spec, "allow_internet_access": True,
                                                                     "deny_out": []})
    assert result["timings"]["total_ms"] >= 0
    now = node_worker.driver.policies["net1"]
    assert (now.allow_internet_access, now.allow_out, now.deny_out) == (True, ("1.1.1.1/32",), ())
    with pytest.raises(NodeTaskFailed) as refused:
        await update_network(node, sandbox_id="net1", network={"allow_out": ["10.9.9.9/32"]})
    assert refused.value.kind == "UnsupportedNetworkPolicy" and "cannot restrict egress" in str(refused.value)
    assert node_worker.driver.policies["net1"] is now
    with pytest.raises(NodeTaskFailed) as missing:
        await update_network(node, sandbox_id="nope", network={})
    assert missing.value.kind == "VMNotFound"


async def test_a_row_just_read_is_checked_as_it_is_an_older_one_is_read_again(monkeypatch):
    """``read_now``: the lifecycle read the node a moment ago (with the sandbox, in the
    placement's claim), so the send checks that row without a second query; a row older
    than FRESH_FOR (or never marked) is read again, and a revocation since is refused."""
    from django.utils import timezone as tz  # noqa: PLC0415

    node = await sync_to_async(alive_node)(f"unit-fresh-{uuid.uuid4().hex[:6]}")
    now = [1000.0]
    monkeypatch.setattr(client.time, "monotonic", lambda: now[0])
    await Node.objects.filter(pk=node.pk).aupdate(revoked_at=tz.now())  # the database has moved on
    client.read_now(node)
    assert await client._sendable(node) is node  # no read: the row as the caller had it
    now[0] += client.FRESH_FOR + 0.1
    with pytest.raises(client.NodeRefused, match="revoked"):
        await client._sendable(node)
    unmarked = await sync_to_async(alive_node)(f"unit-fresh-{uuid.uuid4().hex[:6]}")
    await Node.objects.filter(pk=unmarked.pk).aupdate(revoked_at=tz.now())
    with pytest.raises(client.NodeRefused):
        await client._sendable(unmarked)


def test_the_message_headers_show_which_sandbox_not_the_body(monkeypatch):
    """kwargsrepr names the sandbox / snapshot only: no sealed field, token or env var of the
    body in the headers a worker logs (and no repr of the whole body built per send)."""
    seen = {}
    monkeypatch.setattr(client.celery_app, "send_task",
                        lambda name, **kw: seen.update(kw) or SimpleNamespace(id=kw["task_id"]))
    client._publish("agent.tasks.boot_sandbox", "node.x",
                    {"sandbox_id": "sbx9", "env_vars": {"SECRET": "v"}, "access_token": "tok-123"}, 30)
    assert seen["kwargsrepr"] == "{'sandbox_id': 'sbx9'}" and seen["argsrepr"] == "()"
    assert "tok-123" not in seen["kwargsrepr"] and "SECRET" not in seen["kwargsrepr"]
