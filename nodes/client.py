"""Control-plane side of node tasks: send a VM operation to a node's queue and await
its result without blocking a thread.

Sending goes through Celery (a short blocking publish, done on a small private
thread pool). Waiting does not use ``AsyncResult.get()``: before sending, it subscribes
with ``redis.asyncio`` to the channel the Redis result backend publishes the result on,
on one subscription connection per event loop that every waiting call shares
(``_Listener``), with a GET fallback, so a result is seen within a millisecond or so of
being stored and no thread is held while a VM boots.
"""
import asyncio
import logging
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import redis.asyncio as aioredis
from celery import states
from celery.utils import uuid
from django.conf import settings

from nodes.celery_app import app as celery_app
from nodes import join, protocol, result_store
from nodes.models import Node
from nodes import signing

log = logging.getLogger(__name__)

# How long a publish may take before the broker counts as unreachable.
SEND_TIMEOUT = 5.0
# Re-check the stored result this often in case a pubsub message was missed.
POLL_FALLBACK = 0.5
# The first look at the result's key when no answer came on the subscription (_dispatch).
FIRST_LOOK = 0.1


class NodeError(Exception):
    """A node operation did not succeed."""


class NodeUnavailable(NodeError):
    """The node is not alive, or the broker / result store cannot be reached."""


class NodeRefused(NodeUnavailable):
    """The control plane sends this node nothing: revoked, or never joined where joining is
    required (``nodes.join.refusal``)."""


class NodeTimeout(NodeError):
    """No result arrived within the deadline (node dead, stuck or overloaded)."""


class NodeTaskFailed(NodeError):
    """The task raised on the node; ``kind`` is the exception class name there."""

    def __init__(self, message: str, kind: str = "Exception"):
        super().__init__(message)
        self.kind = kind


# --- sending ---------------------------------------------------------------

def _init_sender_thread() -> None:
    # Celery's Redis backend subscribes the *sending* thread to every task's result
    # channel (on_task_call) and only drains it in AsyncResult.get(), which we never
    # call; unread messages would pile up on that connection. The backend instance is
    # thread-local (result_backend_thread_safe=False), so turning that off here
    # affects only these sender threads.
    backend = celery_app.backend
    if not backend.thread_safe:  # a shared backend is never patched
        backend.on_task_call = lambda producer, task_id: None


_sender = ThreadPoolExecutor(max_workers=4, thread_name_prefix="aenv-node-send", initializer=_init_sender_thread)

_RETRY_POLICY = {"max_retries": 2, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.5}


def _publish(task: str, queue: str, kwargs: dict, expires: float, task_id: str | None = None) -> str:
    # Secrets sealed (nodes.sealed); the claims bind the signed body to this task, queue, id
    # and expiry, so the node can tell a replayed or re-aimed message (nodes.signing).
    task_id = task_id or uuid()
    body = signing.outgoing(task, queue, task_id, kwargs, expires, settings.SECRET_KEY)
    # The serializer named: the configuration's (``auth`` when signing), never one a task class
    # registered in this process captured before signing was set up.
    # What the message's headers show of it (the worker's "received" log, monitoring): which
    # sandbox or snapshot, not the body. Celery would otherwise repr the whole signed body, sealed
    # fields and all, for every message: a third of building one (issue 26).
    shown = repr({k: kwargs[k] for k in _SHOWN if k in kwargs})
    result = celery_app.send_task(task, kwargs=body, queue=queue, task_id=task_id, expires=expires, retry=True,
                                  retry_policy=_RETRY_POLICY, serializer=celery_app.conf.task_serializer,
                                  argsrepr="()", kwargsrepr=shown)
    return result.id


_SHOWN = ("sandbox_id", "snapshot_id", "build_id", "template_id")


