"""Lazy restores: a snapshot of the S3 store restored from lazily filled files instead of
downloaded whole (issue 24).

Why: a node that lacks a snapshot used to fetch every byte of it (disk layers, RAM, the
image files it ships) before the restore could start. Here its files are mounted through
the node's chunkfs daemon (``chunkfs``: FUSE files over one bounded chunk cache), and the
VM reads only the chunks it touches. Every existing code path keeps opening *paths*:

- ``AENV_HOME/lazy/snapshots/<id>/``: the snapshot as the driver sees it: ``manifest.json``
  (paths localized to this dir) and one symlink per file into the mount
  (``AENV_HOME/chunkfs/mnt/<id>/<name>``). ``SnapshotManifest.load`` and the driver's
  ``adopt_snapshot`` work on it as on a download; the mount is writable (a copy-on-write
  overlay in the daemon), so QEMU's ``qemu-img rebase -u`` header rewrite lands there and the
  store's chunks are never written.
- The daemon is started by the node on first need (``ensure_daemon``; it outlives worker
  restarts). A mount that vanished (the daemon restarted) is mounted and adopted again on
  the next lookup.
- Chunks this node's own files already hold (``LocalChunks``: image builds, downloads) are
  handed to the mount as ``local`` and read from those files (verified) before the store.
- Prefetch: the first lazy restore of a snapshot records the order its chunks were first
  touched; once the VM answered (plus a short settle) ``S3Store.restored`` stores it as
  ``snapshots/<id>/prefetch.json``, and later mounts fetch those chunks in the background
  in that order.

``AENV_LAZY_RESTORE`` (docs/operations.md) turns it on or off; default on where FUSE works.
Whole-file download stays the fallback (off, or a mount that fails: logged)."""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

from chunkfs.client import ChunkfsClient, ChunkfsError, ensure_daemon
from chunkfs.compression import ZSTD
from chunkfs.sources import STORE_WAIT

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"


def fuse_available() -> bool:
    """FUSE mounts can be made here: the device and libfuse3's mount helper exist."""
    return os.path.exists("/dev/fuse") and shutil.which("fusermount3") is not None


def lazy_enabled(value: str | bool | None) -> bool:
    """``AENV_LAZY_RESTORE``: on/off, or ``auto`` (the default): on where FUSE works."""
    if isinstance(value, bool):
        return value
    v = (value or "auto").strip().lower()
    if v in ("1", "on", "true", "yes"):
        return True
    if v in ("0", "off", "false", "no"):
        return False
    return fuse_available()


CACHE_FIGURES = {"hits": "hits", "misses": "misses", "hit_ratio": "hitRatio", "size_bytes": "sizeBytes",
                 "limit_bytes": "limitBytes", "entries": "entries", "evictions": "evictions",
                 "fetched_bytes": "fetchedBytes", "corrupt": "corrupt", "pinned_bytes": "pinnedBytes",
                 # peer fetch (agent.chunk_peers): where fetched chunks came from, what peers got here
                 "store_chunks": "storeChunks", "store_bytes": "storeBytes", "store_wire_bytes": "storeWireBytes",
                 "peer_chunks": "peerChunks",
                 "peer_bytes": "peerBytes", "peer_errors": "peerErrors", "peer_corrupt": "peerCorrupt",
                 "served_chunks": "servedChunks", "served_bytes": "servedBytes", "served_refused": "servedRefused",
                 "served_file_chunks": "servedFileChunks", "served_file_bytes": "servedFileBytes",
                 "own_chunks": "ownChunks"}


def cache_figures(stats: dict | None) -> dict | None:
    """The chunk cache's stats (``ChunkCache.stats``) as the heartbeat's ``host.chunkCache``
    (camelCase, numbers only), or None."""
    if not isinstance(stats, dict):
        return None
    return {key: stats[name] for name, key in CACHE_FIGURES.items() if isinstance(stats.get(name), (int, float))}


def _takes_store_wait(pong: dict) -> bool:
    """Whether a daemon's ping answer says it takes ``store_wait`` mounts."""
    return STORE_WAIT in (pong.get("features") or ())


class LazyMountFailed(Exception):
    """The snapshot could not be mounted lazily (the caller downloads it instead)."""


