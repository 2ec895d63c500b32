"""The node worker's Prometheus ``/metrics`` (``prometheus-client``). With
``AENV_METRICS_TOKEN`` it is served on ``AENV_NODE_ADDRESS:AENV_NODE_METRICS_PORT`` to
requests that carry ``Authorization: Bearer <token>`` only (401 otherwise); without a token
on ``127.0.0.1`` only, so nobody off the host reads it (AgentENV's are open to anyone who can
reach the node: the figures tell an attacker how busy and how big each node is).

What it holds: how long each VM operation took on this node (every node task, timed from
Celery's task signals, so ``agent.tasks`` stays as it is), template builds by outcome, the
sandbox metrics sampler's rounds, and gauges read at scrape time: VMs running here, the
host's CPU, memory and disks from the newest heartbeat sample, and the chunk cache's figures
(lazy restores) from the node's chunkfs daemon while it runs. What placement reserves
here is the control plane's to say: the API's ``/metrics`` has it per node.
"""
from __future__ import annotations

import logging
import threading
import time
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from celery import signals
from prometheus_client import REGISTRY, Counter, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from nodes.metrics_auth import CHALLENGE, UNAUTHORIZED, bearer_matches

log = logging.getLogger(__name__)

# VM operations run from ~0.05 s (an in-memory pause) to minutes (a cold boot under TCG).
OPERATION_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

VM_OPERATION_SECONDS = Histogram(
    "aenv_node_vm_operation_seconds", "Node task durations: boot, restore, pause, resume, fork, snapshot, kill, ...",
    ["operation", "outcome"], buckets=OPERATION_BUCKETS)
TEMPLATE_BUILDS = Counter("aenv_node_template_builds", "Template builds this node ran, by outcome", ["outcome"])
METRICS_ASKED = Counter("aenv_node_sandbox_metrics_asked", "Sandbox envd /metrics requests made by the sampler")
METRICS_STORED = Counter("aenv_node_sandbox_metrics_stored", "Sandbox metric samples stored")

TASK_PREFIX = "nodes."
_OPERATION_NAMES = {"boot_sandbox": "boot", "restore_sandbox": "restore", "pause_sandbox": "pause",
                    "resume_sandbox": "resume", "fork_sandbox": "fork", "snapshot_sandbox": "snapshot",
                    "kill_sandbox": "kill"}


def operation_of(task_name: str) -> str:
    """``nodes.boot_sandbox`` → ``boot``; other node tasks keep their short name."""
    short = task_name[len(TASK_PREFIX):] if task_name.startswith(TASK_PREFIX) else task_name
    return _OPERATION_NAMES.get(short, short)


class TaskTimer:
    """Times node tasks between Celery's ``task_prerun`` and ``task_postrun`` (sent in the
    thread that runs the task, also when it raised)."""

    def __init__(self, clock=time.perf_counter):
        self._clock = clock
        self._started: dict[str, float] = {}
        self._lock = threading.Lock()

    def started(self, task_id, task=None, **_):
        if task is not None and str(task.name).startswith(TASK_PREFIX):
            with self._lock:
                self._started[task_id] = self._clock()

    def finished(self, task_id, task=None, retval=None, state=None, **_):
        with self._lock:
            t0 = self._started.pop(task_id, None)
        if t0 is None or task is None:
            return
        outcome = "ok" if state == "SUCCESS" else "error"
        operation = operation_of(task.name)
        VM_OPERATION_SECONDS.labels(operation, outcome).observe(self._clock() - t0)
        if operation == "build_template":
            status = retval.get("status") if isinstance(retval, dict) else None
            TEMPLATE_BUILDS.labels(status or outcome).inc()

    def connect(self) -> None:
        """Once per process: a second timer connected later is ignored (same dispatch uid)."""
        signals.task_prerun.connect(self.started, weak=False, dispatch_uid="aenv-node-task-timer-prerun")
        signals.task_postrun.connect(self.finished, weak=False, dispatch_uid="aenv-node-task-timer-postrun")


def count_round(asked: int, stored: int) -> None:
    """The sampler's ``on_round``."""
    METRICS_ASKED.inc(asked)
    METRICS_STORED.inc(stored)


