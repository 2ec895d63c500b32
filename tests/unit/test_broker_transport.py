"""nodes.broker: kombu's Redis transport keeping one command client per channel (issue 26),
against a ``redis-server`` of the test's own (a free loopback port, a tmp dir; never the
machine's :6379): publishes reuse the channel's client instead of building one each; they
arrive; and a broker that is killed and started again is reconnected to, a publish while it
is down fails within the retry policy instead of hanging, and the one after the restart is
delivered (the kept client's dead pooled connection replaced); a worker on it (the node's
flags) answers before and after such a restart."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from celery import Celery
from kombu.exceptions import OperationalError

from harness.stack import free_port
from tests.unit.test_broker_acl import stop_worker
from nodes import broker
from nodes.celery_app import app as celery_app
from nodes.client import _RETRY_POLICY

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server (scripts/setup.sh)")

QUEUE = "node.broker-test"


class Server:
    def __init__(self, home):
        self.home, self.port, self.proc = home, free_port(), None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
             "--dir", str(self.home), "--logfile", str(self.home / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                if redis.Redis.from_url(self.url, socket_connect_timeout=1).ping():
                    return
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"redis-server did not start: {self.log()}") from None
                time.sleep(0.05)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)

    def log(self) -> str:
        path = self.home / "redis.log"
        return path.read_text()[-2000:] if path.exists() else ""

    def llen(self) -> int:
        return redis.Redis.from_url(self.url, socket_connect_timeout=1).llen(QUEUE)


@pytest.fixture
def server(tmp_path):
    s = Server(tmp_path)
    s.start()
    yield s
    if s.proc.poll() is None:
        s.kill()


def sender(url: str) -> Celery:
    """A Celery app as the control plane's (the transport chosen by nodes.broker.use_for)."""
    app = Celery("brokertest", broker=url)
    app.conf.update(task_serializer="json", accept_content=["json"], broker_connection_timeout=1,
                    broker_connection_retry_on_startup=True)
    broker.use_for(app.conf)
    return app


def publish(app: Celery) -> None:
    app.send_task("nodes.echo", kwargs={"value": 1}, queue=QUEUE, ignore_result=True, retry=True,
                  retry_policy=_RETRY_POLICY)


def test_the_app_uses_it_for_a_redis_broker_and_leaves_others_alone():
    assert celery_app.conf.broker_url.startswith("redis://")
    assert isinstance(celery_app.connection_for_write().transport, broker.Transport)
    other = Celery("amqp", broker="amqp://guest@127.0.0.1//")
    broker.use_for(other.conf)
    assert not other.conf.broker_transport
    chosen = Celery("chosen", broker="redis://127.0.0.1:1/0")
    chosen.conf.broker_transport = "redis"
    broker.use_for(chosen.conf)
    assert chosen.conf.broker_transport == "redis"


def test_publishes_reuse_the_channels_client_and_arrive(server, monkeypatch):
    built = []
    original = broker.Channel._create_client

    def counting(self, asynchronous=False):
        if not asynchronous:
            built.append(self)
        return original(self, asynchronous=asynchronous)

    monkeypatch.setattr(broker.Channel, "_create_client", counting)
    app = sender(server.url)
    assert app.conf.broker_transport == broker.TRANSPORT
    for _ in range(20):
        publish(app)
    assert server.llen() == 20
    # kombu's own channel builds a client per publish (20); here one per channel the pool made
    assert 1 <= len(built) <= 2, len(built)
    assert len(set(map(id, built))) == len(built)


def test_a_broker_restart_is_reconnected_not_a_hang(server):
    app = sender(server.url)
    publish(app)
    assert server.llen() == 1

    # restarted between two publishes: the kept client's pooled connection is dead
    server.kill()
    server.start()
    t0 = time.monotonic()
    publish(app)
    assert time.monotonic() - t0 < 5
    assert server.llen() == 1  # the new server (no persistence) holds just this one

    # down: the publish gives up within the retry policy, then works once it is back
    server.kill()
    t0 = time.monotonic()
    with pytest.raises((OperationalError, redis.ConnectionError)):
        publish(app)
    assert time.monotonic() - t0 < 10
    server.start()
    t0 = time.monotonic()
    publish(app)
    assert time.monotonic() - t0 < 5
    assert server.llen() == 1


WORKER_APP = '''
import os
from celery import Celery
from nodes import broker
app = Celery("brokertest-worker", broker=os.environ["BROKER"], backend=os.environ["BACKEND"])
app.conf.update(task_serializer="json", result_serializer="json", accept_content=["json"],
                task_acks_late=False, worker_prefetch_multiplier=1, broker_connection_retry_on_startup=True)
broker.use_for(app.conf)

@app.task(name="nodes.echo")
def echo(value):
    return {"echo": value, "pid": os.getpid(), "transport": str(app.conf.broker_transport)}
'''


def test_a_worker_on_it_answers_before_and_after_a_broker_restart(server, tmp_path):
    """A node worker's flags (agent.worker.worker_argv: the thread pool) on this transport: it
    answers, the broker is killed and started again, and the same worker process answers the
    next task (its kept clients' dead connections replaced, the consumer reconnected)."""
    from agent.worker import worker_argv  # noqa: PLC0415

    (tmp_path / "broker_worker_app.py").write_text(WORKER_APP)
    root = str(Path(__file__).resolve().parents[2])
    backend = server.url.rsplit("/", 1)[0] + "/1"
    env = {**os.environ, "BROKER": server.url, "BACKEND": backend, "PYTHONPATH": f"{tmp_path}:{root}"}
    env.pop("DJANGO_SETTINGS_MODULE", None)  # a plain Celery app: no Django in the worker
    argv = worker_argv("broker-test", 2, "WARNING")
    worker = subprocess.Popen([sys.executable, "-m", "celery", "-A", "broker_worker_app", *argv], cwd=tmp_path,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    producer = Celery("brokertest-producer", broker=server.url, backend=backend)
    producer.conf.update(task_serializer="json", result_serializer="json", accept_content=["json"],
                         broker_connection_retry_on_startup=True, broker_connection_timeout=1)
    broker.use_for(producer.conf)
    answers = []
    try:
        for value in ("before", "after"):
            if value == "after":
                server.kill()
                server.start()
            result = producer.send_task("nodes.echo", kwargs={"value": value}, queue=QUEUE, expires=60,
                                        retry=True, retry_policy=_RETRY_POLICY)
            answers.append(result.get(timeout=60))
    finally:
        out = stop_worker(worker)
        producer.close()
    assert [a["echo"] for a in answers] == ["before", "after"], out
    assert {a["pid"] for a in answers} == {worker.pid}, out
    assert {a["transport"] for a in answers} == {broker.TRANSPORT}
