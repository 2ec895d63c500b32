"""The node's chunkfs daemon: one per node, outliving node-worker restarts.

    python -m chunkfs serve --mountpoint DIR --cache DIR --limit-mb N --control SOCK
                            [--dir-source DIR] [--read-deadline S] [--readahead K] ...

It serves the FUSE file system (``fs.ChunkFS``) on ``--mountpoint`` over one ``ChunkCache``
in ``--cache`` bounded by ``--limit-mb`` (default ``AENV_CHUNK_CACHE_MB``), fetching from
``--dir-source`` (``<dir>/chunks/<sha>``, a posix_fs store on shared storage) or else the
S3 store the node already uses (``AENV_S3_BUCKET``, ``AENV_S3_ENDPOINT``, ``AENV_S3_REGION``,
``AENV_S3_PREFIX``; credentials from the standard AWS sources).

Control: a unix socket (mode 0600), one JSON object a line each way. Requests:

- ``{"op": "mount", "mount_id", "chunk_size", "files": {name: {"size", "chunks", "chunk_size"?}},
  "prefetch": [[name, chunk_index], ...], "record": bool, "writable": bool, "local"?: {sha: [path,
  offset]}, "pieces"?: [{"key", "chunks": [[sha, length, body length, encoding], ...]}, ...]}`` ->
  ``{"ok": true, "path": "<mountpoint>/<mount_id>"}``. Chunks as in a snapshot manifest
  (``[[offset, length, sha], ...]``, holes absent); a file's own ``chunk_size`` (guest RAM is cut
  smaller than disks) overrides the mount's. The prefetch list is fetched in the
  background, in order. ``local``: chunks the node has inside its own files, read from there
  (verified) before the source is asked. ``pieces``: the prefetch list's chunks stored again as
  a few larger objects under the S3 store's prefix (``chunkfs.pieces``), fetched instead of one
  GET per chunk while the list is walked. ``store_wait``?: seconds (≤ 3600) during which a chunk
  no source has is asked for again (``sources.WaitingSource``): a fork's capture handed to this
  node while its own node still uploads it (ping's ``features`` says the daemon takes it).
- ``{"op": "pin", "mount_id"}``: every chunk of the mount fetched now and pinned in the cache
  until the mount's ``unmount`` (also one after a restart: pins outlive mounts), for files whose
  chunks the store is about to lose.
- ``{"op": "copy_out", "mount_id", "name", "dest"}``: the file's bytes written into ``dest``
  (an existing regular file of its size) by ``COPY_PARALLEL`` threads, holes left as holes ->
  ``{"written", "ms"}``: how a restore copies a lazy RAM file into the sandbox's own without
  reading it through FUSE.
- ``{"op": "peers", "listen": "host:port" | "", "token", "peers": ["host:port", ...]}``: peer
  fetch (``chunkfs.peer_source``, ``chunkfs.peer_server``): serve this cache to peers on
  ``listen`` (port 0: any; "": not at all) with the bearer ``token``, and ask ``peers`` (same
  token) for a missing chunk before the store. Repeated to refresh; -> ``{"listen", "peers"}``.
- ``{"op": "own", "files": {absolute path: [[offset, length, sha], ...]}}``: the chunks inside
  this node's own files (its snapshots, image builds, downloads: ``chunkfs.own_files``), which
  the peer server gives peers besides its cache (each read and checked by digest first);
  replaces the last map; -> ``{"chunks"}``.
- ``{"op": "unmount", "mount_id"}`` (the files vanish; a writable mount's overlays are deleted),
  ``{"op": "list"}``, ``{"op": "stats"}`` (the cache's stats, ``fetches``: chunks and bytes
  from peers and from the store (``store_wire_bytes``: as they crossed the wire, compressed;
  ``piece_*``: the prefetch pieces' GETs, bytes and chunks, part of those) and what peers were
  served, and, per mount, reads, bytes fetched, prefetch progress and the recorded first-touch
  order), ``{"op": "ping"}`` (``encodings``: the compressed chunks it reads; ``features``: the
  optional requests it takes, ``store_wait``).

Every failure is ``{"ok": false, "error": {"code", "message"}}``; the daemon stays up.

Start: one daemon per pidfile (``--pidfile``, default ``<control>.pid``, held with flock);
a stale FUSE mount on the mountpoint (a daemon that died) is lazily unmounted first; the
control socket answers only once the file system is mounted. SIGTERM/SIGINT: the FUSE loop
ends and unmounts, every mount is closed (overlays deleted), the cache state is saved."""
from __future__ import annotations

