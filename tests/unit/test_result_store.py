"""Node task round trips with fewer Redis round trips (issue 26), against a ``redis-server`` of
the test's own (tests.unit.test_broker_transport's):

- ``nodes.result_store``: a SUCCESS is stored without reading the stored state first (Celery's
  key-value backends read before every store); any other state still reads, so a failure that
  comes after a success (a task delivered twice) does not hide it; the app uses it, with
  ``CELERY_RESULT_BACKEND``'s URL, and refuses a result backend that is not Redis.
- ``CELERY_BROKER_TRANSPORT_OPTIONS``: kombu's ack emulation is off, so taking a message from a
  node's queue writes nothing more to Redis (no "unacked" copy to ack away later)."""
from __future__ import annotations

import shutil

import pytest
import redis
from celery import Celery, states
from celery.exceptions import ImproperlyConfigured
from django.conf import settings

from nodes import broker, result_store
from nodes.celery_app import app as celery_app
from tests.unit.test_broker_transport import server  # noqa: F401 - the fixture

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server (scripts/setup.sh)")


def _app(url: str) -> Celery:
    """A Celery app configured as ``nodes.celery_app`` is, on the test's server."""
    app = Celery("resultstoretest", broker=url)
    app.conf.update(result_backend=url, task_serializer="json", accept_content=["json"],
                    broker_transport_options=settings.CELERY_BROKER_TRANSPORT_OPTIONS)
    broker.use_for(app.conf)
    app.backend_cls = result_store.BACKEND
    return app


def _calls(client: redis.Redis, command: str) -> int:
    return int(client.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def test_the_app_stores_results_with_it():
    assert celery_app.backend_cls == result_store.BACKEND
    assert isinstance(celery_app.backend, result_store.ResultBackend)
    assert celery_app.backend.url == settings.CELERY_RESULT_BACKEND  # the configured URL, not the class


def test_a_success_is_stored_without_a_read_and_a_later_failure_does_not_hide_it(server):  # noqa: F811
    app = _app(server.url)
    backend = app.backend
    client = redis.Redis.from_url(server.url)
    gets = _calls(client, "get")
    backend.store_result("t-1", {"envd_port": 40001}, states.SUCCESS)
    assert _calls(client, "get") == gets  # no read before the store
    assert backend.get_task_meta("t-1")["result"] == {"envd_port": 40001}
    gets = _calls(client, "get")

    # the same task failing afterwards (delivered twice): Celery's read keeps the success
    backend.store_result("t-1", ValueError("second run"), states.FAILURE)
    assert _calls(client, "get") > gets
    fresh = _app(server.url).backend
    assert fresh.get_task_meta("t-1")["status"] == states.SUCCESS

    # a failure of its own is stored
    backend.store_result("t-2", ValueError("refused"), states.FAILURE)
    assert fresh.get_task_meta("t-2")["status"] == states.FAILURE


def test_a_result_is_stored_and_published_without_a_transaction(server):  # noqa: F811
    """SET and PUBLISH in one round trip, not wrapped in MULTI/EXEC (two commands more a task)."""
    app = _app(server.url)
    client = redis.Redis.from_url(server.url)
    listener = client.pubsub()
    key = app.backend.get_key_for_task("t-3").decode()
    listener.subscribe(key)
    assert listener.get_message(timeout=5)["type"] == "subscribe"
    multis, execs = _calls(client, "multi"), _calls(client, "exec")
    app.backend.store_result("t-3", {"envd_port": 40003}, states.SUCCESS)
    assert (_calls(client, "multi"), _calls(client, "exec")) == (multis, execs)
    published = listener.get_message(timeout=5)
    assert published["type"] == "message" and app.backend.decode(published["data"])["result"] == {"envd_port": 40003}
    assert app.backend.get_task_meta("t-3")["result"] == {"envd_port": 40003}
    assert 0 < client.ttl(key) <= app.backend.expires
    listener.close()


@pytest.mark.parametrize("url", ["rpc://", "socket:///run/redis.sock", "unix:///run/redis.sock"])
def test_a_result_backend_that_both_sides_cannot_read_is_refused(url):
    """Not Redis, or a Unix socket (Celery's store takes only socket://, the control plane's
    reader only unix://): refused by the store and by the reader alike."""
    app = Celery("resultstoretest", broker="redis://127.0.0.1:1/0")
    app.conf.result_backend = url
    app.backend_cls = result_store.BACKEND
    with pytest.raises(ImproperlyConfigured, match="must be a Redis URL"):
        app.backend  # noqa: B018 - building it is the check
    assert not result_store.is_redis_url(url)
    assert result_store.is_redis_url("redis://127.0.0.1:6379/1") and result_store.is_redis_url("rediss://h:6380/1")


def test_taking_a_message_writes_no_unacked_copy(server):  # noqa: F811
    app = _app(server.url)
    app.send_task("nodes.echo", kwargs={"value": 1}, queue="node.result-store-test", ignore_result=True)
    client = redis.Redis.from_url(server.url)
    with app.connection_for_read() as conn:
        channel = conn.default_channel
        message = channel.basic_get("node.result-store-test", no_ack=False)
        assert message is not None and message.payload[1] == {"value": 1}
        assert not client.exists("unacked") and not client.exists("unacked_index")
        message.ack()
    assert client.llen("node.result-store-test") == 0