class LazyRestores:
    """The node's lazily restored snapshots and its chunkfs daemon."""

    def __init__(self, home: Path, *, limit_mb: int, daemon_env: dict, files_in_use: Callable[[], Iterable[str]],
                 read_deadline: float | None = None):
        """``daemon_env``: what the daemon's environment adds to this process's (the S3
        store's ``AENV_S3_*``); ``files_in_use``: the VM driver's (paths its VMs read);
        ``read_deadline``: the daemon's ``--read-deadline`` (``AENV_CHUNK_READ_DEADLINE``;
        None: its default), how long a read waits for a chunk before it fails with EIO."""
        home = Path(home).absolute()
        self.root = home / "lazy" / "snapshots"
        self.run_dir = home / "chunkfs"
        self.control = self.run_dir / "control.sock"
        self.mountpoint = self.run_dir / "mnt"
        self.cache_dir = home / "cache" / "chunks"
        self.log_path = self.run_dir / "daemon.log"
        self.limit_mb = int(limit_mb)
        self.daemon_env = {k: str(v) for k, v in daemon_env.items()}
        self.files_in_use = files_in_use
        self.peer_config: dict | None = None  # the daemon's "peers" op (agent.chunk_peers); None: left as is
        self._own_sent: tuple[int, dict] | None = None  # (daemon pid, files) last handed over ("own" op)
        self.read_deadline = read_deadline

    # ------------------------------------------------------------------ the daemon

    def client(self) -> ChunkfsClient:
        """The node's daemon, started now if it does not answer (and told its peers)."""
        client = self._daemon()
        if self.peer_config is not None:
            try:
                client.request({"op": "peers", **self.peer_config})
            except ChunkfsError as exc:  # restores go on from the store
                log.warning("the chunkfs daemon refused its peers: %s", exc)
        return client

    def set_peers(self, listen: str, token: str, peers: list[str], *, start: bool = True) -> str:
        """Peer fetch (chunkfs's ``peers`` op): serve the cache on ``listen`` ("": not at all)
        and ask ``peers``; kept for daemons started later. ``start``: start the daemon if it
        does not run (else only a running one is told). Returns where it listens ("": nowhere);
        ChunkfsError if the daemon cannot be had or refuses."""
        self.peer_config = {"listen": listen, "token": token, "peers": list(peers)}
        client = self._daemon() if start else self.running_client()
        if client is None:
            return ""
        return str(client.request({"op": "peers", **self.peer_config})["listen"])

    def offer_own(self, files: dict) -> bool:
        """Hands the running daemon the chunks inside this node's own files (``{path: [[offset,
        length, sha], ...]}``, chunkfs's ``own`` op), which it then serves to peers besides its
        cache; only when they changed or the daemon is another one than last time (a restart
        forgets them). True if sent; ChunkfsError if the daemon refuses (e.g. one from before
        the op: its peers get its cache only)."""
        client = self.running_client()
        if client is None:
            return False
        pid = int(client.ping()["pid"])
        if self._own_sent is not None and self._own_sent == (pid, files):
            return False
        ChunkfsClient(self.control, timeout=30.0).request({"op": "own", "files": files})  # can be megabytes
        self._own_sent = (pid, files)
        return True

    def _daemon(self) -> ChunkfsClient:
        return ensure_daemon(self.control, mountpoint=self.mountpoint, cache_dir=self.cache_dir,
                             limit_mb=self.limit_mb, log_path=self.log_path,
                             extra_args=None if self.read_deadline is None else
                             ["--read-deadline", f"{float(self.read_deadline):g}"],
                             env={**os.environ, **self.daemon_env, "AENV_CHUNK_CACHE_MB": str(self.limit_mb)})

    def copy_ram(self, src: Path, dst: Path) -> bool:
        """``vmm.qemu.ramfile.LazyCopier``: a file of one of this daemon's mounts (``src``, or
        the symlink to it a lazy snapshot holds) written into ``dst`` by the daemon itself,
        without reading it through FUSE; False for any other file or a daemon older than that."""
        try:
            mount_id, name = Path(os.path.realpath(src)).relative_to(self.mountpoint).parts
        except ValueError:  # not under the mountpoint, or not <mount>/<file>
            return False
        try:
            self._daemon().copy_out(mount_id, name, dst)
        except ChunkfsError as exc:
            if exc.code == "unknown_op":  # a daemon started before copy_out (it outlives upgrades)
                return False
            raise
        return True

    def _running(self) -> tuple[ChunkfsClient, dict] | None:
        """The daemon if it runs, with its ping's answer (never starts one)."""
        if not self.control.exists():
            return None
        client = ChunkfsClient(self.control, timeout=2.0)
        try:
            return client, client.ping()
        except ChunkfsError:
            return None

    def running_client(self) -> ChunkfsClient | None:
        """The daemon if it runs (never starts one: for figures)."""
        running = self._running()
        return running[0] if running is not None else None

    def takes_store_wait(self) -> bool:
        """Whether the running daemon mounts captures still uploading (``store_wait``)."""
        running = self._running()
        return running is not None and _takes_store_wait(running[1])

    def cache_stats(self) -> dict | None:
        """The chunk cache's stats from the running daemon, with where its chunks came from
        (peers, the store) and what it served its peers, or None."""
        client = self.running_client()
        if client is None:
            return None
        try:
            stats = client.stats()
        except ChunkfsError:
            return None
        cache = stats.get("cache")
        return {**stats.get("fetches", {}), **cache} if isinstance(cache, dict) else None

    def mount_stats(self, snapshot_id: str) -> dict | None:
        client = self.running_client()
        if client is None:
            return None
        try:
            return client.stats(snapshot_id)["mounts"].get(snapshot_id)
        except ChunkfsError:
            return None

    # ------------------------------------------------------------------ entries

    def path(self, snapshot_id: str) -> Path:
        return self.root / snapshot_id

    @contextlib.contextmanager
    def lock(self, snapshot_id: str):
        """Held while one snapshot is mounted or removed."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / f".lock-{snapshot_id}", "a") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def lookup(self, snapshot_id: str) -> Path | None:
        """The complete entry whose mount is alive, or None (absent, or its daemon restarted:
        its links point into nothing)."""
        final = self.path(snapshot_id)
        if not (final / MANIFEST).is_file():
            return None
        try:
            for link in final.iterdir():
                if link.is_symlink() and not os.path.exists(link):
                    return None
        except OSError:
            return None
        return final

    def ids(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir()
                      if not p.name.startswith(".") and (p / MANIFEST).is_file())

    def install(self, snapshot_id: str, *, chunk_size: int, files: dict, manifest: dict, adopt: Callable,
                local: dict | None = None, prefetch: list | None = None, record: bool = False,
                pieces: list | None = None, store_wait: float = 0.0) -> Path:
        """Mounts ``files`` ({name: {size, chunks}}) writable, makes the entry (links +
        ``manifest``, whose paths already name ``path(snapshot_id)``), lets ``adopt(dir)``
        (the driver's adopt_snapshot) rewrite what it must, and installs it by one rename.
        Call with ``lock(snapshot_id)`` held. Raises LazyMountFailed when the daemon cannot
        be had or refuses the mount; ``adopt``'s own errors pass through. ``store_wait`` (s):
        a chunk no source has yet is asked for again until then (a capture still uploading)."""
        final = self.path(snapshot_id)
        names = set(files)
        prefetch = [p for p in prefetch or [] if isinstance(p, list) and len(p) == 2 and p[0] in names]
        try:
            client = self.client()
            pong = client.ping()
            if ZSTD not in (pong.get("encodings") or ()):  # it would take compressed chunks for corrupt
                raise LazyMountFailed("the chunkfs daemon predates compressed chunks: restart it with the node's VMs")
            if store_wait and not _takes_store_wait(pong):  # it would fail reads at once
                raise LazyMountFailed("the chunkfs daemon predates mounts of captures still uploading")
            try:
                client.unmount(snapshot_id)  # a previous incarnation's (this entry was not complete)
            except ChunkfsError as exc:
                if exc.code != "not_found":
                    raise
            where = client.mount(snapshot_id, chunk_size, files, prefetch=prefetch, record=record,
                                 writable=True, local=local, pieces=pieces, store_wait=store_wait)
        except ChunkfsError as exc:
            raise LazyMountFailed(str(exc)) from exc
        for leftover in self.root.glob(f".tmp-{snapshot_id}-*"):  # an install that crashed (we hold its lock)
            shutil.rmtree(leftover, ignore_errors=True)
        staging = self.root / f".tmp-{snapshot_id}-{uuid.uuid4().hex[:8]}"
        try:
            staging.mkdir(parents=True)
            for name in files:
                (staging / name).symlink_to(where / name)
            (staging / MANIFEST).write_text(json.dumps(manifest, indent=2))
            adopt(staging)
            self._discard(final)
            os.rename(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            self._unmount(snapshot_id)
            raise
        log.info("snapshot %s mounted lazily at %s (%d files, %d chunks local, %d to prefetch%s)", snapshot_id,
                 where, len(files), len(local or {}), len(prefetch), ", recording" if record else "")
        return final

    def pin(self, snapshot_id: str) -> int:
        """Fetches every chunk of the snapshot's mount into the cache and pins them until its
        unmount: a VM here still reads the files, and the store is about to lose the chunks
        (the snapshot is deleted). Returns the chunks pinned; LazyMountFailed if not all could be."""
        client = self.running_client()
        if client is None:
            raise LazyMountFailed(f"the chunkfs daemon does not run: snapshot {snapshot_id}'s chunks cannot be kept")
        try:
            return int(client.pin(snapshot_id)["pinned"])
        except ChunkfsError as exc:
            raise LazyMountFailed(str(exc)) from exc

    def in_use(self, snapshot_id: str) -> bool:
        inside = f"{self.path(snapshot_id)}/"
        return any(str(p).startswith(inside) for p in self.files_in_use())

    def remove(self, snapshot_id: str, force: bool = False) -> bool:
        """Unmounts the snapshot and removes its entry, unless a VM on this node still uses
        it (``force``: even then). True if something was removed."""
        final = self.path(snapshot_id)
        with self.lock(snapshot_id):
            if not force and final.exists() and self.in_use(snapshot_id):
                log.warning("lazy snapshot %s is still used by a VM on this node; kept", snapshot_id)
                return False
            existed = self._discard(final)
            self._unmount(snapshot_id)
        return existed  # the lock file stays: unlinking it would let two holders lock different files

    def _discard(self, final: Path) -> bool:
        if not final.exists():
            return False
        doomed = final.with_name(f".tmp-rm-{final.name}-{uuid.uuid4().hex[:8]}")
        os.rename(final, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        return True

    def _unmount(self, snapshot_id: str) -> dict | None:
        client = self.running_client()
        if client is None:
            return None
        try:
            return client.unmount(snapshot_id)
        except ChunkfsError as exc:
            if exc.code != "not_found":
                log.warning("unmounting lazy snapshot %s: %s", snapshot_id, exc)
            return None
