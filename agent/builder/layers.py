"""The node's template layer cache: one entry per build step, keyed by the step's chain
key (``agent.builder.plan``: team, base, the steps up to it), so a rebuild reuses every
unchanged step.

An entry is a directory ``<root>/<key>/`` with ``meta.json`` (written last: an entry
without it is unfinished) and, for a step that changed the disk, ``layer.qcow2``: the
step's sealed disk layer (``VMDriver.seal_layer``), whose parent is the layer below it in
``meta["chain"]`` (base first: the image's root disk, or a base template's layers). The
build VM seals straight into the entry (a layer's path is in its child's header, so it
never moves); a key another build is writing right now (its ``.lock`` held) is sealed
into a private directory instead and not cached.

Bounded (``AENV_IMAGE_CACHE_MB``, with the pulled images and their disks, see
``agent.builder.images``): least recently used entries go first, together with every
entry stacked on them, never one a VM uses (``driver.files_in_use()``) or a running build
holds (``pin``)."""
from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

META, LAYER, LOCK_SUFFIX = "meta.json", "layer.qcow2", ".lock"


@dataclass
class Entry:
    key: str
    dir: Path
    meta: dict

    @property
    def chain(self) -> list[str]:
        return list(self.meta.get("chain") or [])

    @property
    def layer(self) -> Path | None:
        return self.dir / LAYER if self.meta.get("layer") else None

    @property
    def size_bytes(self) -> int:
        layer = self.layer
        try:
            return layer.stat().st_blocks * 512 if layer is not None else 0
        except OSError:
            return 0


class Slot:
    """Where one step's layer is sealed: a cache entry being written (``cached``) or a
    private directory. ``commit(meta)`` finishes it."""

    def __init__(self, cache: "LayerCache", key: str, dir: Path, lock_fd: int | None):
        self.cache, self.key, self.dir, self._lock_fd = cache, key, dir, lock_fd

    @property
    def cached(self) -> bool:
        return self._lock_fd is not None

    @property
    def layer_path(self) -> Path:
        return self.dir / LAYER

    def commit(self, meta: dict) -> Entry:
        meta = {**meta, "key": self.key, "created_at": time.time()}
        tmp = self.dir / f".{META}.tmp"
        tmp.write_text(json.dumps(meta, indent=2))
        os.replace(tmp, self.dir / META)
        self.release()
        return Entry(self.key, self.dir, meta)

    def abandon(self) -> None:
        """Nothing was sealed: the unfinished entry goes (a private dir goes at cleanup)."""
        if self.cached:
            shutil.rmtree(self.dir, ignore_errors=True)
        self.release()

    def release(self) -> None:
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None


class LayerCache:
    def __init__(self, root: Path):
        self.root = Path(root).absolute()
        self.private = self.root / ".private"
        self._pins: dict[str, int] = {}
        self._mutex = threading.Lock()

    # -- lookups --------------------------------------------------------------------------

    def get(self, key: str) -> Entry | None:
        """The finished entry ``key`` whose whole chain is still on disk (else None: a
        miss), marked as just used."""
        d = self.root / key
        try:
            meta = json.loads((d / META).read_text())
        except (OSError, ValueError):
            return None
        entry = Entry(key, d, meta)
        if not all(Path(p).is_file() for p in entry.chain):
            return None
        try:
            os.utime(d / META)
        except OSError:
            pass
        return entry

    def entries(self) -> list[Entry]:
        out = []
        for d in self.root.iterdir() if self.root.is_dir() else []:
            if d.is_dir() and not d.name.startswith("."):
                try:
                    out.append(Entry(d.name, d, json.loads((d / META).read_text())))
                except (OSError, ValueError):
                    continue
        return out

    # -- writing --------------------------------------------------------------------------

    def slot(self, key: str) -> Slot:
        """A place to seal ``key``'s layer: the cache entry itself if nobody else is
        writing it (a leftover of a crashed build is cleared first), else a private dir."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / f"{key}{LOCK_SUFFIX}", os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return self._private(key)
        d = self.root / key
        if (d / META).is_file():  # finished meanwhile (or forced: rebuilt privately)
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            return self._private(key)
        shutil.rmtree(d, ignore_errors=True)  # unfinished: nobody holds its lock
        d.mkdir()
        return Slot(self, key, d, fd)

    def _private(self, key: str) -> Slot:
        d = self.private / f"{key[:16]}-{uuid.uuid4().hex[:8]}"
        d.mkdir(parents=True)
        return Slot(self, key, d, None)

    def remove_private(self, slot: Slot) -> None:
        if not slot.cached:
            shutil.rmtree(slot.dir, ignore_errors=True)

    # -- pins and eviction ----------------------------------------------------------------

    @contextmanager
    def pinned(self, entries: list[Entry]):
        """Keeps ``entries`` (a running build's chain) from eviction while the block runs."""
        keys = [e.key for e in entries]
        with self._mutex:
            for k in keys:
                self._pins[k] = self._pins.get(k, 0) + 1
        try:
            yield
        finally:
            with self._mutex:
                for k in keys:
                    self._pins[k] -= 1
                    if not self._pins[k]:
                        del self._pins[k]

    def size_bytes(self) -> int:
        return sum(e.size_bytes for e in self.entries())

    def evict(self, over_bytes: int, in_use: set[str]) -> list[str]:
        """Removes least recently used entries until ``over_bytes`` are freed (or nothing
        more may go); an entry goes with every entry stacked on it, and never while one of
        them is pinned or a file of theirs is in ``in_use``. Returns the removed keys."""
        entries = self.entries()
        by_layer = {str(e.layer): e for e in entries if e.layer is not None}
        dependents: dict[str, set[str]] = {e.key: set() for e in entries}
        for e in entries:
            for path in e.chain:
                owner = by_layer.get(path)
                if owner is not None and owner.key != e.key:
                    dependents[owner.key].add(e.key)
        index = {e.key: e for e in entries}

        def last_used(e: Entry) -> float:
            try:
                return (e.dir / META).stat().st_mtime
            except OSError:
                return 0.0

        removed: list[str] = []
        freed = 0
        for e in sorted(entries, key=last_used):
            if freed >= over_bytes:
                break
            if e.key in removed:
                continue
            group = [index[k] for k in {e.key, *dependents[e.key]} if k in index and k not in removed]
            with self._mutex:
                held = any(g.key in self._pins for g in group)
            if held or any(g.layer is not None and str(g.layer) in in_use for g in group):
                continue
            for g in group:
                freed += g.size_bytes
                shutil.rmtree(g.dir, ignore_errors=True)
                removed.append(g.key)
        if removed:
            log.info("layer cache: evicted %d entries (%.1f MiB)", len(removed), freed / 2**20)
        return removed

    def gc(self) -> int:
        """Removes unfinished entries nobody is writing and private dirs no build holds
        (leftovers of a crashed build; call at node start). Returns how many."""
        n = 0
        if not self.root.is_dir():
            return 0
        shutil.rmtree(self.private, ignore_errors=True)
        for d in self.root.iterdir():
            if not d.is_dir() or d.name.startswith(".") or (d / META).is_file():
                continue
            fd = os.open(self.root / f"{d.name}{LOCK_SUFFIX}", os.O_CREAT | os.O_RDWR, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            shutil.rmtree(d, ignore_errors=True)
            n += 1
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        return n
