"""Peer fetch on a node (issue 24, ``AENV_CHUNK_PEER_FETCH``; off by default): the node's
chunkfs daemon serves its chunk cache and the chunks of its own files (the snapshots it took,
its image builds, its downloads: the store's own-file index, handed over each round when it
changed) to the other nodes, and asks them for a chunk before the snapshot store.

Who the peers are: the database's live nodes (a heartbeat within
``AENV_NODE_HEARTBEAT_TIMEOUT``, not revoked) that advertise a ``chunkPeerPort`` in their
heartbeat's host figures, at their ``Node.address``; read again every ``REFRESH`` seconds and
handed to the daemon over its control socket (which also restarts a daemon that went away:
its warm cache is served again).

The credential: a bearer token derived by HKDF-SHA256 from ``DJANGO_SECRET_KEY`` (which every
node and the control plane of a deployment already share: ``nodes.sealed``) under its own
label, so no new secret is distributed and the token reveals nothing of the key. Nodes with
another key are refused (401) and their reads go to the store."""
from __future__ import annotations

import logging
from datetime import timedelta

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from django.conf import settings
from django.utils import timezone

from agent.periodic import Periodic
from chunkfs.client import ChunkfsError
from nodes.models import Node

log = logging.getLogger(__name__)

REFRESH = 15.0  # seconds: a node that joins is asked within this (and its heartbeat's) delay
_INFO = b"aenv chunk peers v1"
PORT_KEY = "chunkPeerPort"  # the heartbeat's host figure that says a node serves its chunks


def peer_token(secret: str) -> str:
    """The deployment's chunk peer token (64 hex digits) from its secret key."""
    if not secret:
        raise ValueError("peer fetch needs DJANGO_SECRET_KEY")
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_INFO).derive(secret.encode()).hex()


def host_port(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def live_peers(node_id: str, now=None) -> list[str]:
    """``host:port`` of every other live node that serves its chunks."""
    cutoff = (now or timezone.now()) - timedelta(seconds=settings.AENV_NODE_HEARTBEAT_TIMEOUT)
    rows = (Node.objects.filter(revoked_at__isnull=True, last_heartbeat_at__gte=cutoff).exclude(pk=node_id)
            .values_list("address", "host"))
    peers = []
    for address, host in rows:
        port = host.get(PORT_KEY) if isinstance(host, dict) else None
        if address and isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536:
            peers.append(host_port(address, port))
    return sorted(set(peers))


class ChunkPeers(Periodic):
    """Keeps the node's chunkfs daemon serving on ``address:port`` and asking the live peers.
    ``port`` is what the daemon listens on once it does (the heartbeat's ``chunkPeerPort``),
    else None."""

    def __init__(self, node_id: str, lazy, address: str, port: int, token: str, interval: float = REFRESH,
                 own_files=None):
        """``own_files``: a callable giving ``{path: [[offset, length, sha], ...]}`` of the node's
        own files (``S3Store.own_files``), whose chunks the daemon then serves too; None: none."""
        super().__init__(f"chunk-peers-{node_id}", interval, at_once=True)
        self.node_id = node_id
        self.lazy = lazy  # agent.stores.lazy.LazyRestores
        self.own_files = own_files
        self._own_failing = ""
        self.listen = host_port(address, port)
        self.token = token
        self.port: int | None = None
        self._failing = ""  # the last round's error, logged once

    def round(self) -> None:
        try:
            peers = live_peers(self.node_id)
            listening = self.lazy.set_peers(self.listen, self.token, peers)
        except ChunkfsError as exc:  # e.g. the port is taken: said once, tried again each round
            self.port = None
            if str(exc) != self._failing:
                log.warning("peer fetch: the chunkfs daemon cannot serve or ask peers: %s", exc)
            self._failing = str(exc)
            return
        except Exception:
            self.port = None
            raise
        if self._failing:
            log.info("peer fetch: the chunkfs daemon serves its cache on %s again", listening)
        self._failing = ""
        self.port = int(listening.rpartition(":")[2]) if listening else None
        if listening and self.own_files is not None:
            self._offer_own()

    def _offer_own(self) -> None:
        """The node's own files' chunks to the daemon (when they changed); a failure only
        means peers get the cache alone this round (said once)."""
        try:
            if self.lazy.offer_own(self.own_files()):
                log.info("peer fetch: the chunkfs daemon serves the chunks of this node's own files too")
            self._own_failing = ""
        except (ChunkfsError, OSError, ValueError) as exc:
            if str(exc) != self._own_failing:
                log.warning("peer fetch: this node's own files are not served to peers: %s", exc)
            self._own_failing = str(exc)


def offer_own_now(store) -> bool:
    """The node's own files' chunks to its chunkfs daemon at once, not at the next round: a
    fork's capture just handed to other nodes (``index_snapshot``) is read from here by them
    straight away. True if the daemon took a new map; ChunkfsError if it refused."""
    lazy = getattr(store, "lazy", None)
    if lazy is None:
        return False
    return bool(lazy.offer_own(store.own_files()))


def start_chunk_peers(node_id: str, store) -> ChunkPeers | None:
    """The node's peer fetch, started, when ``AENV_CHUNK_PEER_FETCH`` is on and the store
    restores lazily (S3 with ``AENV_LAZY_RESTORE``: the chunk cache is the chunkfs daemon's)."""
    lazy = getattr(store, "lazy", None)
    if not settings.AENV_CHUNK_PEER_FETCH:
        client = lazy.running_client() if lazy is not None else None
        if client is not None:  # it outlives the worker: turned on by an earlier start, off now
            try:
                client.request({"op": "peers"})
            except ChunkfsError as exc:
                log.warning("turning the chunkfs daemon's peer fetch off failed: %s", exc)
        return None
    if lazy is None:
        log.warning("AENV_CHUNK_PEER_FETCH is on but this node has no chunk cache to share "
                    "(it needs the S3 store with lazy restores): no peer fetch")
        return None
    peers = ChunkPeers(node_id, lazy, settings.AENV_NODE_ADDRESS, settings.AENV_CHUNK_PEER_PORT,
                       peer_token(settings.SECRET_KEY), own_files=getattr(store, "own_files", None))
    peers.start()
    log.info("peer fetch on: serving the chunk cache on %s to the other nodes, asking them before the store",
             peers.listen)
    return peers
