"""What bench/lazy.py reads besides the API: a node's chunkfs daemon (its control socket's
``stats``: the chunk cache and where chunks came from), a cache watcher that polls it during
a part (the largest size it saw against the bound), and a snapshot's size in the S3 store
(its own files and the image files it runs on, from the manifests)."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from chunkfs.client import ChunkfsClient, ChunkfsError

CACHE_KEYS = ("hits", "misses", "evictions", "fetched_bytes", "corrupt")


def daemon_stats(home: Path, timeout: float = 5.0) -> dict | None:
    """The daemon's ``stats`` reply of a node home, or None while it is not running (a node
    starts it on its first lazy restore)."""
    try:
        return ChunkfsClient(Path(home) / "chunkfs" / "control.sock", timeout=timeout).stats()
    except ChunkfsError:
        return None


def store_bytes(stats: dict | None) -> int:
    """Bytes the daemon fetched from the store: the store source's own count where the
    daemon reports one (``fetches.store_bytes``, beside peers), else every chunk the cache
    fetched (the node's own files, which the cache also counts, are then included)."""
    if not stats:
        return 0
    fetches = stats.get("fetches") or {}
    if isinstance(fetches.get("store_bytes"), int):
        return fetches["store_bytes"]
    return int((stats.get("cache") or {}).get("fetched_bytes") or 0)


def wire_pct(fetched: dict, total_bytes: int) -> float | None:
    """What crossed the wire from the store (chunk objects are stored compressed where that
    pays: ``fetches.store_wire_bytes``) as % of ``total_bytes``; None when the daemon does
    not count it (older than compressed chunks) or there is nothing to divide by."""
    wire = fetched.get("fetches.store_wire_bytes")
    if not isinstance(wire, (int, float)) or not total_bytes:
        return None
    return round(100 * wire / total_bytes, 1)


def store_gets(fetched: dict) -> int:
    """The GETs behind a ``delta``'s store chunks: one per chunk, but one per prefetch piece
    for the chunks that came in pieces (``chunkfs.pieces``)."""
    return int(fetched.get("fetches.store_chunks", 0) - fetched.get("fetches.piece_chunks", 0)
               + fetched.get("fetches.piece_gets", 0))


def counters(stats: dict | None) -> dict:
    """The cumulative figures of a ``stats`` reply, flat: the cache's counts, the bytes from
    the store and every numeric figure of ``fetches`` (peers) as ``fetches.<name>``."""
    out = dict.fromkeys(CACHE_KEYS, 0)
    out["store_bytes"] = store_bytes(stats)
    if not stats:
        return out
    cache = stats.get("cache") or {}
    for key in CACHE_KEYS:
        out[key] = int(cache.get(key) or 0)
    for key, value in (stats.get("fetches") or {}).items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "store_bytes":
            out[f"fetches.{key}"] = value
    return out


def delta(before: dict | None, after: dict | None) -> dict:
    """What happened between two ``stats`` replies (a daemon not yet running counts as zeros)."""
    a, b = counters(before), counters(after)
    return {k: b[k] - a.get(k, 0) for k in b}


def mount_figures(stats: dict | None, mount_id: str) -> dict:
    """One mount's reads and fetches from a ``stats`` reply (its recorded order left out)."""
    mount = ((stats or {}).get("mounts") or {}).get(mount_id) or {}
    return {k: v for k, v in mount.items() if k != "recorded"}


def settle(home: Path, quiet_s: float = 1.0, timeout_s: float = 30.0) -> dict:
    """Until a node's daemon has fetched nothing for ``quiet_s`` (a restore's read-ahead and
    prefetch go on in the background after the guest answered, and would share the store's
    link with the next measurement), at most ``timeout_s``: seconds waited, bytes fetched."""
    t0 = time.monotonic()
    first = last = store_bytes(daemon_stats(home))
    quiet_since = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        time.sleep(0.2)
        now = store_bytes(daemon_stats(home))
        if now != last:
            last, quiet_since = now, time.monotonic()
        elif time.monotonic() - quiet_since >= quiet_s:
            break
    return {"waited_s": round(time.monotonic() - t0, 1), "fetched_bytes": last - first}


class CacheWatch:
    """Polls a node's daemon every ``every`` s in a thread while a part runs: the largest
    cache size seen, the bound, evictions, samples and how many polls found no daemon."""

    def __init__(self, home: Path, every: float = 0.2):
        self.home, self.every = Path(home), every
        self.samples: list[dict] = []
        self.unreachable = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(self.every)

    def poll(self) -> None:
        stats = daemon_stats(self.home, timeout=2.0)
        if stats is None:
            self.unreachable += 1
            return
        cache = stats.get("cache") or {}
        self.samples.append({"t": time.monotonic(), "size_bytes": cache.get("size_bytes", 0),
                             "limit_bytes": cache.get("limit_bytes", 0), "evictions": cache.get("evictions", 0),
                             "pinned_bytes": cache.get("pinned_bytes", 0), "entries": cache.get("entries", 0)})

    def start(self) -> "CacheWatch":
        self._thread.start()
        return self

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(timeout=10)
        self.poll()  # the final state
        return summarize_watch(self.samples, self.unreachable)


def summarize_watch(samples: list[dict], unreachable: int = 0) -> dict:
    """The watcher's samples as: the largest size seen, the bound (the smallest reported),
    whether the size ever went over it, evictions (last minus first), pinned at most."""
    if not samples:
        return {"samples": 0, "unreachable_polls": unreachable}
    limits = [s["limit_bytes"] for s in samples if s["limit_bytes"]]
    limit = min(limits) if limits else 0
    biggest = max(s["size_bytes"] for s in samples)
    return {"samples": len(samples), "unreachable_polls": unreachable, "max_size_bytes": biggest,
            "limit_bytes": limit, "over_bound": bool(limit) and biggest > limit,
            "samples_over_bound": sum(1 for s in samples if limit and s["size_bytes"] > limit),
            "evictions": samples[-1]["evictions"] - samples[0]["evictions"],
            "max_pinned_bytes": max(s["pinned_bytes"] for s in samples),
            "final_size_bytes": samples[-1]["size_bytes"], "final_entries": samples[-1]["entries"]}


def stored_size(s3, bucket: str, prefix: str, snapshot_id: str) -> dict:
    """A snapshot's bytes in the store (non-zero chunks): its own files, per file, and the
    image files it runs on (base disk, kernel, initrd, tools drive; ``images/<digest>.json``),
    per role; ``total`` is what a node that had none of them would have to fetch whole."""
    def get(key: str) -> dict:
        return json.loads(s3.get_object(Bucket=bucket, Key=f"{prefix}/{key}".lstrip("/"))["Body"].read())

    doc = get(f"snapshots/{snapshot_id}/manifest.json")
    own = {name: sum(c[1] for c in f["chunks"]) for name, f in doc["files"].items()}
    images = {}
    for role, info in (doc.get("image_files") or {}).items():
        image = get(f"images/{info['digest']}.json")
        images[role] = sum(c[1] for c in image["chunks"])
    return {"own": own, "own_bytes": sum(own.values()), "images": images, "image_bytes": sum(images.values()),
            "total_bytes": sum(own.values()) + sum(images.values())}