class NodeCollector:
    """Gauges read at scrape time: ``count_vms()`` and ``host()`` (the newest heartbeat
    sample, ``Node.host``'s shape), labelled with the node id."""

    def __init__(self, node_id: str, count_vms, host, capacity: tuple[int, int] = (0, 0), chunk_cache=None):
        """``chunk_cache``: the node's chunk cache figures now (``host.chunkCache``'s shape, from
        the chunkfs daemon's ``stats``; None while it does not run)."""
        self.node_id = node_id
        self.count_vms = count_vms
        self.host = host
        self.capacity = capacity
        self.chunk_cache = chunk_cache

    def describe(self):
        return []  # collected at scrape time only: nothing to check at registration

    def collect(self):
        node = [self.node_id]

        def gauge(name: str, doc: str, value, labels=(), label_values=()):
            g = GaugeMetricFamily(name, doc, labels=["node", *labels])
            g.add_metric([*node, *label_values], value)
            return g

        try:
            yield gauge("aenv_node_vms", "VMs the node's driver runs (paused in memory included)", self.count_vms())
        except Exception:  # noqa: BLE001 - a scrape never fails on one figure
            log.exception("counting VMs for /metrics failed")
        yield from self._chunk_cache()
        yield gauge("aenv_node_capacity_vcpus", "vCPUs placement may reserve here", self.capacity[0])
        yield gauge("aenv_node_capacity_memory_bytes", "Memory placement may reserve here", self.capacity[1] * 2**20)
        host = self.host() or {}
        if not host:
            return
        yield gauge("aenv_node_host_cpu_percent", "Host CPU busy %, between the last two heartbeats",
                    host.get("cpuPercent", 0.0))
        yield gauge("aenv_node_host_cpu_count", "Host CPU cores", host.get("cpuCount", 0))
        yield gauge("aenv_node_host_memory_used_bytes", "Host memory in use", host.get("memoryUsedBytes", 0))
        yield gauge("aenv_node_host_memory_total_bytes", "Host memory", host.get("memoryTotalBytes", 0))
        used = GaugeMetricFamily("aenv_node_host_disk_used_bytes", "Used bytes of the filesystems aenv writes to",
                                 labels=["node", "mount_point"])
        total = GaugeMetricFamily("aenv_node_host_disk_total_bytes", "Size of the filesystems aenv writes to",
                                  labels=["node", "mount_point"])
        for disk in host.get("disks") or []:
            used.add_metric([self.node_id, disk.get("mountPoint", "")], disk.get("usedBytes", 0))
            total.add_metric([self.node_id, disk.get("mountPoint", "")], disk.get("totalBytes", 0))
        yield used
        yield total


    def _chunk_cache(self):
        """The chunk cache (lazy restores: chunkfs) as its daemon counts it now."""
        if self.chunk_cache is None:
            return
        try:
            figures = self.chunk_cache()
        except Exception:  # noqa: BLE001 - a scrape never fails on one figure
            log.exception("reading the chunk cache's figures for /metrics failed")
            return
        if not figures:
            return
        for key, name, doc in CHUNK_CACHE_GAUGES:
            g = GaugeMetricFamily(name, doc, labels=["node"])
            g.add_metric([self.node_id], figures.get(key, 0))
            yield g
        for key, name, doc in CHUNK_CACHE_COUNTERS:
            c = CounterMetricFamily(name, doc, labels=["node"])
            c.add_metric([self.node_id], figures.get(key, 0))
            yield c


