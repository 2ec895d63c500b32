"""The S3 snapshot store: snapshots any node can restore.

Objects (under ``AENV_S3_PREFIX``):

- ``chunks/<sha256>``: a piece of some snapshot file (4 MiB, guest RAM 1 MiB: ``chunks``),
  named by its content (uncompressed; stored zstd-compressed when that saves a tenth,
  marked in its metadata: ``chunkfs.compression``, ``AENV_S3_CHUNK_COMPRESSION``).
  All-zero pieces are not stored; equal pieces (a layer two snapshots share, the
  unchanged parts of a child's layers) are one object.
- ``snapshots/<id>/manifest.json``: the snapshot: each file's size, chunk size and chunk list
  (a file without its own chunk size, as older manifests wrote them, has the manifest's),
  and the driver's SnapshotManifest with its paths made relative (``$SNAPSHOT/…``
  for the snapshot's own files, ``$IMAGES/…`` for the template base layer, kernel
  and tools) and ``image_files``: each of those image files' content digest. Written
  last: it exists only for a complete upload.
- ``images/<sha256>.json``: an image file by content (size and chunk list), published
  once for every snapshot that runs on it; its chunks carry ``image-…`` markers, and
  ``image-users/<sha256>/<id>`` marks each snapshot using it (the last delete removes it). Two
  nodes' builds of one recipe may differ byte for byte, so a node uses its own file
  only when the digest matches and otherwise fetches this one with the snapshot.
- ``refs/<sha256>/<id>``: empty marker, "snapshot <id> uses this chunk".
- ``snapshots/<id>/prefetch.json``: the chunks a restore read first, in order (recorded where a
  template is built, or by the first lazy restore), and for a template ``snapshots/<id>/prefetch/<n>``,
  its prefetch pieces: those chunks' bodies again, a few to an object (``prefetch_pieces``,
  ``chunkfs.pieces``), so a node that never saw the template fetches its start in a few GETs.
- ``snapshots/<id>/pending.json``: a fork capture handed to other nodes before its upload ended
  (``index``): the manifest as it will be, marked ``pending``. Only a restore that is told
  to may mount it (``local_dir(..., pending_wait=)``); its chunks come from the capturing
  node's own files (peer fetch) until the upload has them. Removed once the manifest is written.

Reference scheme and its trade-off: a commit writes a chunk's marker *before* it
checks whether the chunk exists, and after its manifest is written it checks every
chunk again and re-uploads any that vanished. A delete removes the manifest, then
its own markers, and a chunk only when no marker is left. So a delete never removes
a chunk whose marker it saw, and a commit that raced a delete finds the chunk gone
in its final check. The window left open is a delete that lists a chunk's markers
before a commit writes its marker and deletes the chunk only after that commit's
final check: one request round trip against a whole upload. No lock object, no
listing of the bucket; the price is a marker object per (chunk, snapshot), and a
crash mid-delete leaks chunks (never loses them): the doomed manifest is kept at
``trash/<id>.json`` until its chunks are released, and a repeated delete finishes.

The node that took a snapshot keeps its local copy (``AENV_HOME/snapshots/<id>``,
as posix_fs). Other nodes download into ``AENV_HOME/cache/snapshots/<id>`` (see
storage_cache), rewrite the paths to theirs and let the VM driver adopt the files
(``adopt_snapshot``: QEMU re-points each layer's backing file); the driver also says
beforehand whether this node can restore it at all (``check_snapshot``: the image build).
With lazy restores on (``AENV_LAZY_RESTORE``, ``lazy.py``) the files are not downloaded but
mounted from lazily filled files (``AENV_HOME/lazy/snapshots/<id>``); the download stays the
fallback.

This module is the upload and download logic; the bucket's object names and the
release half of the scheme are ``s3_objects``, the manifest's path rewriting ``s3_paths``."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from botocore.exceptions import BotoCoreError, ClientError

from chunkfs.compression import ZSTD, BadEncoding, decode
from chunkfs.pieces import parse as parse_pieces
from vmm.driver import SnapshotManifest, VMError

from .base import PosixFsStore, SnapshotStore, SnapshotStoreError, _checked, complete_ids
from .cache import CacheFull, SnapshotCache
from .chunks import CHUNK_SIZE, RAM_CHUNK_SIZE, Chunk, allocated_bytes, chunk_size_for, chunk_spans, digest, read_chunk
from .lazy import LazyMountFailed, LazyRestores, cache_figures
from . import prefetch_pieces
from .local_chunks import LocalChunks
from .s3_objects import S3Objects
from .s3_paths import image_files, localize, relativize, replace_path, unique_paths

log = logging.getLogger(__name__)

FORMAT = "aenv-snapshot/1"
FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
SHA = re.compile(r"^[0-9a-f]{64}$")
SKIP_FILES = {"manifest.json", ".last_used"}
PREFETCH_FORMAT = "aenv-prefetch/1"
PREFETCH_SETTLE = 2.0  # seconds after a lazy restore answered that still count as its start


class S3Store(S3Objects, SnapshotStore):
    """Local captures as posix_fs, plus an S3 copy any node can restore from (the
    bucket's object names and releasing: ``S3Objects``)."""

    name = "s3"

    def __init__(self, *, home: Path, images_dir: Path, bucket: str, client=None, endpoint: str = "",
                 region: str = "", prefix: str = "", concurrency: int = 8, cache_limit_bytes: int = 20 << 30,
                 pin_seconds: float = 600.0, chunk_size: int = CHUNK_SIZE, ram_chunk_size: int | None = None,
                 driver=None, lazy: bool = False, chunk_cache_mb: int = 20 * 1024,
                 chunk_read_deadline: float | None = None, chunk_compression: str | None = ZSTD):
        """``driver``: the node's VM driver (vmm.driver.VMDriver), which adopts downloads and
        says which cached files its VMs use; default the node's own (agent.driver), made on
        first use, since only downloads and eviction need it. ``lazy``: restore snapshots
        from lazily filled files (agent.stores.lazy, the node's chunkfs daemon with a chunk
        cache of ``chunk_cache_mb``; a chunk the store does not deliver within
        ``chunk_read_deadline`` seconds fails the read with EIO) instead of downloading them whole.
        ``chunk_size``: the pieces disks and other files are cut into; ``ram_chunk_size``: guest
        RAM's (``chunks``; default ``RAM_CHUNK_SIZE``, or ``chunk_size`` if that is smaller).
        ``chunk_compression``: how chunks are uploaded (``zstd`` or None: ``chunkfs.compression``)."""
        super().__init__(bucket=bucket, client=client, endpoint=endpoint, region=region, prefix=prefix,
                         concurrency=concurrency, chunk_compression=chunk_compression)
        home = Path(home).absolute()
        self.endpoint, self.region, self.raw_prefix = endpoint, region, prefix
        self.local = PosixFsStore(home / "snapshots")
        self._driver = driver
        self.cache = SnapshotCache(home / "cache" / "snapshots", lambda: self.driver.files_in_use(),
                                   cache_limit_bytes, pin_seconds)
        self.images_dir = Path(images_dir).absolute()
        self.chunk_size = int(chunk_size)
        self.ram_chunk_size = int(ram_chunk_size or min(RAM_CHUNK_SIZE, self.chunk_size))
        # what a download need not fetch (and what peer fetch may give other nodes): chunks of
        # this node's image builds, template snapshots, earlier downloads and its committed captures
        self.on_disk = LocalChunks([self.images_dir, self.cache.root], home / "cache" / "chunk-index",
                                   self.chunk_size, self.ram_chunk_size,
                                   indexed_roots=lambda: [self.local.root / i for i in self.local.local_ids()])
        self.lazy = LazyRestores(home, limit_mb=chunk_cache_mb, files_in_use=lambda: self.driver.files_in_use(),
                                 read_deadline=chunk_read_deadline,
                                 daemon_env={"AENV_S3_BUCKET": bucket, "AENV_S3_ENDPOINT": endpoint,
                                             "AENV_S3_REGION": region, "AENV_S3_PREFIX": prefix}) if lazy else None
        self._recording: set[str] = set()  # lazily mounted with recording on, not yet restored
        self._mount_timings: dict[str, dict[str, float]] = {}  # a lazy mount's steps (ms), until taken
        self._mount_timings_lock = threading.Lock()
        self.prefetch_settle = PREFETCH_SETTLE

    @property
    def driver(self):
        if self._driver is None:
            from agent.driver import get_driver  # noqa: PLC0415 - the node's one driver

            self._driver = get_driver()
        if self.lazy is not None and getattr(self._driver, "lazy_ram_copier", False) is None:
            self._driver.set_lazy_ram_copier(self.lazy.copy_ram)  # lazy RAM copied by the daemon, not through FUSE
        return self._driver

    # ------------------------------------------------------------------ interface

    def prepare(self, snapshot_id: str) -> Path:
        return self.local.prepare(snapshot_id)

    def size_bytes(self, snapshot_id: str) -> int:
        for path in (self.local._dir(snapshot_id), self.cache.path(_checked(snapshot_id))):
            if path.exists():
                return allocated_bytes(path)
        return 0

    def commit(self, snapshot_id: str) -> dict:
        """Uploads the finished capture; harmless to repeat. Returns counts (chunks
        referenced, uploaded, bytes uploaded and, compressed, sent)."""
        src = self.local.local_dir(snapshot_id)
        touched: set[str] = set()
        try:
            return self._commit(snapshot_id, src, touched)
        except BaseException as exc:
            self._abandon(snapshot_id, touched)
            if isinstance(exc, (SnapshotStoreError, KeyboardInterrupt, SystemExit)) or not isinstance(exc, Exception):
                raise
            raise SnapshotStoreError(f"upload of snapshot {snapshot_id} to {self._where()} failed: {exc}") from exc

    def _abandon(self, snapshot_id: str, touched: set[str]) -> None:
        """A failed commit releases the markers it wrote (best effort: a failure here
        only leaks chunks). A manifest already written stays: delete removes it."""
        if self._manifest_written(snapshot_id):
            return
        for sha in sorted(touched):
            try:
                if sha.startswith("image:"):
                    self._release_image(sha.removeprefix("image:"), snapshot_id)
                else:
                    self._release(sha, snapshot_id)
            except Exception as exc:  # the store is unreachable: nothing more to do
                log.warning("could not release chunk %s of failed snapshot %s: %s", sha, snapshot_id, exc)
                return

    def _manifest_written(self, snapshot_id: str) -> bool:
        try:
            return self._exists(self.manifest_key(snapshot_id))
        except Exception:
            return True  # unknown: keep the markers rather than risk a manifest's chunks

    def _capture_files(self, snapshot_id: str, src: Path) -> tuple[dict, dict, dict, list]:
        """A capture's driver manifest, ``{name: {size, chunk_size, chunks: []}}`` of its files,
        their stats from before they are read (the chunk lists hold while these do), and the
        (name, chunk) spans to read."""
        manifest = json.loads((src / "manifest.json").read_text())
        names = sorted(p.name for p in src.iterdir() if p.is_file() and p.name not in SKIP_FILES)
        for name in names:
            if not FILE_NAME.match(name):
                raise SnapshotStoreError(f"unexpected file name {name!r} in snapshot {snapshot_id}")
        sizes = {name: chunk_size_for(name, self.chunk_size, self.ram_chunk_size) for name in names}
        before = {name: (src / name).stat() for name in names}
        jobs = [(name, chunk) for name in names for chunk in chunk_spans(src / name, sizes[name])]
        files = {name: {"size": before[name].st_size, "chunk_size": sizes[name], "chunks": []} for name in names}
        return manifest, files, before, jobs

    def _doc(self, snapshot_id: str, src: Path, manifest: dict, files: dict, touched: set[str],
             publish: Callable | None = None) -> tuple[dict, dict]:
        """The store's manifest of a capture whose chunk lists are ``files``, each image file it
        runs on made restorable by ``publish`` (``_publish_image_file``); and those image files
        ``{role: path}``."""
        publish = publish or self._publish_image_file
        images_dirs = unique_paths([self.images_dir, self.images_dir.resolve()])
        needed = image_files(manifest, images_dirs)
        doc = {
            "format": FORMAT, "snapshot_id": snapshot_id, "chunk_size": self.chunk_size, "files": files,
            "stored_bytes": sum(c[1] for f in files.values() for c in f["chunks"]),
            "manifest": relativize(manifest, Path(manifest.get("dir") or src), images_dirs),
            "image_files": {role: {"path": relativize(path, src, images_dirs),
                                   **publish(path, snapshot_id, touched)}
                            for role, path in needed.items()},
        }
        return doc, needed

    def _image_for_hand_off(self, path: str, snapshot_id: str, touched: set[str]) -> dict:
        """``_publish_image_file`` for an image file the store has already (marked used by the
        snapshot); else its chunk list in the pending manifest itself: a hand-off never waits
        for a whole image's upload (the commit's), and a node whose own copy differs reads it
        from this node's files by peer fetch, or from the store once the commit put it there."""
        file_digest, size, chunks = self.on_disk.file_digest(Path(path))
        if self._exists(self.image_key(file_digest)):
            return self._publish_image_file(path, snapshot_id, touched)
        return {"digest": file_digest, "size": size, "chunks": chunks,
                "chunk_size": self.on_disk.chunk_size_for(Path(path))}

    def index(self, snapshot_id: str) -> dict:
        """Hands a capture to other nodes before its upload (a fork's early hand-off): hashes
        its files, puts its manifest as ``pending.json`` (never ``manifest.json``: only
        ``commit`` says the store holds it whole) and saves the chunk lists in this node's
        own-file index, so peer fetch serves them at once. An image file it runs on is named by
        digest when the store has it, else listed chunk by chunk in the pending manifest
        (``_image_for_hand_off``). Returns {"chunks", "bytes"}. The commit that follows hashes
        the files again as it reads them: what it uploads is checked against what it read, not
        against this list."""
        src = self.local.local_dir(snapshot_id)
        touched: set[str] = set()
        try:
            manifest, files, before, jobs = self._capture_files(snapshot_id, src)

            def hashed(job) -> str | None:
                data = read_chunk(src / job[0], job[1])
                return None if data is None else digest(data)

            with self._pool() as pool:
                for (name, chunk), sha in zip(jobs, pool.map(hashed, jobs)):
                    if sha is not None:
                        files[name]["chunks"].append([chunk.offset, chunk.length, sha])
            doc, _ = self._doc(snapshot_id, src, manifest, files, touched, publish=self._image_for_hand_off)
            self._put_json(self.pending_key(snapshot_id), {**doc, "pending": True})
        except BaseException as exc:
            self._abandon(snapshot_id, touched)
            if isinstance(exc, (SnapshotStoreError, KeyboardInterrupt, SystemExit)) or not isinstance(exc, Exception):
                raise
            raise SnapshotStoreError(f"hand-off of snapshot {snapshot_id} through {self._where()} failed: "
                                     f"{exc}") from exc
        for name, info in files.items():
            self.on_disk.remember(src / name, info["chunks"], before[name])
        return {"chunks": sum(len(f["chunks"]) for f in files.values()), "bytes": doc["stored_bytes"]}

    def _commit(self, snapshot_id: str, src: Path, touched: set[str]) -> dict:
        manifest, files, before, jobs = self._capture_files(snapshot_id, src)
        stats = {"chunks": 0, "uploaded": 0, "uploaded_bytes": 0, "sent_bytes": 0}
        claim = threading.Lock()

        def upload(job):
            name, chunk = job
            data = read_chunk(src / name, chunk)
            if data is None:
                return None
            sha = digest(data)
            with claim:  # a chunk repeated within this snapshot is sent by one thread only
                if sha in touched:
                    return sha, 0, 0
                touched.add(sha)
            self.s3.put_object(Bucket=self.bucket, Key=self.ref_key(sha, snapshot_id), Body=b"")
            if self._exists(self.chunk_key(sha)):
                return sha, 0, 0
            return sha, len(data), self._put_chunk(sha, data)

        where: dict[str, tuple[str, Chunk]] = {}
        with self._pool() as pool:
            for (name, chunk), result in zip(jobs, pool.map(upload, jobs)):
                if result is None:
                    continue
                sha, uploaded, sent = result
                files[name]["chunks"].append([chunk.offset, chunk.length, sha])
                where.setdefault(sha, (name, chunk))
                stats["chunks"] += 1
                stats["uploaded"] += 1 if uploaded else 0
                stats["uploaded_bytes"] += uploaded
                stats["sent_bytes"] += sent
            doc, needed = self._doc(snapshot_id, src, manifest, files, touched)
            self._put_json(self.manifest_key(snapshot_id), doc)
            for role, path in needed.items():  # a racing delete may have dropped it
                if not self._exists(self.image_key(doc["image_files"][role]["digest"])):
                    self._publish_image_file(path, snapshot_id, touched)

            def recheck(sha):  # a concurrent delete may have removed a chunk we found present
                if self._exists(self.chunk_key(sha)):
                    return 0
                name, chunk = where[sha]
                self._put_chunk(sha, read_chunk(src / name, chunk))
                return 1

            stats["reuploaded"] = sum(pool.map(recheck, list(where)))
        self.s3.delete_object(Bucket=self.bucket, Key=self.pending_key(snapshot_id))  # a hand-off's, if any
        stats["unique_chunks"] = len(where)
        for name, info in files.items():  # the node's own-file index need never read them again
            self.on_disk.remember(src / name, info["chunks"], before[name])
        log.info("snapshot %s committed to %s: %s", snapshot_id, self._where(), stats)
        return stats

    def _publish_image_file(self, path: str, snapshot_id: str, touched: set[str]) -> dict:
        """Makes a file of this node's images dir that a snapshot needs (its template's base
        disk, the kernel, initrd and tools drive) restorable from the store by content: its
        chunks and ``images/<digest>.json``, once per distinct file in the whole store. The
        snapshot marks itself a user (``image-users/<digest>/<id>``) before it looks, the
        chunks' scheme one level up: the image goes with its last user's delete.
        Returns what the snapshot's manifest records of it."""
        file_digest, size, chunks = self.on_disk.file_digest(Path(path))
        touched.add(f"image:{file_digest}")
        self.s3.put_object(Bucket=self.bucket, Key=self.image_user_key(file_digest, snapshot_id), Body=b"")
        if not self._exists(self.image_key(file_digest)):
            owner = f"image-{file_digest[:32]}"

            def upload(entry):
                offset, length, sha = entry
                self.s3.put_object(Bucket=self.bucket, Key=self.ref_key(sha, owner), Body=b"")
                if not self._exists(self.chunk_key(sha)):
                    data = read_chunk(Path(path), Chunk(offset, length))
                    if data is None or digest(data) != sha:
                        raise SnapshotStoreError(f"{path} changed while it was uploaded")
                    self._put_chunk(sha, data)

            with self._pool() as pool:
                list(pool.map(upload, chunks))
            self._put_json(self.image_key(file_digest), {"size": size,
                                                         "chunk_size": self.on_disk.chunk_size_for(Path(path)),
                                                         "chunks": chunks})
            log.info("image file %s published to %s as %s", path, self._where(), file_digest[:16])
        return {"digest": file_digest, "size": size}

    def local_dir(self, snapshot_id: str, *, pending_wait: float = 0.0) -> Path:
        """``pending_wait`` (s): the snapshot may be a capture handed over before its upload ended
        (``index``): then it is mounted lazily (nothing else can read it yet), and a chunk the
        store lacks is asked for again until the upload can have put it."""
        snapshot_id = _checked(snapshot_id)
        own = self.local._dir(snapshot_id)
        if (own / "manifest.json").is_file():
            return own
        found = self.cache.lookup(snapshot_id)
        if found is not None:
            return found
        if self.lazy is not None:
            found = self._lazy_dir(snapshot_id, pending_wait)
            if found is not None:
                return found
        if pending_wait > 0 and not self._exists(self.manifest_key(snapshot_id)):
            raise SnapshotStoreError(f"snapshot {snapshot_id} is still being stored and this node cannot mount it "
                                     "lazily (AENV_LAZY_RESTORE)")
        with self.cache.entry_lock(snapshot_id):
            found = self.cache.lookup(snapshot_id)  # another restore fetched it meanwhile
            if found is not None:
                return found
            self.cache.clear_staging(snapshot_id)
            try:
                return self._download(snapshot_id)
            except SnapshotStoreError:
                raise
            except CacheFull as exc:
                raise SnapshotStoreError(str(exc)) from exc
            except Exception as exc:
                raise SnapshotStoreError(f"download of snapshot {snapshot_id} from {self._where()} failed: "
                                         f"{exc}") from exc

    def local_ids(self) -> list[str]:
        lazy = self.lazy.ids() if self.lazy is not None else []
        return sorted(set(self.local.local_ids()) | set(complete_ids(self.cache.root)) | set(lazy))

    # ------------------------------------------------------------------ lazy restores

    def _lazy_dir(self, snapshot_id: str, pending_wait: float = 0.0) -> Path | None:
        """The snapshot mounted from lazily filled files (agent.stores.lazy), or None when
        that cannot be had (logged: the caller downloads it whole instead)."""
        found = self.lazy.lookup(snapshot_id)
        if found is not None:
            return found
        try:
            with self.lazy.lock(snapshot_id):
                found = self.lazy.lookup(snapshot_id)  # another restore mounted it meanwhile
                if found is not None:
                    return found
                return self._mount_lazily(snapshot_id, pending_wait=pending_wait)
        except LazyMountFailed as exc:
            log.warning("snapshot %s: no lazy restore (%s); downloading it whole", snapshot_id, exc)
            return None
        except SnapshotStoreError:
            raise
        except Exception as exc:
            raise SnapshotStoreError(f"lazy restore of snapshot {snapshot_id} from {self._where()} failed: "
                                     f"{exc}") from exc

    def _mount_lazily(self, snapshot_id: str, *, to_record: bool = False, pending_wait: float = 0.0) -> Path:
        """``to_record``: for ``record_prefetch``: the image files mounted too (as a node that
        lacks them mounts them, so their reads are recorded under the names it uses), recording
        on, no prefetch, and no list stored after a restore (``restored``). ``pending_wait``:
        see ``local_dir`` (a pending capture has no prefetch list and records none)."""
        t0 = time.perf_counter()
        steps: dict[str, float] = {}

        def step(name: str, since: float) -> float:
            now = time.perf_counter()
            steps[name] = round((now - since) * 1000, 2)
            return now

        # The three reads at once: the manifest, the prefetch list (both from the store) and this
        # node's index of its own files (rebuilt: files came and went since the last restore).
        self.on_disk.refresh()
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="lazy-mount") as pool:
            indexed = pool.submit(self.on_disk.locate, [])
            listed = None if to_record else pool.submit(self._get_json, self.prefetch_key(snapshot_id))
            doc = self._snapshot_doc(snapshot_id, pending=pending_wait > 0)
            t = step("mount_manifest_ms", t0)
            final = self.lazy.path(snapshot_id)
            manifest = localize(doc["manifest"], final, self.images_dir)
            manifest["dir"] = str(final)
            files = _files_of(doc)
            shipped = self._ship_image_files(doc, final, manifest, files, every=to_record)
            if not shipped:  # else the files it lacks come with it: checked by adopt
                self._check_base(snapshot_id, manifest)
            for name, (size, chunks, _) in files.items():
                if not FILE_NAME.match(name):
                    raise SnapshotStoreError(f"bad file name {name!r} in the manifest of {snapshot_id}")
                for offset, length, sha in chunks:
                    if not SHA.match(sha) or offset < 0 or offset + length > size:
                        raise SnapshotStoreError(f"bad chunk entry for {name} in {snapshot_id}")
            indexed.result()
            if shipped:  # the image files it brought are this node's own now
                self.on_disk.refresh()
            local = self.on_disk.locate([c for _, chunks, _ in files.values() for c in chunks])
            t = step("mount_locate_ms", t)
            known = listed.result() if listed is not None else None
        order = known.get("order") if isinstance(known, dict) and isinstance(known.get("order"), list) else None
        pieces = _usable_pieces(known.get("pieces"), snapshot_id) if order else None
        pending = bool(doc.get("pending"))
        t = step("mount_prefetch_list_ms", t)

        def adopt(staging: Path) -> None:
            started = time.perf_counter()
            try:
                self.driver.adopt_snapshot(staging)  # e.g. each layer's backing file -> this node's
            except VMError as exc:
                raise SnapshotStoreError(f"snapshot {snapshot_id} cannot be used here: {exc}") from exc
            step("mount_adopt_ms", started)

        # every file names its own size; the mount's is the smallest, so a daemon from before
        # per-file sizes refuses the mount (the others' chunks do not fit) rather than misread RAM
        path = self.lazy.install(snapshot_id, chunk_size=min(cs for _, _, cs in files.values()),
                                 files={n: {"size": size, "chunks": chunks, "chunk_size": cs}
                                        for n, (size, chunks, cs) in files.items()},
                                 manifest=manifest, adopt=adopt, local=local, prefetch=order,
                                 record=order is None and not pending, pieces=pieces,
                                 store_wait=pending_wait if pending else 0.0)
        step("mount_install_ms", t)
        steps["mount_ms"] = round((time.perf_counter() - t0) * 1000, 2)
        if pending:
            steps["mount_pending"] = 1
        elif order is None and not to_record:
            self._recording.add(snapshot_id)
        with self._mount_timings_lock:
            while len(self._mount_timings) >= 64:  # never taken (a mount no restore followed): the oldest go
                self._mount_timings.pop(next(iter(self._mount_timings)))
            self._mount_timings[snapshot_id] = steps
        return path

    def hands_over(self) -> bool:
        return self.lazy is not None and self.lazy.takes_store_wait()

    def take_mount_timings(self, snapshot_id: str) -> dict[str, float]:
        """A restore adds them to its timings; {} when the last ``local_dir`` made no lazy mount
        (cached, own, downloaded)."""
        with self._mount_timings_lock:
            return self._mount_timings.pop(snapshot_id, {})

    def record_prefetch(self, snapshot_id: str,
                        restore: Callable[[Path], contextlib.AbstractContextManager]) -> int | None:
        """A template build's prefetch list, recorded where it was built (``agent.builder``):
        the snapshot, just committed, is mounted lazily here with recording on — its files and
        its image files, every chunk read from this node's own files (nothing fetched) — and
        ``restore(dir)`` runs a VM restored from that dir until its envd answered; what the guest
        read first until ``prefetch_settle`` seconds later becomes ``prefetch.json``, so the
        very first create of the template on any other node prefetches. The mount goes after.
        Returns the chunks recorded; None when this node has no lazy restores (or a list
        exists); raises what the mount or ``restore`` raise (the caller logs it)."""
        if self.lazy is None:
            return None
        snapshot_id = _checked(snapshot_id)
        if self._exists(self.prefetch_key(snapshot_id)):
            return None
        try:
            with self.lazy.lock(snapshot_id):
                self._mount_lazily(snapshot_id, to_record=True)
            with restore(self.lazy.path(snapshot_id)):
                time.sleep(self.prefetch_settle)
                order = (self.lazy.mount_stats(snapshot_id) or {}).get("recorded") or []
            stored = bool(order) and self._store_prefetch(snapshot_id, order, self.lazy.path(snapshot_id))
        finally:
            self.lazy.remove(snapshot_id, force=True)  # the node's own files serve its own restores
        if not stored:
            return None
        log.info("snapshot %s: the %d chunks a restore read first, recorded at its build, are its prefetch list",
                 snapshot_id, len(order))
        return len(order)

    def restored(self, snapshot_id: str) -> threading.Timer | None:
        """A VM restored from a lazily mounted snapshot answers: the first such restore's
        chunk order (recorded by the mount), after ``prefetch_settle`` seconds, becomes the
        snapshot's ``prefetch.json`` (unless one exists), which later lazy mounts replay."""
        if self.lazy is None or snapshot_id not in self._recording:
            return None
        self._recording.discard(snapshot_id)
        timer = threading.Timer(self.prefetch_settle, self._save_prefetch, args=(snapshot_id,))
        timer.daemon = True
        timer.start()
        return timer

    def _save_prefetch(self, snapshot_id: str) -> bool:
        try:
            stats = self.lazy.mount_stats(snapshot_id) or {}
            order = stats.get("recorded") or []
            if not order or self._exists(self.prefetch_key(snapshot_id)):
                return False
            # the list alone: most such snapshots (pause images, fork captures) are restored
            # once or in one burst, and pieces would be a second upload on a busy node
            if not self._store_prefetch(snapshot_id, order):
                return False
            log.info("snapshot %s: the %d chunks its first lazy restore read first are its prefetch list",
                     snapshot_id, len(order))
            return True
        except Exception:  # noqa: BLE001 - only later restores' speed depends on it
            log.exception("snapshot %s: storing its prefetch list failed", snapshot_id)
            return False

    def _store_prefetch(self, snapshot_id: str, order: list, source_dir: Path | None = None) -> bool:
        """``prefetch.json``, unless the snapshot was deleted meanwhile; with ``source_dir`` (a
        dir with the snapshot's files: the mount the list was recorded on) its prefetch pieces
        first, which the list then names."""
        if not self._exists(self.manifest_key(snapshot_id)):
            return False
        doc = {"format": PREFETCH_FORMAT, "snapshot_id": snapshot_id, "order": order}
        if source_dir is not None:
            doc["pieces"] = self._put_prefetch_pieces(snapshot_id, order, source_dir)
        self._put_json(self.prefetch_key(snapshot_id), doc)
        if not self._exists(self.manifest_key(snapshot_id)):  # deleted while these were written
            self._delete_prefetch(snapshot_id)
            return False
        return True

    def _put_prefetch_pieces(self, snapshot_id: str, order: list, source_dir: Path) -> list[dict]:
        """The prefetch pieces (``agent.stores.prefetch_pieces``) uploaded; their entries for
        the list, or [] when they could not be made (later restores fetch chunk by chunk)."""
        started = time.perf_counter()
        try:
            own = _files_of(self._snapshot_doc(snapshot_id))
            pieces = prefetch_pieces.cut(order, own, source_dir, self.chunk_compression)

            def put(n: int) -> dict:
                body, chunks = pieces[n]
                key = self.prefetch_piece_key(snapshot_id, n)
                self.s3.put_object(Bucket=self.bucket, Key=self.prefix + key, Body=body)
                return {"key": key, "chunks": chunks}

            with self._pool() as pool:
                written = list(pool.map(put, range(len(pieces))))
        except (OSError, SnapshotStoreError, BotoCoreError, ClientError) as exc:
            log.warning("snapshot %s: no prefetch pieces (%s); restores elsewhere fetch its start chunk by chunk",
                        snapshot_id, exc)
            return []
        log.info("snapshot %s: %d prefetch pieces (%d chunks, %.1f MiB) in %.0f ms", snapshot_id, len(written),
                 sum(len(p["chunks"]) for p in written), sum(len(b) for b, _ in pieces) / (1 << 20),
                 (time.perf_counter() - started) * 1000)
        return written

    def warm_up(self) -> threading.Thread | None:
        """At node start, in the background: the chunkfs daemon started and this node's own
        files indexed (``LocalChunks``), so the first lazy restore (a sandbox resumed here from
        another node) pays for neither (the daemon's start, seconds of hashing after a new image
        build). Failures are only logged: that restore does them itself."""
        if self.lazy is None:
            return None

        def run() -> None:
            try:
                self.lazy.client()
            except Exception as exc:  # noqa: BLE001 - the restore tries again (and falls back)
                log.warning("lazy restores: the chunkfs daemon could not be started ahead: %s", exc)
            try:
                self.on_disk.locate([])
            except Exception:  # noqa: BLE001
                log.exception("lazy restores: indexing this node's own chunks failed")

        thread = threading.Thread(target=run, name="lazy-warm-up", daemon=True)
        thread.start()
        return thread

    def own_files(self) -> dict[str, list[list]]:
        """``{path: [[offset, length, sha], ...]}`` of this node's own files (committed captures,
        image builds, downloads), freshly indexed: what peer fetch may give other nodes from
        them (``agent.chunk_peers``, the daemon's ``own`` op)."""
        return self.on_disk.files()

    def chunk_cache_figures(self) -> dict | None:
        """The node's chunk cache figures (``lazy.cache_figures``) while its chunkfs daemon runs."""
        return cache_figures(self.lazy.cache_stats()) if self.lazy is not None else None

    def _snapshot_doc(self, snapshot_id: str, pending: bool = False) -> dict:
        """The snapshot's manifest; ``pending``: else a hand-off's pending one (``index``)."""
        doc = self._get_json(self.manifest_key(snapshot_id))
        if doc is None and pending:
            doc = self._get_json(self.pending_key(snapshot_id))
        if doc is None:
            raise SnapshotStoreError(f"snapshot {snapshot_id} is neither on this node nor in {self._where()}")
        if doc.get("format") != FORMAT:
            raise SnapshotStoreError(f"snapshot {snapshot_id} has an unknown format {doc.get('format')!r}")
        return doc

    def _download(self, snapshot_id: str) -> Path:
        doc = self._snapshot_doc(snapshot_id)
        final = self.cache.path(snapshot_id)
        manifest = localize(doc["manifest"], final, self.images_dir)
        manifest["dir"] = str(final)
        files = _files_of(doc)
        shipped = self._ship_image_files(doc, final, manifest, files)
        if not shipped:  # else the files it lacks come with it: checked once they are here
            self._check_base(snapshot_id, manifest)
        self.cache.make_room(int(doc.get("stored_bytes") or 0)
                             + sum(files[name][0] for name in shipped), keep=snapshot_id)
        staging = self.cache.staging_dir(snapshot_id)
        self.on_disk.refresh()  # files came and went since the last download
        try:
            self._fetch_files(doc.get("snapshot_id"), files, staging)
            (staging / "manifest.json").write_text(json.dumps(manifest, indent=2))
            try:
                self.driver.adopt_snapshot(staging)  # e.g. each layer's backing file -> this node's
            except VMError as exc:
                raise SnapshotStoreError(f"snapshot {snapshot_id} cannot be used here: {exc}") from exc
            path = self.cache.install(staging, snapshot_id)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        log.info("snapshot %s downloaded from %s into %s", snapshot_id, self._where(), path)
        return path

    def _ship_image_files(self, doc: dict, final: Path, manifest: dict, files: dict,
                          every: bool = False) -> list[str]:
        """Each file the snapshot needs from the images dir is used from this node's own
        only when its content is the same (by digest: two nodes' builds of one recipe may
        differ, and a disk layer over another base, or a running guest over another tools
        drive, would read garbage); otherwise it comes with the snapshot, from the store,
        into the snapshot's own dir, and ``manifest`` names that copy. Adds the files to
        fetch to ``files``; returns their names. ``every``: all of them, whatever this node has
        (``record_prefetch``)."""
        shipped = []
        for role, info in sorted((doc.get("image_files") or {}).items()):
            local = localize(info["path"], final, self.images_dir)
            if not every and Path(local).is_file() and self.on_disk.file_digest(Path(local))[0] == info["digest"]:
                continue
            image = self._get_json(self.image_key(info["digest"]))
            if image is None and isinstance(info.get("chunks"), list):  # a hand-off's, not published yet
                image = {"size": info["size"], "chunks": info["chunks"], "chunk_size": info.get("chunk_size")}
            if image is None:
                raise SnapshotStoreError(f"snapshot {doc.get('snapshot_id')} needs image file {info['path']} "
                                         f"({info['digest'][:16]}), which {self._where()} does not have")
            name = f"image-{role}{Path(local).suffix}"
            files[name] = (int(image["size"]), image["chunks"], _doc_chunk_size(image))
            replace_path(manifest, local, str(final / name))
            shipped.append(name)
        return shipped

    def _check_base(self, snapshot_id: str, manifest: dict) -> None:
        """Before anything is downloaded: this node can restore the snapshot (the driver
        checks what it needs from the node that the snapshot does not carry)."""
        try:
            self.driver.check_snapshot(SnapshotManifest.from_json(manifest))
        except VMError as exc:
            raise SnapshotStoreError(f"snapshot {snapshot_id} {exc}") from exc

    def _fetch_files(self, snapshot_id: str, files: dict, staging: Path) -> dict:
        """Writes ``files`` ({name: (size, chunks, chunk size)}) into ``staging``: each chunk from this
        node's own files when one has it (verified), else from the store. Returns the counts."""
        fds = {}
        try:
            jobs = []
            for name, (size, chunks, _) in files.items():
                if not FILE_NAME.match(name):
                    raise SnapshotStoreError(f"bad file name {name!r} in the manifest of {snapshot_id}")
                fd = os.open(staging / name, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
                fds[name] = fd
                os.ftruncate(fd, size)
                for offset, length, sha in chunks:
                    if not SHA.match(sha) or offset < 0 or offset + length > size:
                        raise SnapshotStoreError(f"bad chunk entry for {name} in {snapshot_id}")
                    jobs.append((fd, int(offset), int(length), sha))

            def fetch(job) -> int:
                fd, offset, length, sha = job
                data = self.on_disk.read(sha, length)
                if data is not None:
                    os.pwrite(fd, data, offset)
                    return 0
                answer = self.s3.get_object(Bucket=self.bucket, Key=self.chunk_key(sha))
                try:  # compressed, it is smaller than the chunk: more than asked is wrong anyway
                    body = answer["Body"].read(length + 1)
                finally:
                    answer["Body"].close()
                try:
                    data = decode(body, answer.get("Metadata"), length)
                except BadEncoding as exc:
                    raise SnapshotStoreError(f"chunk {sha} is damaged in {self._where()}: {exc}") from None
                if len(data) != length or digest(data) != sha:
                    raise SnapshotStoreError(f"chunk {sha} is damaged in {self._where()}")
                os.pwrite(fd, data, offset)
                return 1

            with self._pool() as pool:
                fetched = sum(pool.map(fetch, jobs))
            for fd in fds.values():
                os.fsync(fd)
        finally:
            for fd in fds.values():
                os.close(fd)
        log.info("snapshot %s: %d of %d chunks fetched from %s, the rest read from this node's files",
                 snapshot_id, fetched, len(jobs), self._where())
        return {"chunks": len(jobs), "fetched": fetched}

    def drop_local(self, snapshot_id: str) -> None:
        """The bucket has it (``commit``): this node's capture and cached copy can go."""
        snapshot_id = _checked(snapshot_id)
        self.on_disk.forget(self.local._dir(snapshot_id))
        self.local.delete(snapshot_id)
        self.cache.remove(snapshot_id)
        if self.lazy is not None:
            self.lazy.remove(snapshot_id)

    def delete(self, snapshot_id: str) -> bool:
        """Removes the manifest, this node's copies and the chunks no other snapshot
        uses. Other nodes' cached copies go by LRU eviction."""
        snapshot_id = _checked(snapshot_id)
        self.on_disk.forget(self.local._dir(snapshot_id))
        removed = self.local.delete(snapshot_id)
        removed = self.cache.remove(snapshot_id) or removed
        if self.lazy is not None:
            self._recording.discard(snapshot_id)
            removed = self.lazy.remove(snapshot_id) or removed
            if self.lazy.lookup(snapshot_id) is not None:  # kept: a VM here reads it, and the chunks go
                try:
                    self.lazy.pin(snapshot_id)
                except LazyMountFailed as exc:
                    raise SnapshotStoreError(f"snapshot {snapshot_id} is read lazily by a VM on this node and its "
                                             f"chunks could not all be kept before the delete: {exc}") from exc
        try:
            return self._delete_remote(snapshot_id) or removed
        except SnapshotStoreError:
            raise
        except Exception as exc:
            raise SnapshotStoreError(f"deleting snapshot {snapshot_id} from {self._where()} failed: {exc}") from exc


def _doc_chunk_size(doc: dict) -> int:
    """A manifest's (or image file's) chunk size: the one all its files had before files
    named their own (4 MiB when even that is missing)."""
    return int(doc.get("chunk_size") or CHUNK_SIZE)


def _usable_pieces(value, snapshot_id: str) -> list | None:
    """A prefetch list's pieces as the chunkfs daemon takes them, or None (none, or not
    well-formed: then the list is walked chunk by chunk rather than the mount refused)."""
    if not value:
        return None
    try:
        parse_pieces(value)
    except ValueError as exc:
        log.warning("snapshot %s: its prefetch pieces are unusable (%s)", snapshot_id, exc)
        return None
    return value


def _files_of(doc: dict) -> dict[str, tuple[int, list, int]]:
    """{name: (size, chunks, chunk size)} of a snapshot manifest; a file without a chunk size
    of its own (a manifest from before RAM was cut smaller) has the manifest's."""
    default = _doc_chunk_size(doc)
    return {name: (int(info["size"]), info["chunks"], int(info.get("chunk_size") or default))
            for name, info in doc["files"].items()}
