"""Eviction under load through real FUSE (issue 24): several mounts whose files are each larger
than the chunk cache, read at once by many threads (random and sequential, the kernel's page
cache dropped between reads so every read reaches the daemon), while a watcher asks the daemon
for its cache's size all along: the bound is never passed, not even for a moment, every byte
read is right, and afterwards the cache's books equal the bytes on its disk.
(The same with the cache object alone: tests/unit/test_chunk_cache.py.)"""
from __future__ import annotations

import os
import random
import threading
import time

import pytest

from tests.unit.test_chunkfs_fs import CS, cut, node, sample  # noqa: F401 - node: the fixture

pytestmark = pytest.mark.xdist_group("chunkfs")

LIMIT_MB = 2


def _disk_bytes(cache) -> int:
    return sum(p.stat().st_size for p in cache.glob("??/*"))


def test_the_bound_holds_all_along_while_many_readers_evict(node):
    files = {f"img-{i}": sample(3 * (LIMIT_MB << 20) // 2 + i * 4099, seed=20 + i) for i in range(3)}  # 1.5x each
    c = node.start("--limit-mb", str(LIMIT_MB), "--readahead", "2")
    paths = {name: c.mount(f"m-{name}", CS, {"disk": cut(data, node.store)}) / "disk" for name, data in files.items()}
    limit = LIMIT_MB << 20
    wrong, failures, sizes = [], [], []
    done = threading.Event()

    def watch():
        while not done.is_set():
            try:
                sizes.append(c.stats()["cache"]["size_bytes"])
            except Exception as exc:  # noqa: BLE001 - reported below
                failures.append(repr(exc))

    def reader(seed: int, sequential: bool):
        r = random.Random(seed)
        name = r.choice(sorted(files))
        data, fd = files[name], os.open(paths[name], os.O_RDONLY)
        try:
            off = 0
            for _ in range(80):
                if sequential:
                    n = 128 * 1024
                    if off >= len(data):
                        name = r.choice(sorted(files))
                        os.close(fd)
                        data, fd, off = files[name], os.open(paths[name], os.O_RDONLY), 0
                else:
                    off, n = r.randrange(len(data)), r.choice([4096, 65536, CS + 3])
                got = os.pread(fd, n, off)
                if got != data[off:off + n]:
                    wrong.append((name, off, n))
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the next read asks the daemon again
                off += len(got)
        except OSError as exc:
            failures.append(f"{name}: {exc!r}")
        finally:
            os.close(fd)

    watcher = threading.Thread(target=watch)
    watcher.start()
    readers = [threading.Thread(target=reader, args=(i, i % 3 == 0)) for i in range(12)]
    for t in readers:
        t.start()
    for t in readers:
        t.join(300)
    done.set()
    watcher.join(30)
    assert not wrong and not failures, (wrong[:5], failures[:5])
    assert len(sizes) > 10 and max(sizes) <= limit, (len(sizes), max(sizes), limit)
    s = c.stats()
    cache = s["cache"]
    assert cache["evictions"] > 0 and cache["corrupt"] == 0 and cache["limit_bytes"] == limit
    assert cache["size_bytes"] <= limit
    for _ in range(100):  # read-ahead still in flight may hold a reservation a moment longer
        if c.stats()["cache"]["size_bytes"] == _disk_bytes(node.cache):
            break
        time.sleep(0.1)
    assert c.stats()["cache"]["size_bytes"] == _disk_bytes(node.cache) <= limit
    assert all(m["errors"] == 0 for m in s["mounts"].values())
    assert sum(m["fetched_bytes"] for m in s["mounts"].values()) > limit  # chunks came back after eviction
