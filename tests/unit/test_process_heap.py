"""The C heap of the node worker and the API (vmm.process_heap): its arena limit holds however many threads
allocate at once, and a trim gives freed pages back. Each case runs in a fresh interpreter:
glibc's arenas and its limit are per process, and this one's are long made."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

THREADS = 12

# Threads that all hold malloc'd blocks at once (so none can share another's arena while it
# allocates), then glibc's own statistics: one "Arena N:" block per arena, on stderr.
ARENAS = f"""
import ctypes, sys, threading
sys.path.insert(0, {str(ROOT)!r})
from vmm import process_heap
if sys.argv[1] != "0":
    assert process_heap.limit_arenas(int(sys.argv[1]))
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
together, done = threading.Barrier({THREADS}), threading.Barrier({THREADS})
def work():
    together.wait()
    blocks = [libc.malloc(8192) for _ in range(500)]
    done.wait()
    for b in blocks:
        libc.free(b)
threads = [threading.Thread(target=work) for _ in range({THREADS})]
for t in threads: t.start()
for t in threads: t.join()
libc.malloc_stats()
"""

# 200 MiB of 64 KiB blocks freed again, all but the last (so the heap's top stays in use and
# glibc's own trim at free cannot give the pages back): RSS before and after a trim.
TRIM = f"""
import ctypes, sys
sys.path.insert(0, {str(ROOT)!r})
from vmm import process_heap
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: 64 KiB blocks from the heap, as glibc's dynamic threshold would
def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS:"))
blocks = [libc.malloc(64 << 10) for _ in range(3200)]
for b in blocks:
    ctypes.memset(b, 1, 64 << 10)
for b in blocks[:-1]:
    libc.free(b)
before = rss()
trimmed = process_heap.trim()
print(before, rss(), trimmed)
"""


def _arenas(limit: int) -> int:
    done = subprocess.run([sys.executable, "-c", ARENAS, str(limit)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return sum(1 for line in done.stderr.splitlines() if line.startswith("Arena "))


def test_threads_allocating_at_once_share_at_most_the_limit_of_arenas():
    assert _arenas(0) > 2  # glibc's own way: an arena for each thread that found the others busy
    assert _arenas(2) <= 2


def test_a_trim_gives_freed_pages_back_to_the_host():
    done = subprocess.run([sys.executable, "-c", TRIM], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    before, after, trimmed = done.stdout.split()
    assert trimmed == "True"
    assert int(before) - int(after) > 150 * 1024, (before, after)  # KiB: most of the 200 MiB freed