async def _send(task: str, node: Node, kwargs: dict, deadline: float, task_id: str | None = None) -> str:
    loop = asyncio.get_running_loop()
    # expires: a node that comes back after the caller gave up must not run it.
    fut = loop.run_in_executor(_sender, _publish, task, node.queue, kwargs, deadline, task_id)
    try:
        return await asyncio.wait_for(fut, timeout=min(SEND_TIMEOUT, deadline))
    except asyncio.TimeoutError:
        raise NodeUnavailable(f"node {node.id}: broker did not accept the task within {SEND_TIMEOUT:.0f}s") from None
    except Exception as exc:  # kombu OperationalError, redis ConnectionError, ...
        raise NodeUnavailable(f"node {node.id}: cannot reach the broker: {exc}") from exc


# --- waiting ---------------------------------------------------------------

_redis_by_loop: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aioredis.Redis]" = weakref.WeakKeyDictionary()
_listener_by_loop: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Listener]" = weakref.WeakKeyDictionary()
_redis_lock = threading.Lock()


def _result_redis() -> aioredis.Redis:
    """One asyncio Redis client per event loop (their connections are loop-bound)."""
    loop = asyncio.get_running_loop()
    with _redis_lock:
        client = _redis_by_loop.get(loop)
        if client is None:
            url = celery_app.conf.result_backend or ""
            if not result_store.is_redis_url(url):
                raise NodeUnavailable(f"the node client needs the Redis result backend, not {url.split(':')[0]!r}")
            client = aioredis.from_url(url, socket_connect_timeout=3, health_check_interval=0)
            _redis_by_loop[loop] = client
        return client


class _Listener:
    """One subscription connection per event loop, shared by every call waiting there: a
    call subscribes to its result's channel on it (a command on an open connection, not a
    connection of its own: connect + SUBSCRIBE + close per call was ~1/3 of the Celery round
    trip, docs/benchmarks.md) and one reader hands each published result to its waiter. The
    reader runs while someone waits; a broken connection ends it with the error, every
    waiter falls back to its GET poll and the next call opens a new connection."""

    def __init__(self, redis: aioredis.Redis):
        self.pubsub = redis.pubsub()
        self.waiters: dict[str, asyncio.Future] = {}
        self.reader: asyncio.Task | None = None

    async def subscribe(self, key: str) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self.waiters[key] = future
        try:
            await self.pubsub.subscribe(key)
        except BaseException:
            self.waiters.pop(key, None)
            raise
        if self.reader is None or self.reader.done():
            self.reader = asyncio.ensure_future(self._read())
        return future

    async def unsubscribe(self, key: str) -> None:
        self.waiters.pop(key, None)
        try:
            await self.pubsub.unsubscribe(key)
        except (aioredis.RedisError, OSError):
            pass  # the connection is gone, and the subscription with it

    async def _read(self) -> None:
        try:
            while self.waiters:
                msg = await self.pubsub.get_message(ignore_subscribe_messages=True, timeout=POLL_FALLBACK)
                if msg is None or msg.get("type") != "message":
                    continue
                channel = msg["channel"].decode() if isinstance(msg["channel"], bytes) else msg["channel"]
                future = self.waiters.get(channel)
                if future is not None and not future.done():
                    future.set_result(msg["data"])
        except Exception as exc:  # noqa: BLE001 - the waiters poll; the next call reconnects
            log.warning("result subscription failed, waiting calls poll: %s", exc)
            with _redis_lock:
                if _listener_by_loop.get(asyncio.get_running_loop()) is self:
                    del _listener_by_loop[asyncio.get_running_loop()]
            try:
                await self.pubsub.aclose()
            except Exception:  # noqa: BLE001
                pass


def _listener() -> _Listener:
    loop = asyncio.get_running_loop()
    redis = _result_redis()
    with _redis_lock:
        listener = _listener_by_loop.get(loop)
        if listener is None:
            listener = _listener_by_loop[loop] = _Listener(redis)
        return listener


def _result_key(task_id: str) -> str:
    key = celery_app.backend.get_key_for_task(task_id)
    return key.decode() if isinstance(key, bytes) else key


