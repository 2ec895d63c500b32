"""The C heap of aenv's long-running threaded processes, the node worker (``agent.worker``) and
the API (``config.asgi``), kept from growing with their threads: at most ``AENV_MALLOC_ARENAS``
glibc malloc arenas, and the free memory in them given back to the host every
``AENV_MALLOC_TRIM_INTERVAL`` seconds.

Why: the node worker runs its tasks on ~32 threads (Celery's pool, the heartbeat, the watch, the
samplers), the API its requests on a pool of threads. glibc gives each thread that allocates
while the others hold theirs an arena of its own (up to 8 per core), and memory freed in an
arena stays in it, mapped, for that arena's threads only. Python's objects above 512 bytes (buffers, command output, JSON, netlink
messages) come from there. In the soaks (issue 27) the worker's RSS grew 29.5 % in 100 minutes
after its warm-up (the fourth run) and ~23 % in two hours (the seventh, the API's 16 %); the
worker's smaps then showed ~60–69 MiB in thread arenas (64 MiB-aligned heaps) and 40–42 MiB in
the main heap, while Python's own small-object arenas held under 10 MiB; the API's thread
arenas went from 36 to 42 MiB in 40 minutes as more of them appeared. Fewer arenas reuse each
other's free memory; ``malloc_trim`` returns whole free pages inside every arena to the host
(``madvise``), which glibc does on its own only at the top of the main heap.

Both act through glibc's own calls (``mallopt(M_ARENA_MAX)``, ``malloc_trim``); elsewhere (musl)
they do nothing. Here in ``vmm`` (no Django) because both processes use it and the control plane
never imports the node agent."""
from __future__ import annotations

import ctypes
import functools
import logging
import threading

log = logging.getLogger(__name__)

M_ARENA_MAX = -8  # glibc's malloc.h


@functools.cache
def _libc():
    """The process's own C library, once (``find_library`` would run ``ldconfig`` at every call:
    the trimmer's every minute); None where it has no ``mallopt`` / ``malloc_trim`` (not glibc)."""
    libc = ctypes.CDLL(None)  # the symbols the process already has, its C library's among them
    if not hasattr(libc, "mallopt") or not hasattr(libc, "malloc_trim"):
        return None
    return libc


def limit_arenas(count: int) -> bool:
    """At most ``count`` malloc arenas from now on (arenas made before stay); False where the C
    library cannot (or ``count`` is 0: glibc's own limit)."""
    libc = _libc()
    if libc is None or count <= 0:
        return False
    return bool(libc.mallopt(M_ARENA_MAX, int(count)))


def trim() -> bool:
    """Free pages of every arena given back to the host; True when some were."""
    libc = _libc()
    return bool(libc is not None and libc.malloc_trim(0))


class Trimmer:
    """``trim`` every ``interval`` seconds on a thread of its own (0: never)."""

    def __init__(self, interval: float):
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.interval <= 0 or _libc() is None:
            return
        self._thread = threading.Thread(target=self._run, name="aenv-malloc-trim", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                trim()
            except Exception:  # noqa: BLE001 - a trim that fails only leaves the memory where it was
                log.exception("malloc_trim failed")

    def stop(self) -> None:
        self._stop.set()
