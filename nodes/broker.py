"""kombu's Redis transport with one command client per channel (issue 26).

kombu's Redis channel builds a new ``redis.Redis`` client around its connection pool for
every command it sends outside its event loop (``Channel.conn_or_acquire``): every publish,
every ack of the worker's QoS. The pool and its connections are reused; the client object is
not, and building one (its ~160 response callbacks) was ~0.25 ms of CPU per publish, about a
third of a publish's own cost in the API. Here a channel keeps the one it built, as long as
its pool is the same: the same pool and connections, the same commands, the same handling of
a broken connection (the pool's connection is dropped and the next command connects anew;
kombu's ``ensure`` retries a publish and revives the channel, which builds a new client). A
``redis.Redis`` over a pool is safe to share between threads; a channel is used by one
producer at a time anyway (Celery's producer pool).

Selected by ``nodes.celery_app`` for a ``redis://`` or ``rediss://`` broker (``broker_transport``
unless one is configured); every process of the app uses it, the node worker too.
"""
from __future__ import annotations

from contextlib import contextmanager

from kombu.transport import redis as kombu_redis


class Channel(kombu_redis.Channel):
    _aenv_client = None  # (the pool it wraps, the client)

    @contextmanager
    def conn_or_acquire(self, client=None):
        if client:
            yield client
            return
        pool = self.pool  # a closed channel's pool is dropped: a client is kept only with its pool
        kept = self._aenv_client
        if kept is None or kept[0] is not pool:
            kept = self._aenv_client = (pool, self._create_client())
        yield kept[1]


class Transport(kombu_redis.Transport):
    Channel = Channel


TRANSPORT = f"{__name__}:Transport"


def use_for(conf) -> None:
    """This transport in a Celery app's configuration when its broker is Redis and no
    transport is configured."""
    url = conf.broker_url or ""
    if isinstance(url, str) and url.split("://", 1)[0] in ("redis", "rediss") and not conf.broker_transport:
        conf.broker_transport = TRANSPORT