def _ready_meta(raw) -> dict | None:
    if raw is None:
        return None
    meta = celery_app.backend.decode(raw)
    return meta if meta.get("status") in states.READY_STATES else None


async def _dispatch(node: Node, task: str, kwargs: dict, deadline: float, what: str) -> dict:
    """Subscribes to the task's result channel, sends the task, then waits for the result:
    the subscription is in place before the node can answer, and a GET after FIRST_LOOK (and
    every POLL_FALLBACK after that) catches a result published before it took effect. Not a GET
    right after the send: the answer nearly always comes on the subscription, and that GET was
    a Redis round trip of the API's CPU on every node call (issue 26)."""
    task_id = uuid()
    key = _result_key(task_id)
    end = time.monotonic() + deadline
    try:
        listener = _listener()
        published = await listener.subscribe(key)
    except (aioredis.RedisError, OSError) as exc:
        raise NodeUnavailable(f"node {node.id}: cannot reach the result store: {exc}") from exc
    done = False
    try:
        await _send(task, node, kwargs, deadline, task_id=task_id)
        r = _result_redis()
        meta, look = None, FIRST_LOOK
        while meta is None:
            now = time.monotonic()
            if now >= end:
                raise NodeTimeout(
                    f"node {node.id} did not finish {what} within {deadline:g}s "
                    "(node down, stuck or overloaded)"
                )
            try:
                raw = await asyncio.wait_for(asyncio.shield(published), timeout=min(end - now, look))
                meta = _ready_meta(raw)
            except asyncio.TimeoutError:
                meta = _ready_meta(await r.get(key))
            look = POLL_FALLBACK
            if meta is None and published.done():  # a message that was not a final state
                published = asyncio.get_running_loop().create_future()
                listener.waiters[key] = published
        done = True
    except NodeError:
        raise
    except (aioredis.RedisError, OSError) as exc:
        raise NodeUnavailable(f"node {node.id}: cannot reach the result store: {exc}") from exc
    finally:
        listener.waiters.pop(key, None)
        if done:  # the caller goes on at once; forgetting the result is not its business (issue 26)
            _later(_forget(listener, key))
        else:
            await listener.unsubscribe(key)
    return meta


_cleanups: set = set()


def _later(coro) -> None:
    """Runs ``coro`` on this loop after the caller has its answer (kept referenced until done)."""
    task = asyncio.ensure_future(coro)
    _cleanups.add(task)
    task.add_done_callback(_cleanups.discard)


async def _forget(listener: "_Listener", key: str) -> None:
    """After a result was read: its channel unsubscribed and its key deleted (nobody else reads
    it; a delete that fails leaves it to the result store's expiry)."""
    await listener.unsubscribe(key)
    try:
        await _result_redis().delete(key)
    except (aioredis.RedisError, OSError) as exc:
        log.debug("result %s not deleted (it expires): %s", key, exc)


def _raise_failure(node: Node, meta: dict, what: str):
    if meta["status"] == states.REVOKED:
        raise NodeTaskFailed(f"{what} on node {node.id} was revoked (expired before it started)", kind="TaskRevokedError")
    exc = meta.get("result") or {}
    if isinstance(exc, dict):
        kind = exc.get("exc_type") or "Exception"
        args = exc.get("exc_message")
        if isinstance(args, (list, tuple)):
            message = str(args[0]) if len(args) == 1 else (str(tuple(args)) if args else kind)
        else:
            message = str(args) if args is not None else kind
    else:
        kind, message = "Exception", str(exc)
    raise NodeTaskFailed(message, kind=kind)


async def _call(node: Node, task: str, kwargs: dict, deadline: float | None, what: str):
    deadline = float(deadline if deadline is not None else settings.AENV_NODE_TASK_DEADLINE)
    fresh = await _sendable(node)
    meta = await _dispatch(fresh, task, kwargs, deadline, what)
    if meta["status"] != states.SUCCESS:
        _raise_failure(fresh, meta, what)
    return meta["result"]