import argparse
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import signal
import socketserver
import stat
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .cache import ChunkCache
from .compression import ENCODINGS
from .digests import check_sha
from .errors import ChunkError
from .fs import ChunkFS, Mount, run, set_read_ahead
from .lazyfile import DEFAULT_READ_DEADLINE, DEFAULT_READAHEAD, Counters, LazyFile, Pools, Recorder, _blocking_signals
from .own_files import OwnFiles
from .peer_server import COUNTS as PEER_SERVED
from .peer_server import MIN_TOKEN, PeerServer
from .peer_source import PeerChunkSource, parse_peer
from .pieces import PieceCounters, PiecesFirst, PrefetchPieces
from .pieces import parse as parse_pieces
from .sources import MAX_STORE_WAIT, STORE_WAIT, CountingSource, FallbackSource, LocalFileSource, WaitingSource

log = logging.getLogger("chunkfs.daemon")

MOUNT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
FILE_NAME = MOUNT_ID  # as the snapshot manifests name files
MAX_LINE = 64 << 20
DEFAULT_LIMIT_MB = 10240
PREFETCH_PARALLEL = 4
COPY_PARALLEL = 8  # chunks one copy_out reads at once: each missing one is a round trip to the store


def pin_owner(mount_id: str) -> str:
    """The cache's pin owner for a mount's ``pin`` request."""
    return f"mount:{mount_id}"


