"""Ready-made RAM files for restores from booted templates.

Why: a sandbox restored from a template snapshot gets its own share=on RAM file, a sparse
copy of the snapshot's (so its later pauses, snapshots and forks migrate only device
state). That copy (~150 MiB of touched pages at 512 MiB, ~150 ms of a core) used to run on
every create, beside the QEMU start it competes with on a small host. Here the copy for the
*next* create of a template is made in the background once a create that took the current
one has its VM answering, so a create of a recently used template only renames a finished file into place.

Bounds: at most `per_source` ready copies of each of the `max_sources` most recently used
snapshots; a copy is made only while the tmpfs keeps `headroom_mb` free beyond it, and
`drop_all()` frees them at once when a VM needs the room. A copy is tied to its source's
identity (device, inode, size, mtime), so a rebuilt template never gets a stale one. Files
are ``aenv-warm-<home tag>-<pid>-*.ram`` in the tmpfs: an instance removes its own at exit,
and every new one removes those whose process is gone (killed, whatever its home).
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import threading
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from vmm.qemu import ramfile
from vmm.qemu.state import process_alive

log = logging.getLogger(__name__)


def _identity(src: Path) -> tuple:
    st = os.stat(src)
    return (str(src), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class WarmRamCopies:
    def __init__(self, shm_dir: Path, tag: str, per_source: int = 1, max_sources: int = 2,
                 headroom_mb: int = 1024):
        self.shm_dir = Path(shm_dir)
        self.prefix = f"aenv-warm-{tag}-{os.getpid()}-"
        self.per_source = max(0, int(per_source))
        self.max_sources = max(1, int(max_sources))
        self.headroom_mb = int(headroom_mb)
        self._mutex = threading.Lock()
        self._ready: OrderedDict[tuple, list[Path]] = OrderedDict()  # identity -> finished copies, LRU order
        self._filling: set[tuple] = set()
        self._pool: ThreadPoolExecutor | None = None
        self.copier: ramfile.LazyCopier | None = None  # QemuDriver.set_lazy_ram_copier
        sweep_leftovers(self.shm_dir)
        if self.per_source:
            atexit.register(self.drop_all)  # a worker that stops leaves no copies behind

    @property
    def enabled(self) -> bool:
        return self.per_source > 0

    def take(self, src: Path, dest: Path) -> bool:
        """Moves a finished copy of `src` to `dest` (same tmpfs) and returns True, or returns
        False when there is none. The caller calls refill_later(src) once its VM answers:
        a copy made meanwhile would compete with that VM's start for the host's cores."""
        ident = self._identity_if_enabled(src)
        if ident is None:
            return False
        taken = self._mark_used(ident, take=True)
        if taken is None:
            return False
        try:
            os.replace(taken, dest)
        except OSError:
            taken.unlink(missing_ok=True)
            return False
        return True

    def prepare(self, src: Path) -> None:
        """Makes a copy of `src` ahead of its first restore (a node's default template at start)."""
        ident = self._identity_if_enabled(src)
        if ident is not None:
            self._mark_used(ident, take=False)
            self.refill_later(src)

    def refill_later(self, src: Path) -> None:
        """Starts making copies of `src` up to per_source, in one background thread."""
        ident = self._identity_if_enabled(src)
        if ident is None:
            return
        with self._mutex:
            if ident in self._filling or len(self._ready.get(ident, ())) >= self.per_source:
                return
            self._filling.add(ident)
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="warm-ram")
            self._pool.submit(self._fill, src, ident)

    def _identity_if_enabled(self, src: Path) -> tuple | None:
        return _identity_or_none(src) if self.enabled else None

    def _mark_used(self, ident: tuple, take: bool) -> Path | None:
        """Records `ident` as the most recently used source (the least recent beyond
        max_sources lose their copies) and, with `take`, pops one of its ready copies."""
        with self._mutex:
            copies = self._ready.setdefault(ident, [])
            taken = copies.pop() if take and copies else None
            self._ready.move_to_end(ident)
            evicted = self._evict_locked()
        for path in evicted:
            path.unlink(missing_ok=True)
        return taken

    def _fill(self, src: Path, ident: tuple) -> None:
        try:
            while True:
                with self._mutex:
                    if ident not in self._ready or len(self._ready[ident]) >= self.per_source:
                        return
                size = ident[3]
                free = shutil.disk_usage(self.shm_dir).free
                if free < ramfile.allocated(src) + (self.headroom_mb << 20) + size:
                    return  # the tmpfs is for guests first
                path = self.shm_dir / f"{self.prefix}{uuid.uuid4().hex[:12]}.ram"
                try:
                    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                    try:
                        os.ftruncate(fd, size)
                        ramfile.copy_into(src, fd, path, self.copier)  # a lazily filled snapshot's: by its daemon
                    finally:
                        os.close(fd)
                except OSError:
                    path.unlink(missing_ok=True)
                    log.warning("warm RAM copy of %s failed", src, exc_info=True)
                    return
                with self._mutex:
                    stale = ident not in self._ready or _identity_or_none(src) != ident
                    if not stale:
                        self._ready[ident].append(path)
                if stale:
                    path.unlink(missing_ok=True)
                    return
        finally:
            with self._mutex:
                self._filling.discard(ident)

    def _evict_locked(self) -> list[Path]:
        gone: list[Path] = []
        while len(self._ready) > self.max_sources:
            _, copies = self._ready.popitem(last=False)
            gone.extend(copies)
        for ident in [i for i in self._ready if _identity_or_none(Path(i[0])) != i]:
            gone.extend(self._ready.pop(ident))  # the template was rebuilt or deleted
        return gone

    def drop_all(self) -> int:
        """Frees every ready copy (a VM needs the tmpfs); returns the bytes given back."""
        with self._mutex:
            copies = [p for ps in self._ready.values() for p in ps]
            for ident in self._ready:
                self._ready[ident] = []
        freed = 0
        for path in copies:
            try:
                freed += ramfile.allocated(path)
                path.unlink()
            except FileNotFoundError:
                pass
        return freed

    def ready_count(self) -> int:
        with self._mutex:
            return sum(len(ps) for ps in self._ready.values())

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Waits for the background copies in flight (tests, shutdown)."""
        pool = self._pool
        if pool is not None:
            pool.submit(lambda: None).result(timeout)


def sweep_leftovers(shm_dir: Path) -> int:
    """Removes the ready copies of processes that are gone; returns how many."""
    gone = 0
    for leftover in Path(shm_dir).glob("aenv-warm-*.ram"):
        parts = leftover.name.split("-")  # aenv, warm, <tag>, <pid>, <uuid>.ram
        # any live process of that pid (the name holds no other marker to check)
        if len(parts) == 5 and parts[3].isdigit() and process_alive(int(parts[3]), ""):
            continue
        leftover.unlink(missing_ok=True)
        gone += 1
    return gone


def _identity_or_none(src: Path):
    try:
        return _identity(src)
    except OSError:
        return None