# A node row its caller read from the database this recently (``read_now``) is checked as it
# is before a send, not read again: the lifecycle reads the node with the sandbox (or in the
# placement's claim) a millisecond or two before, and a second read was a query and a thread
# hop per node call (issue 26). A revocation landing in between is as late as one landing just
# after the send's own read would have been.
FRESH_FOR = 1.0


def read_now(node: Node | None) -> Node | None:
    """Marks ``node`` as read from the database just now by the caller (see FRESH_FOR)."""
    if node is not None:
        node._aenv_read_at = time.monotonic()
    return node


async def _sendable(node: Node) -> Node:
    """The node's fresh row if a task may be sent to it: not revoked (nor unjoined where
    joining is required: NodeRefused), and alive (else NodeUnavailable)."""
    read_at = getattr(node, "_aenv_read_at", None)
    if read_at is not None and time.monotonic() - read_at <= FRESH_FOR:
        fresh = node
    else:
        fresh = next(iter([n async for n in Node.objects.filter(pk=node.pk).order_by()[:1]]), None)
    reason = join.refusal(fresh) if fresh is not None else None
    if reason:
        raise NodeRefused(f"{reason}: no task is sent to it")
    if fresh is None or not fresh.is_alive():
        raise NodeUnavailable(f"node {node.pk} is not alive (no recent heartbeat)")
    return fresh


# --- public API ------------------------------------------------------------

def _with_network(kwargs: dict, network: dict | None) -> dict:
    """A task's kwargs plus its ``network`` (a ``vmm.net.spec.NetworkSpec`` as JSON) when given."""
    return {**kwargs, "network": dict(network)} if network is not None else kwargs


def _with_volumes(kwargs: dict, volumes: list[dict] | None) -> dict:
    """A task's kwargs plus its ``volumes`` (``lifecycle.volumes.mounts.for_node``) when it has
    any: a sandbox without volumes sends what nodes without volume support take."""
    return {**kwargs, "volumes": [dict(v) for v in volumes]} if volumes else kwargs


async def boot_sandbox(node: Node, *, sandbox_id: str, image: str, cpu_count: int, memory_mb: int,
                       disk_size_mb: int, env_vars: dict, access_token: str | None,
                       network: dict | None = None, deadline: float | None = None,
                       volumes: list[dict] | None = None) -> dict:
    """Boot a VM on `node` with the network `network` (NetworkSpec JSON; None: the open
    default) and initialise its envd.

    Returns {"envd_host", "envd_port", "guest_host", "pid", "accel", "timings": {phase: ms}}."""
    kwargs = _with_network(dict(sandbox_id=sandbox_id, image=image, cpu_count=cpu_count, memory_mb=memory_mb,
                                disk_size_mb=disk_size_mb, env_vars=dict(env_vars or {}), access_token=access_token),
                           network)
    kwargs = _with_volumes(kwargs, volumes)
    return await _call(node, protocol.BOOT_SANDBOX, kwargs, deadline, f"boot of {sandbox_id}")


async def kill_sandbox(node: Node, *, sandbox_id: str, deadline: float | None = None) -> dict:
    """Stop the sandbox's VM on `node`; {"killed": False} if it was not running there."""
    return await _call(node, protocol.KILL_SANDBOX, {"sandbox_id": sandbox_id}, deadline, f"kill of {sandbox_id}")


async def pause_sandbox(node: Node, *, sandbox_id: str, to_disk: bool = True, memory: bool = True,
                        require_healthy_guest: bool = False, deadline: float | None = None) -> dict:
    """Pause the sandbox's VM on `node` (to disk: the QEMU process exits, RAM and device
    state stay in its state dir; ``memory=False``: only the disk is kept). With
    ``require_healthy_guest`` a guest agent that does not answer fails it (GuestUnresponsive).
    Returns {"to_disk", "memory", "envd_unresponsive", "timings": {phase: ms}}."""
    kwargs = {"sandbox_id": sandbox_id, "to_disk": bool(to_disk), "memory": bool(memory)}
    if require_healthy_guest:
        kwargs["require_healthy_guest"] = True
    return await _call(node, protocol.PAUSE_SANDBOX, kwargs, deadline, f"pause of {sandbox_id}")


