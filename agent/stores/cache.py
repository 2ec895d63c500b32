"""A node's bounded cache of snapshots downloaded from the object store.

Layout: ``<root>/<snapshot id>/`` (a complete copy: files + local manifest.json),
``<root>/.tmp-<id>-<rand>/`` (a download in progress), ``<root>/.lock`` and
``<root>/.lock-<id>`` (flock files). An entry is installed by one rename, so a
directory named after a snapshot id is always complete.

Eviction is least-recently-used (``.last_used`` mtime, touched on every lookup)
and never removes an entry a VM on this node still reads: restored VMs map the
snapshot's memory and stack their disk on its layers, and the VM driver says which
files its VMs use (``files_in_use()``, e.g. from QEMU's vm.json records). A lookup also
pins the entry for ``pin_seconds``, covering a restore between lookup and the VM's record."""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

from agent.stores.chunks import allocated_bytes

log = logging.getLogger(__name__)

LAST_USED = ".last_used"


class CacheFull(Exception):
    """The entry does not fit even after evicting everything not in use."""


class SnapshotCache:
    def __init__(self, root: Path, files_in_use: Callable[[], Iterable[str]], limit_bytes: int,
                 pin_seconds: float = 600.0):
        """``files_in_use``: the node's VM driver's ``files_in_use`` (paths its VMs read)."""
        self.root = Path(root).absolute()
        self.files_in_use = files_in_use
        self.limit_bytes = int(limit_bytes)
        self.pin_seconds = float(pin_seconds)

    # ------------------------------------------------------------------ entries

    def path(self, snapshot_id: str) -> Path:
        return self.root / snapshot_id

    def lookup(self, snapshot_id: str) -> Path | None:
        """The complete entry (marked used now), or None."""
        path = self.path(snapshot_id)
        with self.cache_lock():  # not evicted between the check and the touch
            if not (path / "manifest.json").is_file():
                return None
            (path / LAST_USED).touch()
        return path

    def clear_staging(self, snapshot_id: str) -> None:
        """Leftovers of an interrupted download of this id (call with its entry lock)."""
        for path in self.root.glob(f".tmp-{snapshot_id}-*"):
            shutil.rmtree(path, ignore_errors=True)

    def entries(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return [p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")]

    def used_bytes(self) -> int:
        """Everything under the cache root, downloads in progress included."""
        return allocated_bytes(self.root) if self.root.is_dir() else 0

    def in_use(self, entry: Path) -> bool:
        """A VM on this node reads the entry's files, or it was looked up moments ago."""
        try:
            if time.time() - (entry / LAST_USED).stat().st_mtime < self.pin_seconds:
                return True
        except FileNotFoundError:
            pass
        inside = f"{entry}/"
        return any(str(path).startswith(inside) for path in self.files_in_use())

    # ------------------------------------------------------------------ locks

    @contextlib.contextmanager
    def _flock(self, name: str):
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / name, "a") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def entry_lock(self, snapshot_id: str):
        """Held while one snapshot is downloaded or removed (one download per id)."""
        return self._flock(f".lock-{snapshot_id}")

    def cache_lock(self):
        """Held while sizes are counted and entries evicted or installed."""
        return self._flock(".lock")

    # ------------------------------------------------------------------ space

    def make_room(self, needed_bytes: int, keep: str = "") -> list[str]:
        """Evicts least recently used entries (not in use, not ``keep``) until
        ``needed_bytes`` more fit under the limit; CacheFull if they cannot."""
        evicted = []
        with self.cache_lock():
            self._sweep_leftovers()
            used = self.used_bytes()
            candidates = sorted((e for e in self.entries() if e.name != keep), key=_last_used)
            for entry in candidates:
                if used + needed_bytes <= self.limit_bytes:
                    break
                if self.in_use(entry):
                    continue
                size = allocated_bytes(entry)
                if self._remove(entry):
                    used -= size
                    evicted.append(entry.name)
            if used + needed_bytes > self.limit_bytes:
                raise CacheFull(f"snapshot cache {self.root} is full: {used >> 20} MiB held by snapshots in use, "
                                f"{needed_bytes >> 20} MiB more needed, limit {self.limit_bytes >> 20} MiB "
                                "(AENV_SNAPSHOT_CACHE_MB)")
        for name in evicted:
            log.info("snapshot cache: evicted %s", name)
        return evicted

    def _sweep_leftovers(self) -> None:
        """Removes what a crashed worker left: half-removed entries, and downloads of
        ids nobody is downloading now (their entry lock is free)."""
        for path in self.root.glob(".tmp-*"):
            if path.name.startswith(".tmp-rm-"):
                shutil.rmtree(path, ignore_errors=True)
                continue
            snapshot_id = path.name[len(".tmp-"):].rsplit("-", 1)[0]
            with open(self.root / f".lock-{snapshot_id}", "a") as f:
                try:
                    fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a download of this id is running
                try:
                    shutil.rmtree(path, ignore_errors=True)
                finally:
                    fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def staging_dir(self, snapshot_id: str) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / f".tmp-{snapshot_id}-{uuid.uuid4().hex[:8]}"
        path.mkdir()
        return path

    def install(self, staging: Path, snapshot_id: str) -> Path:
        """Makes a finished download the entry, by one rename."""
        final = self.path(snapshot_id)
        (staging / LAST_USED).touch()
        with self.cache_lock():
            os.rename(staging, final)
        return final

    def remove(self, snapshot_id: str) -> bool:
        """Removes the entry unless a VM still uses it (it is then evicted later)."""
        entry = self.path(snapshot_id)
        if not entry.exists():
            return False
        with self.entry_lock(snapshot_id), self.cache_lock():
            if self._vm_uses(entry):
                log.warning("snapshot cache: %s is still used by a VM on this node; kept until evicted", entry)
                return False
            return self._remove(entry)

    def _vm_uses(self, entry: Path) -> bool:
        saved, self.pin_seconds = self.pin_seconds, 0.0
        try:
            return self.in_use(entry)
        finally:
            self.pin_seconds = saved

    @staticmethod
    def _remove(entry: Path) -> bool:
        # Renamed first, so a half-removed entry never looks complete.
        doomed = entry.with_name(f".tmp-rm-{entry.name}-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(entry, doomed)
        except FileNotFoundError:
            return False
        shutil.rmtree(doomed, ignore_errors=True)
        return True


def _last_used(entry: Path) -> float:
    try:
        return (entry / LAST_USED).stat().st_mtime
    except FileNotFoundError:
        return 0.0