class RequestError(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def _bad(message: str) -> RequestError:
    return RequestError("bad_request", message)


def _int(value, what: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _bad(f"{what} must be an integer >= {minimum}")
    return value


class Daemon:
    """The control requests over a ``ChunkFS``, a cache and a source."""

    def __init__(self, fs: ChunkFS, cache, source, *, mountpoint: Path, overlay_dir: Path,
                 pools: Pools | None = None, read_deadline: float = DEFAULT_READ_DEADLINE,
                 readahead: int = DEFAULT_READAHEAD):
        self.fs = fs
        self.cache = cache
        self.source = source if isinstance(source, CountingSource) else CountingSource(source)
        self.peers = PeerChunkSource()  # no peers until the "peers" op: then asked before the store
        self.fetch_source = FallbackSource([self.peers, self.source])
        self.peer_server: PeerServer | None = None
        self.own = OwnFiles()  # the node's own files' chunks, served to peers ("own" op)
        self.piece_counters = PieceCounters()
        self._peer_lock = threading.Lock()
        self.mountpoint = Path(mountpoint)
        self.overlay_dir = Path(overlay_dir)
        self.pools = pools or Pools()
        self.read_deadline = read_deadline
        self.readahead = readahead
        self.started = time.time()
        self._mount_lock = threading.Lock()

    def handle_line(self, line: bytes) -> dict:
        try:
            request = json.loads(line)
        except (ValueError, UnicodeDecodeError) as exc:
            return {"ok": False, "error": {"code": "bad_json", "message": f"not a JSON object: {exc}"}}
        try:
            if not isinstance(request, dict):
                raise RequestError("bad_json", "a request is a JSON object")
            op = request.get("op")
            handler = {"mount": self.mount, "unmount": self.unmount, "list": self.list, "stats": self.stats,
                       "ping": self.ping, "pin": self.pin, "peers": self.set_peers,
                       "own": self.set_own, "copy_out": self.copy_out}.get(op) if isinstance(op, str) else None
            if handler is None:
                raise RequestError("unknown_op",
                                   f"unknown op {op!r} (mount, unmount, list, stats, ping, pin, peers, own, "
                                   f"copy_out)")
            return {"ok": True, **handler(request)}
        except RequestError as exc:
            return {"ok": False, "error": {"code": exc.code, "message": exc.message}}
        except Exception as exc:  # a bug: the caller gets an error object, the daemon stays up
            log.exception("control request failed")
            return {"ok": False, "error": {"code": "internal", "message": f"{type(exc).__name__}: {exc}"}}

    # ------------------------------------------------------------------ requests

    def ping(self, request: dict) -> dict:
        return {"pid": os.getpid(), "mountpoint": str(self.mountpoint), "source": self.source.name,
                "uptime": round(time.time() - self.started, 3), "encodings": list(ENCODINGS),
                "features": [STORE_WAIT]}

    def _mount_id(self, request: dict) -> str:
        mount_id = request.get("mount_id")
        if not isinstance(mount_id, str) or not MOUNT_ID.match(mount_id):
            raise _bad("mount_id must be a name of letters, digits, '.', '_' or '-' (at most 128)")
        return mount_id

    def mount(self, request: dict) -> dict:
        mount_id = self._mount_id(request)
        chunk_size = _int(request.get("chunk_size"), "chunk_size", 1)
        files = request.get("files")
        if not isinstance(files, dict) or not files:
            raise _bad("files must be an object {name: {size, chunks}} with at least one file")
        record = request.get("record", False)
        writable = request.get("writable", False)
        if not isinstance(record, bool) or not isinstance(writable, bool):
            raise _bad("record and writable are booleans")
        prefetch = request.get("prefetch", [])
        if not isinstance(prefetch, list) or not all(
                isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and not isinstance(p[1], bool)
                and isinstance(p[1], int) and p[1] >= 0 for p in prefetch):
            raise _bad("prefetch must be a list of [name, chunk_index]")
        store_wait = request.get("store_wait", 0)
        if isinstance(store_wait, bool) or not isinstance(store_wait, (int, float)) or not (
                0 <= store_wait <= MAX_STORE_WAIT):
            raise _bad(f"store_wait must be a number of seconds from 0 to {MAX_STORE_WAIT:g}")
        pieces = self._pieces(request.get("pieces"), prefetch, request.get("local"))
        source = self._mount_source(request.get("local"), pieces)
        if store_wait:  # a capture still uploading: what is not there yet will be
            source = WaitingSource(source, time.monotonic() + float(store_wait))
        with self._mount_lock:
            if self.fs.get(mount_id) is not None:
                raise RequestError("exists", f"mount {mount_id} exists")
            recorder = Recorder() if record else None
            counters = Counters()
            lazy: dict[str, LazyFile] = {}
            try:
                for name, spec in files.items():
                    if not FILE_NAME.match(name):
                        raise _bad(f"bad file name {name!r}")
                    if not isinstance(spec, dict):
                        raise _bad(f"file {name}: an object {{size, chunks}}")
                    size = _int(spec.get("size"), f"file {name}: size")
                    file_chunk_size = _int(spec.get("chunk_size", chunk_size), f"file {name}: chunk_size", 1)
                    chunks = spec.get("chunks", [])
                    if not isinstance(chunks, list) or not all(
                            isinstance(c, list) and len(c) == 3 and all(isinstance(x, int) and not isinstance(x, bool)
                                                                       for x in c[:2]) for c in chunks):
                        raise _bad(f"file {name}: chunks must be [[offset, length, sha], ...]")
                    try:
                        for c in chunks:
                            check_sha(c[2])
                        lazy[name] = LazyFile(size, file_chunk_size, chunks, self.cache, source, name=name,
                                              pools=self.pools, readahead=self.readahead,
                                              read_deadline=self.read_deadline, recorder=recorder,
                                              counters=counters,
                                              overlay=self.overlay_dir / mount_id / name if writable else None)
                    except ValueError as exc:
                        raise _bad(f"file {name}: {exc}") from None
                for name, _ in prefetch:
                    if name not in lazy:
                        raise _bad(f"prefetch names a file not in the mount: {name!r}")
            except BaseException:
                for f in lazy.values():
                    f.close()
                raise
            mount = Mount(mount_id, lazy, writable=writable, recorder=recorder, counters=counters,
                          chunk_size=chunk_size, pieces=pieces)
            self.fs.add(mount)
        if prefetch:
            mount.prefetch_state.update(queued=len(prefetch), finished=False)
            threading.Thread(target=self._prefetch, args=(mount, prefetch), name=f"prefetch-{mount_id}",
                             daemon=True).start()
        log.info("mounted %s: %d files%s%s, %d chunks to prefetch%s", mount_id, len(lazy),
                 ", writable" if writable else "", ", recording" if record else "", len(prefetch),
                 f" ({len(pieces.keys)} pieces)" if pieces is not None else "")
        return {"path": str(self.mountpoint / mount_id)}

    def _pieces(self, value, prefetch: list, local) -> PrefetchPieces | None:
        """A mount's prefetch pieces (``chunkfs.pieces``) when it has a prefetch list to walk
        and the store can give them (S3), less the chunks the node has already."""
        if value is None or value == []:
            return None
        try:
            keys, where = parse_pieces(value)
        except ValueError as exc:
            raise _bad(f"pieces: {exc}") from None
        get = getattr(self.source.source, "get", None)
        if not prefetch or get is None:
            return None
        pieces = PrefetchPieces(keys, where, get, self.pools.pieces, counters=self.piece_counters)
        pieces.skip([sha for sha in where if self.cache.contains(sha)])
        if isinstance(local, dict):
            pieces.skip(local)
        return pieces

    def _mount_source(self, local, pieces: PrefetchPieces | None = None) -> object:
        """The daemon's source, or with ``local`` ({sha: [path, offset]}: chunks inside this
        node's own files) those first, each checked by its digest before it counts; with
        ``pieces``, the store's chunks from those when they hold them."""
        if pieces is not None:
            return self._with_local(local, FallbackSource([self.peers, PiecesFirst(pieces, self.source)]))
        return self._with_local(local, self.fetch_source)

    def _with_local(self, local, then: FallbackSource) -> object:
        if local is None or local == {}:
            return then
        if not isinstance(local, dict) or not all(
                isinstance(v, list) and len(v) == 2 and isinstance(v[0], str) and v[0].startswith("/")
                and isinstance(v[1], int) and not isinstance(v[1], bool) and v[1] >= 0 for v in local.values()):
            raise _bad("local must be an object {sha: [absolute path, offset]}")
        try:
            return FallbackSource([LocalFileSource(local), *then.sources])
        except ValueError as exc:
            raise _bad(f"local: {exc}") from None

    def _prefetch(self, mount: Mount, items: list) -> None:
        """The mount's prefetch list, in order, ``PREFETCH_PARALLEL`` chunks at a time."""
        _blocking_signals()
        state = mount.prefetch_state
        slots = threading.Semaphore(PREFETCH_PARALLEL)
        lock = threading.Lock()

        def one(name: str, index: int) -> None:
            try:
                if not mount.closed.is_set():
                    mount.files[name].ensure(index)
                ok = True
            except ChunkError as exc:
                log.info("prefetch of %s/%s chunk %d failed: %s", mount.id, name, index, exc)
                ok = False
            finally:
                slots.release()
            with lock:
                state["done" if ok else "failed"] += 1

        with ThreadPoolExecutor(PREFETCH_PARALLEL, thread_name_prefix="chunkfs-list",
                                initializer=_blocking_signals) as pool:
            for name, index in items:
                slots.acquire()
                if mount.closed.is_set():
                    slots.release()
                    break
                pool.submit(one, name, index)
        if mount.pieces is not None:  # walked: the bodies of chunks nobody took go
            mount.pieces.close()
        state["finished"] = True

    def pin(self, request: dict) -> dict:
        """Every chunk of the mount fetched now and pinned until its unmount: for a mount whose
        chunks the store is about to lose (its snapshot deleted while a VM still reads it)."""
        mount_id = self._mount_id(request)
        mount = self.fs.get(mount_id)
        if mount is None:
            raise RequestError("not_found", f"no mount {mount_id}")
        shas = {sha for f in mount.files.values() for sha in f.shas()}
        self.cache.pin(pin_owner(mount_id), shas)  # first: a chunk fetched below is never evicted
        jobs = [(f, index) for f in mount.files.values() for index in range(f.chunk_count)]

        def one(job) -> str | None:
            f, index = job
            try:
                f.ensure(index)
                return None
            except ChunkError as exc:
                return f"{f.name} chunk {index}: {exc}"

        with ThreadPoolExecutor(PREFETCH_PARALLEL, thread_name_prefix="chunkfs-pin",
                                initializer=_blocking_signals) as pool:
            failed = [r for r in pool.map(one, jobs) if r]
        if failed:
            raise RequestError("unavailable", f"{len(failed)} chunks of {mount_id} could not be had: {failed[0]}")
        log.info("pinned %s: %d chunks", mount_id, len(shas))
        return {"mount_id": mount_id, "pinned": len(shas)}

    def copy_out(self, request: dict) -> dict:
        """A mounted file's bytes written into ``dest`` (an existing regular file of the same
        size, holes where the file has none; symlinks refused), ``COPY_PARALLEL`` chunks at once."""
        mount_id = self._mount_id(request)
        name = request.get("name")
        dest = request.get("dest")
        if not isinstance(name, str) or not FILE_NAME.match(name):
            raise _bad("name must be a file name of the mount")
        if not isinstance(dest, str) or not os.path.isabs(dest):
            raise _bad("dest must be an absolute path")
        mount = self.fs.get(mount_id)
        lazy = mount.files.get(name) if mount is not None else None
        if lazy is None:
            raise RequestError("not_found", f"no file {name} in mount {mount_id}")
        try:
            fd = os.open(dest, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise _bad(f"dest {dest}: {exc.strerror}") from None
        t0 = time.monotonic()
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != lazy.size:
                raise _bad(f"dest must be a regular file of {lazy.size} bytes (it has {st.st_size})")
            written = lazy.copy_into(fd, workers=COPY_PARALLEL)
        except ChunkError as exc:
            raise RequestError("unavailable", f"{name} of {mount_id}: {exc}") from None
        finally:
            os.close(fd)
        return {"written": written, "ms": round((time.monotonic() - t0) * 1e3, 1)}

    def set_peers(self, request: dict) -> dict:
        """Peer fetch on (or off: no ``listen``, no ``peers``); see the module's docstring."""
        listen, token, peers = request.get("listen", ""), request.get("token", ""), request.get("peers", [])
        if not isinstance(listen, str) or not isinstance(token, str):
            raise _bad("listen and token are strings")
        if not isinstance(peers, list) or len(peers) > 1024 or not all(isinstance(p, str) for p in peers):
            raise _bad("peers must be a list of 'host:port' (at most 1024)")
        try:
            for peer in peers:
                parse_peer(peer)
            host, port = parse_peer(listen, any_port=True) if listen else ("", 0)
        except ValueError as exc:
            raise _bad(str(exc)) from None
        if (listen or peers) and len(token) < MIN_TOKEN:
            raise _bad(f"peer fetch needs a token of at least {MIN_TOKEN} characters")
        with self._peer_lock:
            self.peers.configure(peers, token)  # asking works also where this node cannot listen
            server = self.peer_server
            if server is not None and (not listen or (host, port) != (server.address, server.requested_port)):
                server.close()
                server = self.peer_server = None
            if listen and server is None:
                try:
                    server = self.peer_server = PeerServer(self.cache, host, port, token, own=self.own)
                except OSError as exc:
                    raise RequestError("listen_failed", f"cannot serve chunks to peers on {listen}: {exc}") from None
            if server is not None:
                server.token = token
        return {"listen": server.listen if server is not None else "", "peers": len(peers)}

    def set_own(self, request: dict) -> dict:
        """The chunks of this node's own files that peers may have (see the module's docstring)."""
        try:
            return {"chunks": self.own.set(request.get("files", {}))}
        except ValueError as exc:
            raise _bad(str(exc)) from None

    def fetch_stats(self) -> dict:
        """Where chunks came from (peers, the store) and what this node served its peers."""
        server = self.peer_server
        served = server.stats() if server is not None else dict.fromkeys(PEER_SERVED, 0)
        return {**self.peers.stats(), "store_chunks": self.source.chunks, "store_bytes": self.source.bytes,
                "store_wire_bytes": self.source.wire_bytes, **self.piece_counters.as_dict(),
                **served, "peer_listen": server.listen if server is not None else "", "own_chunks": len(self.own)}

    def unmount(self, request: dict) -> dict:
        mount_id = self._mount_id(request)
        self.cache.unpin(pin_owner(mount_id))  # also when the mount went with a restart: pins outlive it
        mount = self.fs.remove(mount_id)
        if mount is None:
            raise RequestError("not_found", f"no mount {mount_id}")
        shutil.rmtree(self.overlay_dir / mount_id, ignore_errors=True)
        log.info("unmounted %s", mount_id)
        return {"mount_id": mount_id, "stats": mount.stats()}

    def list(self, request: dict) -> dict:
        return {"mounts": [{**m.describe(), "path": str(self.mountpoint / m.id)}
                           for _, m in sorted(self.fs.mounts().items())]}

    def stats(self, request: dict) -> dict:
        mounts = self.fs.mounts()
        if "mount_id" in request:
            mount_id = self._mount_id(request)
            if mount_id not in mounts:
                raise RequestError("not_found", f"no mount {mount_id}")
            mounts = {mount_id: mounts[mount_id]}
        return {"cache": self.cache.stats(), "fetches": self.fetch_stats(),
                "mounts": {k: m.stats() for k, m in sorted(mounts.items())}}

    def close(self) -> None:
        if self.peer_server is not None:
            self.peer_server.close()
        for mount_id in list(self.fs.mounts()):
            self.fs.remove(mount_id)
        self.pools.shutdown()
        shutil.rmtree(self.overlay_dir, ignore_errors=True)


class _Handler(socketserver.StreamRequestHandler):
    def handle(self):
        daemon: Daemon = self.server.daemon_ref
        while True:
            line = self.rfile.readline(MAX_LINE + 1)
            if not line:
                return
            if len(line) > MAX_LINE:
                reply = {"ok": False, "error": {"code": "too_large", "message": f"a request is at most {MAX_LINE} bytes"}}
                self.wfile.write(json.dumps(reply).encode() + b"\n")
                return
            if not line.strip():
                continue
            reply = daemon.handle_line(line)
            self.wfile.write(json.dumps(reply, separators=(",", ":")).encode() + b"\n")
            self.wfile.flush()


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def server_bind(self):
        old = os.umask(0o177)  # 0600 from the first moment
        try:
            super().server_bind()
        finally:
            os.umask(old)
        os.chmod(self.server_address, 0o600)


def _serve_control(daemon: Daemon, control: Path, ready: threading.Event, failed: list) -> None:
    _blocking_signals()
    try:
        deadline = time.monotonic() + 60
        while not _is_mounted(daemon.mountpoint):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{daemon.mountpoint} was not mounted within 60 s")
            time.sleep(0.02)
        set_read_ahead(str(daemon.mountpoint))
        control.unlink(missing_ok=True)
        server = _Server(str(control), _Handler)
        server.daemon_ref = daemon
        daemon.server = server
        ready.set()
        log.info("chunkfs serving %s (control %s, source %s)", daemon.mountpoint, control, daemon.source.name)
        server.serve_forever(poll_interval=0.2)
    except Exception as exc:
        failed.append(exc)
        log.exception("control socket failed")
        os.kill(os.getpid(), signal.SIGTERM)  # ends the FUSE loop: the daemon is useless without control


def _mountinfo_has(path: Path) -> bool:
    target = str(path)
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 4 and fields[4].encode().decode("unicode_escape") == target:
                    return True
    except OSError:
        pass
    return False


def _is_mounted(path: Path) -> bool:
    try:
        return os.path.ismount(path)
    except OSError:
        return False


def unmount_stale(mountpoint: Path) -> bool:
    """Lazily unmounts whatever is mounted on ``mountpoint`` (a dead daemon's FUSE mount
    answers ENOTCONN). True if something was."""
    stale = _mountinfo_has(mountpoint)
    if not stale:
        try:
            os.stat(mountpoint)
        except OSError as exc:
            stale = exc.errno in (errno.ENOTCONN, errno.ECONNABORTED)
    if not stale:
        return False
    log.warning("unmounting a stale mount on %s", mountpoint)
    for cmd in (["fusermount3", "-u", "-z", str(mountpoint)], ["umount", "-l", str(mountpoint)]):
        try:
            if subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0:
                return True
        except (OSError, subprocess.TimeoutExpired):
            continue
    raise RuntimeError(f"could not unmount the stale mount on {mountpoint}")


def lock_pidfile(path: Path):
    """The open, flocked pidfile (held for the process's life), or None if another holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def make_source(dir_source: str | None):
    """``--dir-source``, else the S3 store of the node's environment (AENV_S3_*)."""
    from .sources import DirChunkSource, S3ChunkSource, s3_client, signed_getter  # noqa: PLC0415

    if dir_source:
        return DirChunkSource(Path(dir_source))
    bucket = os.environ.get("AENV_S3_BUCKET", "")
    if not bucket:
        raise SystemExit("chunkfs: no source: give --dir-source or set AENV_S3_BUCKET (and AENV_S3_ENDPOINT, "
                         "AENV_S3_REGION, AENV_S3_PREFIX)")
    endpoint, region = os.environ.get("AENV_S3_ENDPOINT", ""), os.environ.get("AENV_S3_REGION", "")
    return S3ChunkSource(s3_client(endpoint, region), bucket, os.environ.get("AENV_S3_PREFIX", ""),
                         getter=signed_getter(endpoint, bucket, region))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m chunkfs", description="lazily filled files over a chunk cache (FUSE)")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="mount the file system and serve the control socket")
    s.add_argument("--mountpoint", required=True, type=Path)
    s.add_argument("--cache", required=True, type=Path, help="the chunk cache's directory")
    s.add_argument("--limit-mb", type=int, default=None,
                   help=f"the cache's bound (default AENV_CHUNK_CACHE_MB, else {DEFAULT_LIMIT_MB})")
    s.add_argument("--control", required=True, type=Path, help="the control socket's path")
    s.add_argument("--pidfile", type=Path, default=None, help="default <control>.pid")
    s.add_argument("--dir-source", default=None, help="fetch <dir>/chunks/<sha> instead of S3")
    s.add_argument("--overlay-dir", type=Path, default=None, help="writable mounts' overlays (default <cache>-overlays)")
    s.add_argument("--read-deadline", type=float, default=DEFAULT_READ_DEADLINE,
                   help="seconds a read may wait for its chunks before EIO")
    s.add_argument("--readahead", type=int, default=DEFAULT_READAHEAD, help="chunks prefetched ahead of a sequential reader")
    s.add_argument("--fetch-workers", type=int, default=16)
    s.add_argument("--log-level", default="INFO")
    return p


def serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    mountpoint = args.mountpoint.absolute()
    control = args.control.absolute()
    pidfile = (args.pidfile or Path(str(control) + ".pid")).absolute()
    lock = lock_pidfile(pidfile)
    if lock is None:
        print(f"chunkfs: already running (pidfile {pidfile} is locked)", file=sys.stderr)
        return 3
    unmount_stale(mountpoint)
    mountpoint.mkdir(parents=True, exist_ok=True)
    limit_mb = args.limit_mb if args.limit_mb is not None else int(os.environ.get("AENV_CHUNK_CACHE_MB") or DEFAULT_LIMIT_MB)
    overlay_dir = (args.overlay_dir or Path(str(args.cache.absolute()) + "-overlays")).absolute()
    shutil.rmtree(overlay_dir, ignore_errors=True)  # overlays never outlive their mounts
    source = make_source(args.dir_source)
    cache = ChunkCache(args.cache.absolute(), limit_mb << 20)
    fs = ChunkFS()
    daemon = Daemon(fs, cache, source, mountpoint=mountpoint, overlay_dir=overlay_dir,
                    pools=Pools(fetch_workers=args.fetch_workers), read_deadline=args.read_deadline,
                    readahead=args.readahead)
    daemon.server = None
    ready, failed = threading.Event(), []
    control_thread = threading.Thread(target=_serve_control, args=(daemon, control, ready, failed),
                                      name="chunkfs-control", daemon=True)
    control_thread.start()
    code = 0
    try:
        run(fs, str(mountpoint))  # until SIGTERM/SIGINT/SIGHUP or an external unmount
    except RuntimeError as exc:
        if str(exc) != "8":  # libfuse's fuse_main: 8 = the loop ended by a signal (SIGTERM...)
            log.error("FUSE ended with an error: %s", exc)
            code = 1
    finally:
        log.info("stopping")
        if daemon.server is not None:
            daemon.server.shutdown()
            daemon.server.server_close()
        control.unlink(missing_ok=True)
        daemon.close()
        cache.close()
        if _is_mounted(mountpoint) or _mountinfo_has(mountpoint):
            unmount_stale(mountpoint)
        os.close(lock)
    return 1 if failed else code


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    return 2