async def resume_sandbox(node: Node, *, sandbox_id: str, env_vars: dict, access_token: str | None,
                         memory: bool = True, network: dict | None = None, deadline: float | None = None,
                         volumes: list[dict] | None = None) -> dict:
    """Resume a paused VM on `node` and re-initialise its envd (clock, env vars, token);
    ``memory=False`` cold-boots it on its disk instead of restoring its memory. ``network``
    (NetworkSpec JSON) is given to the VM before it runs again.

    Returns {"envd_host", "envd_port", "guest_host", "pid", "accel", "timings": {phase: ms}}."""
    kwargs = _with_network(dict(sandbox_id=sandbox_id, env_vars=dict(env_vars or {}), access_token=access_token),
                           network)
    if not memory:
        kwargs["memory"] = False
    kwargs = _with_volumes(kwargs, volumes)
    return await _call(node, protocol.RESUME_SANDBOX, kwargs, deadline, f"resume of {sandbox_id}")


async def snapshot_sandbox(node: Node, *, sandbox_id: str, snapshot_id: str, memory: bool = True,
                           commit: bool = True, deadline: float | None = None) -> dict:
    """Capture the running VM into snapshot `snapshot_id` on `node` (it keeps running);
    `commit=False`: kept on `node` only until `commit_snapshot`.

    Returns {"manifest", "size_bytes", "memory", "timings"}; a full store fails with kind "StorageFull"."""
    kwargs = dict(sandbox_id=sandbox_id, snapshot_id=snapshot_id, memory=bool(memory))
    if not commit:  # sent only when asked: a node worker of before it never sees the argument
        kwargs["commit"] = False
    return await _call(node, protocol.SNAPSHOT_SANDBOX, kwargs, deadline, f"snapshot of {sandbox_id}")


async def commit_snapshot(node: Node, *, snapshot_id: str, deadline: float | None = None) -> dict:
    """Store snapshot `snapshot_id`, captured on `node` with `commit=False` (the S3 store: the
    upload other nodes restore it from). Returns {"timings"}."""
    return await _call(node, protocol.COMMIT_SNAPSHOT, {"snapshot_id": snapshot_id}, deadline,
                       f"storing of snapshot {snapshot_id}")


async def index_snapshot(node: Node, *, snapshot_id: str, deadline: float | None = None) -> dict:
    """Hand snapshot `snapshot_id`, captured on `node` with `commit=False`, to the other nodes
    before its upload (its pending manifest; its chunks from `node` by peer fetch). Only for a
    node whose heartbeat says ``protocol.FORK_HANDOFF``. Returns {"chunks", "bytes", "timings"}."""
    return await _call(node, protocol.INDEX_SNAPSHOT, {"snapshot_id": snapshot_id}, deadline,
                       f"hand-off of snapshot {snapshot_id}")


async def restore_sandbox(node: Node, *, sandbox_id: str, snapshot_id: str, env_vars: dict,
                          access_token: str | None, source_token: str | None = None,
                          network: dict | None = None, template: bool = False,
                          deadline: float | None = None, volumes: list[dict] | None = None,
                          pending_wait: float = 0.0) -> dict:
    """Start sandbox `sandbox_id` on `node` from snapshot `snapshot_id` with the network
    `network` (NetworkSpec JSON) and initialise its envd (own token, handed over from
    `source_token`). ``template``: the snapshot is a built template's (the VM gets its own
    RAM copy, as from a booted template). ``pending_wait`` (s): the snapshot was handed over
    before its upload ended (``index_snapshot``; a node with ``protocol.FORK_HANDOFF``).
    Returns what boot_sandbox returns."""
    kwargs = _with_network(dict(sandbox_id=sandbox_id, snapshot_id=snapshot_id, env_vars=dict(env_vars or {}),
                                access_token=access_token, source_token=source_token or None), network)
    if template:
        kwargs["template"] = True
    if pending_wait:  # sent only when asked: a node worker of before it never sees the argument
        kwargs["pending_wait"] = float(pending_wait)
    kwargs = _with_volumes(kwargs, volumes)
    return await _call(node, protocol.RESTORE_SANDBOX, kwargs, deadline, f"restore of {sandbox_id}")


