"""A sandbox's writable disk top: an empty qcow2 overlay over the last layer of its chain.

Why a cache: ``qemu-img create`` is a process start (~35 ms here, on the create path of
every sandbox, competing with the QEMU that starts next). An empty overlay of a given
backing file and virtual size is the same bytes every time (the backing path is absolute),
so the first one is made with ``qemu-img`` into ``<home>/tops/`` and every later one is a
copy of that pristine file (a few hundred KiB, well under a millisecond). The key includes
the backing file's identity (device, inode, size, mtime), so a rebuilt layer never gets an
overlay made for its predecessor. The backing chain is never opened for it (``-u``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
from pathlib import Path

from vmm.qemu.process import run

_lock = threading.Lock()


def _key(backing: Path, size_mb: int, st: os.stat_result | None = None) -> str:
    """``st``: the backing file's stat when it is not yet at ``backing`` (``adopt``)."""
    st = st or os.stat(backing)
    ident = f"{backing}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{size_mb}"
    return hashlib.sha256(ident.encode()).hexdigest()[:32]


def create_top(cache_dir: Path, backing: str | Path, size_mb: int, dest: Path) -> None:
    """Writes an empty qcow2 overlay of `size_mb` over `backing` at `dest` (which must not
    exist), copied from the cached pristine overlay, made on first use."""
    backing = Path(backing)
    pristine = Path(cache_dir) / f"{_key(backing, size_mb)}.qcow2"
    if not pristine.is_file():
        with _lock:  # one qemu-img per key in this process; rename makes it atomic across processes
            if not pristine.is_file():
                os.replace(draft(cache_dir, backing, size_mb), pristine)
                prune(pristine.parent)
    tmp_dest = dest.with_name(dest.name + ".tmp")
    shutil.copyfile(pristine, tmp_dest)
    os.replace(tmp_dest, dest)
    try:
        os.utime(pristine)  # its last use, for prune()
    except FileNotFoundError:
        pass


def draft(cache_dir: Path, backing: str | Path, size_mb: int) -> Path:
    """An empty overlay over ``backing`` (which need not exist yet: the chain is never
    opened) in a temporary file of ``cache_dir``, for ``adopt``: made while a snapshot that
    arrives from another node is being installed, so its first create copies it rather than
    start ``qemu-img`` on its own path."""
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir / f"draft-{os.getpid()}-{threading.get_ident()}-{os.urandom(4).hex()}.tmp"
    try:
        # -u: the backing chain is not opened. Its headers are the VM's to read, at its start;
        # read here too they cost a lazily filled layer (issue 24) a fetch of each layer's first
        # chunk on the create's path. The overlay's bytes are the same.
        run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(backing), "-F", "qcow2", "-u", str(tmp),
             f"{size_mb}M"])
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def adopt(cache_dir: Path, drafted: Path, backing: str | Path, size_mb: int, st: os.stat_result) -> None:
    """A ``draft`` becomes the pristine overlay of ``backing`` (a path the backing file is
    about to have; ``st`` its stat now, as it will be there), unless one exists."""
    pristine = Path(cache_dir) / f"{_key(Path(backing), size_mb, st)}.qcow2"
    if pristine.is_file():
        drafted.unlink(missing_ok=True)
        return
    os.replace(drafted, pristine)
    prune(pristine.parent)


def prune(cache_dir: Path, keep: int = 64) -> int:
    """Removes all but the `keep` most recently used pristine overlays (their backing layers
    come and go with templates); returns how many went."""
    try:
        files = sorted(Path(cache_dir).glob("*.qcow2"), key=lambda p: p.stat().st_mtime, reverse=True)
    except FileNotFoundError:
        return 0
    gone = 0
    for f in files[keep:]:
        try:
            f.unlink()
            gone += 1
        except FileNotFoundError:
            pass
    return gone
