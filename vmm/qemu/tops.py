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


def _key(backing: Path, size_mb: int) -> str:
    st = os.stat(backing)
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
                pristine.parent.mkdir(parents=True, exist_ok=True)
                tmp = pristine.with_name(f"{pristine.name}.{os.getpid()}-{threading.get_ident()}.tmp")
                try:
                    # -u: the backing chain is not opened. Its headers are the VM's to read, at its
                    # start; read here too they cost a lazily filled layer (issue 24) a fetch of each
                    # layer's first chunk on the create's path. The overlay's bytes are the same.
                    run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(backing), "-F", "qcow2", "-u",
                         str(tmp), f"{size_mb}M"])
                    os.replace(tmp, pristine)
                finally:
                    tmp.unlink(missing_ok=True)
                prune(pristine.parent)
    tmp_dest = dest.with_name(dest.name + ".tmp")
    shutil.copyfile(pristine, tmp_dest)
    os.replace(tmp_dest, dest)
    try:
        os.utime(pristine)  # its last use, for prune()
    except FileNotFoundError:
        pass


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