# host.chunkCache key, metric name, help (counters restart from 0 with the chunkfs daemon)
CHUNK_CACHE_GAUGES = (
    ("hitRatio", "aenv_node_chunk_cache_hit_ratio", "Chunk cache reads served without a fetch, of all (since the daemon started)"),
    ("sizeBytes", "aenv_node_chunk_cache_size_bytes", "Bytes of chunks the node's chunk cache holds"),
    ("limitBytes", "aenv_node_chunk_cache_limit_bytes", "The chunk cache's bound (AENV_CHUNK_CACHE_MB)"),
    ("entries", "aenv_node_chunk_cache_entries", "Chunks the chunk cache holds"),
    ("pinnedBytes", "aenv_node_chunk_cache_pinned_bytes", "Bytes of chunks pinned (never evicted)"),
)
CHUNK_CACHE_COUNTERS = (
    ("hits", "aenv_node_chunk_cache_hits", "Chunk reads found in the cache"),
    ("misses", "aenv_node_chunk_cache_misses", "Chunk reads that had to fetch"),
    ("evictions", "aenv_node_chunk_cache_evictions", "Chunks evicted to stay under the bound"),
    ("fetchedBytes", "aenv_node_chunk_cache_fetched_bytes", "Bytes fetched from the store (or the node's own files)"),
    ("corrupt", "aenv_node_chunk_cache_corrupt", "Chunks that came with wrong bytes (refetched or refused)"),
    # peer fetch (AENV_CHUNK_PEER_FETCH): where fetched chunks came from, and what this node served its peers
    ("storeChunks", "aenv_node_chunk_cache_store_chunks", "Chunks fetched from the snapshot store"),
    ("storeBytes", "aenv_node_chunk_cache_store_bytes", "Bytes fetched from the snapshot store"),
    ("storeWireBytes", "aenv_node_chunk_cache_store_wire_bytes",
     "Bytes fetched from the snapshot store as they crossed the wire (compressed chunks: AENV_S3_CHUNK_COMPRESSION)"),
    ("peerChunks", "aenv_node_chunk_cache_peer_chunks", "Chunks fetched from peer nodes (their caches or files)"),
    ("peerBytes", "aenv_node_chunk_cache_peer_bytes", "Bytes fetched from peer nodes (their caches or files)"),
    ("peerErrors", "aenv_node_chunk_cache_peer_errors", "Peer requests that failed (that peer is skipped a while)"),
    ("peerCorrupt", "aenv_node_chunk_cache_peer_corrupt", "Chunks a peer answered with wrong bytes (never used)"),
    ("servedChunks", "aenv_node_chunk_cache_served_chunks", "Chunks this node served to peers (cache or own files)"),
    ("servedBytes", "aenv_node_chunk_cache_served_bytes", "Bytes this node served to peers (cache or own files)"),
    ("servedFileChunks", "aenv_node_chunk_cache_served_file_chunks",
     "Chunks this node served to peers from its own snapshot and image files"),
    ("servedFileBytes", "aenv_node_chunk_cache_served_file_bytes",
     "Bytes this node served to peers from its own snapshot and image files"),
    ("servedRefused", "aenv_node_chunk_cache_served_refused", "Peer requests refused for a wrong or missing token"),
)

LOOPBACK = "127.0.0.1"


def guarded(app, token: str):
    """The WSGI ``app`` behind the bearer ``token`` (none: open, which only the loopback
    bind makes acceptable)."""
    def serve(environ, start_response):
        if token and not bearer_matches(environ.get("HTTP_AUTHORIZATION"), token):
            start_response("401 Unauthorized", [("Content-Type", "text/plain; charset=utf-8"),
                                                ("WWW-Authenticate", CHALLENGE)])
            return [UNAUTHORIZED]
        return app(environ, start_response)
    return serve


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - every scrape would be a log line
        pass


def start_exporter(address: str, port: int, collector: NodeCollector, registry=REGISTRY,
                   token: str = "") -> int | None:
    """Registers ``collector``, connects the task timer and serves ``/metrics`` in a thread:
    on ``address:port`` behind the bearer ``token``, or on ``127.0.0.1:port`` without one.
    Returns the port, or None if it is off (0) or taken (a node never fails to start over
    its metrics: the reason is logged)."""
    registry.register(collector)
    TaskTimer().connect()
    if not port:
        return None
    bind = address if token else LOOPBACK
    try:
        server = make_server(bind, port, guarded(make_wsgi_app(registry), token), _Server, _QuietHandler)
    except OSError as exc:
        log.warning("node metrics: cannot listen on %s:%d (%s); no Prometheus endpoint on this node",
                    bind, port, exc)
        return None
    threading.Thread(target=server.serve_forever, name="node-metrics", daemon=True).start()
    if token:
        log.info("node metrics: Prometheus /metrics on http://%s:%d/metrics (bearer token)", bind, port)
    else:
        log.info("node metrics: Prometheus /metrics on http://%s:%d/metrics only (no AENV_METRICS_TOKEN)",
                 bind, port)
    return port