async def fork_sandbox(node: Node, *, sandbox_id: str, env_vars: dict, access_token: str | None,
                       children: list[dict], deadline: float | None = None,
                       volumes: list[dict] | None = None) -> dict:
    """Fork `sandbox_id` on `node` into `children` ({"sandbox_id", "env_vars", "access_token",
    "network"?: NetworkSpec JSON the child must end up with}).

    Returns {"parent": {"ok", "error"?}, "children": [{"sandbox_id", "ok", "envd_host", "envd_port",
    "guest_host", "pid", "timings"} | {"sandbox_id", "ok": False, "kind", "message"}], "timings"}."""
    kwargs = dict(sandbox_id=sandbox_id, env_vars=dict(env_vars or {}), access_token=access_token,
                  children=[_with_network({"sandbox_id": c["sandbox_id"], "env_vars": dict(c.get("env_vars") or {}),
                                           "access_token": c.get("access_token") or None}, c.get("network"))
                            for c in children])
    kwargs = _with_volumes(kwargs, volumes)
    return await _call(node, protocol.FORK_SANDBOX, kwargs, deadline, f"fork of {sandbox_id}")


async def update_network(node: Node, *, sandbox_id: str, network: dict, deadline: float | None = None,
                         access_token: str | None = None) -> dict:
    """Replace the egress policy of the sandbox's VM on `node` with `network` (NetworkSpec
    JSON); fails with kind "UnsupportedNetworkPolicy" when its backend cannot enforce it
    (nothing changes then). A policy with rules needs `access_token` (the sandbox's envd token,
    sealed in transit): the guest is made to trust the node's CA first. Returns {"timings": {"total_ms"}}."""
    kwargs = {"sandbox_id": sandbox_id, "network": dict(network)}
    if access_token:
        kwargs["access_token"] = access_token
    return await _call(node, protocol.UPDATE_NETWORK, kwargs, deadline, f"network update of {sandbox_id}")


async def delete_snapshot_files(node: Node, *, snapshot_id: str, deadline: float | None = None) -> dict:
    """Remove snapshot `snapshot_id`'s files from `node`; {"deleted": False} if there were none."""
    return await _call(node, protocol.DELETE_SNAPSHOT_FILES, {"snapshot_id": snapshot_id}, deadline,
                       f"deletion of snapshot {snapshot_id}")


async def build_template(node: Node, *, build_id: str, template_id: str, spec: dict, cpu_count: int,
                         memory_mb: int, disk_size_mb: int, pickup_timeout: float | None = None) -> str:
    """Hand template build ``build_id`` of ``template_id`` to ``node``'s builder and return
    at once (a build takes minutes): the builder reports its log and outcome through
    ``template_builds.progress``, not through a task result. ``spec`` is the normalised
    start body (``lifecycle.templates.start.node_spec``); the shape is the build VM's
    and the template's. A node that does not pick the task up within ``pickup_timeout``
    seconds (default ``AENV_TEMPLATE_PICKUP_TIMEOUT``) never runs it.

    Returns the task id; raises NodeUnavailable when the node is not alive or the broker
    cannot be reached."""
    expires = float(pickup_timeout if pickup_timeout is not None else settings.AENV_TEMPLATE_PICKUP_TIMEOUT)
    fresh = await _sendable(node)
    kwargs = dict(build_id=str(build_id), template_id=template_id, spec=dict(spec), cpu_count=int(cpu_count),
                  memory_mb=int(memory_mb), disk_size_mb=int(disk_size_mb))
    return await _send(protocol.BUILD_TEMPLATE, fresh, kwargs, expires)
