"""Celery's Redis result backend without its read before each successful result (issue 26).

Before storing a task's state, Celery's key-value backends read the stored one and keep an
earlier SUCCESS rather than overwrite it (a task delivered twice, its second run failing,
must not hide the first run's result). That read is one Redis round trip on the critical path
of every node task: the node's answer waits for it, and py-spy put it at ~10 % of a node
worker's busy time in `bench/control_plane.py`, more than the store itself. A SUCCESS needs
no such read: overwriting anything with it hides no earlier success. So a SUCCESS is stored at
once, and every other state goes through Celery's own path, read included.

``nodes.celery_app`` names it as the app's backend class, in every process of the app: the node
worker stores, the control plane only reads (``nodes.client``, which needs Redis results too),
and both keep the same keys and encoding. The URL is still ``CELERY_RESULT_BACKEND``.
"""
from __future__ import annotations

from celery import states
from celery.backends.redis import RedisBackend
from celery.exceptions import BackendStoreError, ImproperlyConfigured
from kombu.utils.encoding import bytes_to_str


# The result store's URL schemes: those both of its users read alike, the node's store (Celery's
# RedisBackend) and the control plane's reader (redis.asyncio, nodes.client). A Unix socket has
# no such URL: Celery names it socket://, redis-py unix://, and each fails on the other's.
SCHEMES = ("redis", "rediss")


def is_redis_url(url) -> bool:
    return isinstance(url, str) and url.split("://", 1)[0] in SCHEMES


class ResultBackend(RedisBackend):
    def __init__(self, *args, url=None, app=None, **kwargs):
        # Named as a class (``backend_cls``), the backend gets no URL from Celery: it is the
        # configured result_backend's.
        url = url or app.conf.result_backend or ""
        if not is_redis_url(url):
            raise ImproperlyConfigured(f"CELERY_RESULT_BACKEND must be a Redis URL ({', '.join(SCHEMES)}), "
                                       f"not {str(url).split(':', 1)[0]!r}")
        super().__init__(*args, url=url, app=app, **kwargs)

    def _store_result(self, task_id, result, state, traceback=None, request=None, **kwargs):
        if state != states.SUCCESS:
            return super()._store_result(task_id, result, state, traceback=traceback, request=request, **kwargs)
        meta = self._get_result_meta(result=result, state=state, traceback=traceback, request=request)
        meta["task_id"] = bytes_to_str(task_id)
        try:
            self._set_with_state(self.get_key_for_task(task_id), self.encode(meta), state)
        except BackendStoreError as exc:
            raise BackendStoreError(str(exc), state=state, task_id=task_id) from exc
        return result


    def _set(self, key, value, expires=None):
        """The state stored and published in one round trip as Celery does, without its
        MULTI/EXEC around the two: nothing needs them atomic (a waiter that misses the message
        reads the key, ``nodes.client``), and they were two more commands for Redis and the
        node on every task (issue 26)."""
        if expires is None:
            expires = self.expires
        with self.client.pipeline(transaction=False) as pipe:
            if expires:
                pipe.setex(key, expires, value)
            else:
                pipe.set(key, value)
            pipe.publish(key, value)
            pipe.execute()


BACKEND = f"{__name__}:ResultBackend"
