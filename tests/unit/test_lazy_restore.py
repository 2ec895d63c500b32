"""Lazy restores (agent.stores.lazy) with a real chunkfs daemon on a real FUSE mount and a
real S3 API (moto_server), no VM: a node that lacks a snapshot gets a small dir of links
into a writable mount (its layers re-pointed in the mount's overlay, the store untouched),
reads fetch only what they touch, chunks the node's own files hold never come from the
store, the first restore's chunk order becomes prefetch.json and later mounts replay it, a
restarted daemon's vanished mount is mounted again, a delete unmounts and removes it, and
a daemon that cannot be had falls back to the whole download."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path
from unittest import mock

import pytest

from agent.stores.s3 import S3Store
from chunkfs.client import ChunkfsClient, ChunkfsError
from harness.moto_s3 import REGION
from tests.unit.test_snapshot_store_s3 import BUCKET, CHUNK, _backing, _capture, _images, _keys, s3, s3_endpoint  # noqa: F401
from vmm.qemu import QemuDriver

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.xdist_group("chunkfs")


@pytest.fixture
def short_tmp():
    """Unix socket paths stay under 108 bytes: not pytest's deep tmp dirs."""
    if not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None:
        pytest.fail("lazy restores need /dev/fuse and fusermount3 (the fuse3 package; scripts/setup.sh)")
    root = ROOT / "var" / "test-runs" / f"lz-{uuid.uuid4().hex[:6]}"
    root.mkdir(parents=True)
    yield root
    for control in root.glob("*/chunkfs/control.sock"):
        _stop_daemon(control)
    for mnt in root.glob("*/chunkfs/mnt"):
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False, capture_output=True)
    shutil.rmtree(root, ignore_errors=True)


def _stop_daemon(control: Path) -> None:
    try:
        pid = ChunkfsClient(control, timeout=2).ping()["pid"]
    except ChunkfsError:
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
            if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":  # ended; we started it (unreaped)
                return
        except (ProcessLookupError, FileNotFoundError):
            return
        time.sleep(0.05)
    raise AssertionError(f"the chunkfs daemon {pid} did not stop")


def _store(s3, home: Path, images: Path, **kw) -> S3Store:
    client, prefix = s3
    driver = QemuDriver(home=home, images_dir=images, accel="tcg", network="slirp")
    kw.setdefault("lazy", True)
    return S3Store(home=home, images_dir=images, bucket=BUCKET, client=client, prefix=prefix, chunk_size=CHUNK,
                   concurrency=4, driver=driver, endpoint=client.meta.endpoint_url, region=REGION,
                   chunk_cache_mb=64, **kw)


def _committed(s3, tmp: Path, sid: str, ram: bytes) -> tuple[Path, Path]:
    """Node 1 takes and commits a snapshot; returns (its images dir, its capture dir)."""
    images = _images(tmp)
    n1 = tmp / "n1"
    src = _capture(n1, images, sid, ram)
    _store(s3, n1, images, lazy=False).commit(sid)
    return images, src


def _ram(seed: int = 7, chunks: int = 16) -> bytes:
    import random

    return random.Random(seed).randbytes(chunks * CHUNK)


def test_a_node_lacking_the_snapshot_mounts_it_lazily_and_reads_only_what_it_touches(s3, short_tmp):
    ram = _ram(chunks=96)
    images, src = _committed(s3, short_tmp, "lz-a", ram)
    n2 = short_tmp / "n2"
    store = _store(s3, n2, images)
    path = store.local_dir("lz-a")
    assert path == n2 / "lazy" / "snapshots" / "lz-a"
    assert not (n2 / "cache" / "snapshots" / "lz-a").exists(), "it was downloaded, not mounted"
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["dir"] == str(path) and manifest["memory_file"] == str(path / "memory.ram")
    for name in ("layer-0.qcow2", "layer-1.qcow2", "memory.ram", "device.state"):
        assert (path / name).is_symlink() and os.readlink(path / name).startswith(str(n2 / "chunkfs" / "mnt"))
    # adopt_snapshot re-pointed the layer chain at this node's paths, in the mount's overlay only
    assert _backing(path / "layer-1.qcow2") == str(path / "layer-0.qcow2")
    assert _backing(src / "layer-1.qcow2") == str(src / "layer-0.qcow2")  # node 1's file is as it was
    # and the disk top a first create copies was made beside the re-pointing (vmm.qemu.tops)
    assert [p.suffix for p in (n2 / "tops").iterdir()] == [".qcow2"]
    stats = store.lazy.mount_stats("lz-a")
    before = stats["fetched_bytes"]
    with open(path / "memory.ram", "rb") as f:
        f.seek(50 * CHUNK + 100)
        assert f.read(1000) == ram[50 * CHUNK + 100:50 * CHUNK + 1100]
    stats = store.lazy.mount_stats("lz-a")
    total = sum(f["size"] for f in json.loads(
        s3[0].get_object(Bucket=BUCKET, Key=f"{s3[1]}/snapshots/lz-a/manifest.json")["Body"].read())["files"].values())
    print(f"\nfetched {stats['fetched_bytes']} of {total} bytes (before the read: {before})")
    # the chunk and what the kernel's and chunkfs's read-ahead add (64 KiB chunks here: 4 MiB in use)
    assert 0 < stats["fetched_bytes"] - before <= 24 * CHUNK
    assert stats["fetched_bytes"] < total / 3
    assert (path / "memory.ram").read_bytes() == ram  # and everything reads right
    assert "lz-a" in store.local_ids()
    assert store.local_dir("lz-a") == path  # the live mount is used again
    figures = store.chunk_cache_figures()  # the daemon's stats op, for the heartbeat and /metrics
    assert figures["limitBytes"] == 64 << 20 and figures["sizeBytes"] > 0 and figures["fetchedBytes"] > 0
    assert 0 <= figures["hitRatio"] <= 1 and figures["corrupt"] == 0

    from agent.host_usage import HostSampler
    from agent.prometheus import NodeCollector

    sampler = HostSampler(["/"])
    sampler.probes["chunkCache"] = store.chunk_cache_figures
    assert sampler.sample()["chunkCache"]["limitBytes"] == 64 << 20
    scraped = {m.name: m.samples[0].value for m in NodeCollector("n2", lambda: 0, dict,
                                                                 chunk_cache=store.chunk_cache_figures).collect()}
    assert scraped["aenv_node_chunk_cache_limit_bytes"] == 64 << 20
    assert scraped["aenv_node_chunk_cache_fetched_bytes"] >= stats["fetched_bytes"]
    assert 0 <= scraped["aenv_node_chunk_cache_hit_ratio"] <= 1 and "aenv_node_chunk_cache_evictions" in scraped


def test_a_lazy_mount_serves_ram_and_disks_at_their_own_chunk_sizes(s3, short_tmp):
    """RAM committed at a quarter of the disks' chunk size: the mount reads every byte right and
    a read of RAM fetches its small pieces, not the disks' chunk size."""
    ram = _ram(chunks=32)
    images = _images(short_tmp)
    src = _capture(short_tmp / "n1", images, "lz-m", ram)
    _store(s3, short_tmp / "n1", images, lazy=False, ram_chunk_size=CHUNK // 4).commit("lz-m")
    store = _store(s3, short_tmp / "n2", images, ram_chunk_size=CHUNK // 4)
    path = store.local_dir("lz-m")
    mount = store.lazy.client().list()[0]
    files = mount["files"]
    assert files["memory.ram"]["chunk_size"] == CHUNK // 4 and files["layer-1.qcow2"]["chunk_size"] == CHUNK
    assert mount["chunk_size"] == CHUNK // 4  # a daemon that ignores files' own sizes refuses the disks
    with open(path / "memory.ram", "rb") as f:
        f.seek(10 * CHUNK + 5)
        assert f.read(100) == ram[10 * CHUNK + 5:10 * CHUNK + 105]
    assert (path / "memory.ram").read_bytes() == ram
    assert (path / "device.state").read_bytes() == (src / "device.state").read_bytes()
    assert _backing(path / "layer-1.qcow2") == str(path / "layer-0.qcow2")


def test_warm_up_starts_the_daemon_and_indexes_the_nodes_own_chunks_ahead(s3, short_tmp):
    """At node start (agent.worker): the first lazy restore then finds the daemon running and
    this node's files indexed."""
    images = _images(short_tmp)
    store = _store(s3, short_tmp / "n1", images)
    assert store.lazy.running_client() is None and store.on_disk._where is None
    store.warm_up().join(60)
    assert store.lazy.running_client() is not None
    assert store.on_disk._where is not None
    assert _store(s3, short_tmp / "n2", images, lazy=False).warm_up() is None


def test_chunks_the_node_already_has_are_read_from_its_files_not_the_store(s3, short_tmp):
    ram = _ram(11)
    images, _ = _committed(s3, short_tmp, "lz-b", ram)
    (images / "base-abc" / "old.img").write_bytes(ram)  # e.g. an earlier download or build
    client, prefix = s3
    doc = json.loads(client.get_object(Bucket=BUCKET, Key=f"{prefix}/snapshots/lz-b/manifest.json")["Body"].read())
    for _, _, sha in doc["files"]["memory.ram"]["chunks"]:  # the store lost them: only the node has them
        client.delete_object(Bucket=BUCKET, Key=f"{prefix}/chunks/{sha}")
    store = _store(s3, short_tmp / "n2", images)
    path = store.local_dir("lz-b")
    assert (path / "memory.ram").read_bytes() == ram


def test_first_restore_records_prefetch_later_mounts_replay_it_delete_removes_all(s3, short_tmp):
    ram = _ram(13)
    images, _ = _committed(s3, short_tmp, "lz-c", ram)
    client, prefix = s3
    a = _store(s3, short_tmp / "n2", images)
    a.prefetch_settle = 0.0
    path = a.local_dir("lz-c")
    with open(path / "memory.ram", "rb") as f:
        for index in (9, 3):
            f.seek(index * CHUNK)
            f.read(100)
    timer = a.restored("lz-c")
    assert timer is not None
    timer.join(10)
    assert a.restored("lz-c") is None  # once
    doc = json.loads(client.get_object(Bucket=BUCKET, Key=f"{prefix}/snapshots/lz-c/prefetch.json")["Body"].read())
    ram_order = [i for name, i in doc["order"] if name == "memory.ram"]
    assert ram_order[0] == 9 and 3 in ram_order, doc["order"]  # (the kernel's read-ahead adds 10, ...)
    assert "pieces" not in doc and _keys(client, prefix, "snapshots/lz-c/prefetch/") == [], "only builds make pieces"

    b = _store(s3, short_tmp / "n3", images)
    b.local_dir("lz-c")
    assert b.restored("lz-c") is None  # it replays a list; it records none
    deadline = time.monotonic() + 20
    while not (stats := b.lazy.mount_stats("lz-c"))["prefetch"]["finished"]:
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)
    assert stats["prefetch"]["queued"] == len(doc["order"]) and stats["prefetch"]["done"] == len(doc["order"])
    assert stats["recorded"] is None

    assert b.delete("lz-c") is True
    assert not (short_tmp / "n3" / "lazy" / "snapshots" / "lz-c").exists()
    assert b.lazy.mount_stats("lz-c") is None, "the mount stayed"
    assert _keys(client, prefix, "snapshots/") == []
    a.drop_local("lz-c")
    assert not (short_tmp / "n2" / "lazy" / "snapshots" / "lz-c").exists()


def test_a_restarted_daemons_vanished_mount_is_mounted_again(s3, short_tmp):
    ram = _ram(17)
    images, _ = _committed(s3, short_tmp, "lz-d", ram)
    n2 = short_tmp / "n2"
    store = _store(s3, n2, images)
    path = store.local_dir("lz-d")
    _stop_daemon(n2 / "chunkfs" / "control.sock")
    assert store.lazy.lookup("lz-d") is None
    again = store.local_dir("lz-d")
    assert again == path
    assert (path / "memory.ram").read_bytes() == ram
    assert _backing(path / "layer-1.qcow2") == str(path / "layer-0.qcow2")


def test_a_snapshot_a_vm_uses_keeps_its_mount_and_chunks_on_delete(s3, short_tmp):
    """E.g. a sandbox resumed here from another node's pause image, paused again: the new
    export deletes the old image while the saved VM's disk still stacks on its files."""
    ram = _ram(19)
    images, _ = _committed(s3, short_tmp, "lz-e", ram)
    client, prefix = s3
    store = _store(s3, short_tmp / "n2", images)
    path = store.local_dir("lz-e")
    with mock.patch.object(store.driver, "files_in_use", return_value={str(path / "memory.ram")}):
        store.drop_local("lz-e")
        assert store.lazy.lookup("lz-e") == path
        assert store.delete("lz-e") is True
    assert _keys(client, prefix, "chunks/") == [], "the store still has the chunks"
    assert store.lazy.lookup("lz-e") == path
    assert (path / "memory.ram").read_bytes() == ram  # every chunk was kept (pinned) before they went
    assert store.lazy.cache_stats()["pinned_bytes"] > 0
    store.drop_local("lz-e")  # the VM is gone: the mount and its pins go
    assert not path.exists() and store.lazy.cache_stats()["pinned_bytes"] == 0


def test_without_a_daemon_the_snapshot_is_downloaded_whole(s3, short_tmp):
    ram = _ram(23)
    images, _ = _committed(s3, short_tmp, "lz-f", ram)
    n2 = short_tmp / "n2"
    store = _store(s3, n2, images)
    with mock.patch("agent.stores.lazy.ensure_daemon", side_effect=ChunkfsError("not_started", "no FUSE here")):
        path = store.local_dir("lz-f")
    assert path == n2 / "cache" / "snapshots" / "lz-f"
    assert (path / "memory.ram").read_bytes() == ram
    assert not (n2 / "lazy" / "snapshots" / "lz-f").exists()
    off = _store(s3, short_tmp / "n3", images, lazy=False)
    assert off.lazy is None and off.local_dir("lz-f") == short_tmp / "n3" / "cache" / "snapshots" / "lz-f"


def test_compressed_chunks_read_lazily_and_a_daemon_from_before_them_downloads(s3, short_tmp):
    """RAM that compresses is stored compressed (chunkfs.compression): the daemon decompresses it
    for the mount; a daemon whose ping names no encodings (started before compressed chunks; it
    outlives worker upgrades) would take them for corrupt, so the snapshot is downloaded whole."""
    ram = (b"compressible page " * (16 * CHUNK // 18 + 1))[:16 * CHUNK]
    images, _ = _committed(s3, short_tmp, "lz-z", ram)
    store = _store(s3, short_tmp / "n2", images)
    path = store.local_dir("lz-z")
    assert path == short_tmp / "n2" / "lazy" / "snapshots" / "lz-z"
    assert (path / "memory.ram").read_bytes() == ram
    figures = store.chunk_cache_figures()
    assert figures["corrupt"] == 0 and 0 < figures["storeWireBytes"] < figures["storeBytes"] // 10
    old = _store(s3, short_tmp / "n3", images)
    real_ping = ChunkfsClient.ping
    with mock.patch.object(ChunkfsClient, "ping", lambda self: {k: v for k, v in real_ping(self).items()
                                                                if k != "encodings"}):
        path = old.local_dir("lz-z")
    assert path == short_tmp / "n3" / "cache" / "snapshots" / "lz-z"
    assert (path / "memory.ram").read_bytes() == ram


def test_a_build_records_the_prefetch_list_and_a_first_create_elsewhere_replays_it(s3, short_tmp):
    """Where a template is built (agent.builder), its committed snapshot is mounted lazily with
    recording on — its image files too, every chunk from the node's own files, none from the
    store — while a VM restored from it starts: what it read becomes prefetch.json before any
    other node restores it, and the very first lazy mount elsewhere prefetches it."""
    import contextlib

    ram = _ram(37)
    images = _images(short_tmp)
    _capture(short_tmp / "n1", images, "lz-b1", ram)
    builder = _store(s3, short_tmp / "n1", images)
    builder.prefetch_settle = 0.0
    builder.commit("lz-b1")
    seen = {}

    @contextlib.contextmanager
    def restore(path: Path):  # a VM restored from the dir, until its envd answered
        manifest = json.loads((path / "manifest.json").read_text())
        seen.update(dir=path, base=manifest["layers"][0])
        with open(manifest["memory_file"], "rb") as f:
            for index in (9, 3):
                f.seek(index * CHUNK)
                f.read(100)
        with open(manifest["layers"][0], "rb") as f:  # the image's base disk: mounted too
            f.read(4096)
        yield
        seen["after"] = True

    assert builder.record_prefetch("lz-b1", restore) > 0
    assert seen["after"] and seen["base"] == str(seen["dir"] / "image-base.qcow2")
    client, prefix = s3
    doc = json.loads(client.get_object(Bucket=BUCKET, Key=f"{prefix}/snapshots/lz-b1/prefetch.json")["Body"].read())
    order = doc["order"]
    ram_order = [i for name, i in order if name == "memory.ram"]
    assert ram_order[0] == 9 and 3 in ram_order and ["image-base.qcow2", 0] in order, order
    fetched = builder.lazy.cache_stats()
    assert fetched["store_chunks"] == 0, "the builder read its own files, not the store"
    assert builder.lazy.lookup("lz-b1") is None and builder.lazy.mount_stats("lz-b1") is None  # gone after
    assert builder.local_dir("lz-b1") == short_tmp / "n1" / "snapshots" / "lz-b1"
    assert builder.record_prefetch("lz-b1", restore) is None  # once: a list exists

    # the first create on another node (whose images dir lacks the image: it ships it too)
    (short_tmp / "n2-images").mkdir()
    other = _store(s3, short_tmp / "n2", short_tmp / "n2-images")
    other.local_dir("lz-b1")
    assert other.restored("lz-b1") is None  # it replays a list; it records none
    deadline = time.monotonic() + 20
    while not (stats := other.lazy.mount_stats("lz-b1"))["prefetch"]["finished"]:
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)
    assert stats["prefetch"]["queued"] == stats["prefetch"]["done"] == len(order)
    # the list's chunks of the snapshot's own files came in its prefetch pieces, a GET per piece
    pieces = doc["pieces"]
    packed = [c[0] for p in pieces for c in p["chunks"]]
    manifest = json.loads(
        client.get_object(Bucket=BUCKET, Key=f"{prefix}/snapshots/lz-b1/manifest.json")["Body"].read())
    own = {c[2] for f in manifest["files"].values() for c in f["chunks"]}
    assert pieces and len(packed) == len(set(packed)) and set(packed) <= own, pieces
    assert _keys(client, prefix, "snapshots/lz-b1/prefetch/") == sorted(p["key"] for p in pieces)
    fetched = other.lazy.cache_stats()
    assert fetched["piece_gets"] == len(pieces) and fetched["piece_chunks"] == len(packed), fetched
    assert fetched["store_chunks"] > fetched["piece_chunks"], "the shipped image file's chunks came one by one"
    assert (other.lazy.path("lz-b1") / "memory.ram").read_bytes() == ram
    assert other.delete("lz-b1") is True
    assert _keys(client, prefix, "snapshots/") == [], "the pieces went with the snapshot"
    # a node without lazy restores records nothing
    assert _store(s3, short_tmp / "n3", images, lazy=False).record_prefetch("lz-b1", restore) is None


def _build_with_pieces(s3, tmp: Path, sid: str, ram: bytes, indices) -> tuple[Path, dict]:
    """A template build's prefetch list with pieces (its restore reads ``indices`` of the RAM);
    returns (the images dir, prefetch.json)."""
    import contextlib

    images = _images(tmp)
    _capture(tmp / "n1", images, sid, ram)
    builder = _store(s3, tmp / "n1", images)
    builder.prefetch_settle = 0.0
    builder.commit(sid)

    @contextlib.contextmanager
    def restore(path: Path):
        with open(path / "memory.ram", "rb") as f:
            for index in indices:
                f.seek(index * CHUNK)
                f.read(100)
        yield

    assert builder.record_prefetch(sid, restore) > 0
    client, prefix = s3
    listed = client.get_object(Bucket=BUCKET, Key=f"{prefix}/snapshots/{sid}/prefetch.json")["Body"].read()
    return images, json.loads(listed)


def _compressible_ram(chunks: int = 16) -> bytes:
    import random

    rng = random.Random(5)
    return b"".join(bytes([i + 1]) * (CHUNK - 512) + rng.randbytes(512) for i in range(chunks))


def test_prefetch_pieces_that_are_wrong_or_gone_are_never_handed_to_a_reader(s3, short_tmp):
    """A piece that does not decode (garbage in its object) and a piece that is missing: their
    chunks come from the chunk objects, and every byte read is the snapshot's."""
    ram = _compressible_ram()
    images, doc = _build_with_pieces(s3, short_tmp, "lz-pc", ram, range(16))
    pieces = doc["pieces"]
    assert len(pieces) >= 2 and {c[3] for p in pieces for c in p["chunks"]} == {"zstd"}, pieces
    client, prefix = s3
    first = client.get_object(Bucket=BUCKET, Key=f"{prefix}/{pieces[0]['key']}")["Body"].read()
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/{pieces[0]['key']}", Body=bytes(reversed(first)))
    client.delete_object(Bucket=BUCKET, Key=f"{prefix}/{pieces[1]['key']}")

    other = _store(s3, short_tmp / "n2", images)
    path = other.local_dir("lz-pc")
    deadline = time.monotonic() + 20
    while not (stats := other.lazy.mount_stats("lz-pc"))["prefetch"]["finished"]:
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)
    assert stats["prefetch"]["failed"] == 0, stats
    assert (path / "memory.ram").read_bytes() == ram
    fetched = other.lazy.cache_stats()
    in_good = sum(len(p["chunks"]) for p in pieces[2:])
    assert fetched["piece_gets"] == len(pieces) - 1, fetched  # the missing one was asked for, got nothing
    assert fetched["piece_chunks"] == in_good, fetched  # the garbage one gave none
    assert fetched["corrupt"] == 0, "a body that does not decode is never offered to the cache"


def test_a_capture_handed_over_is_mounted_before_its_upload_and_its_reads_wait_for_it(s3, short_tmp):
    """A fork's early hand-off (``index``) into a bucket that has nothing yet, not even the image
    files: node 2 (another build of the kernel) mounts the pending capture at once, with the
    kernel's chunk list from the pending manifest; a read waits (``store_wait``) until node 1's
    commit has put the chunk there, then gets the right bytes."""
    import threading

    ram = _ram(chunks=16)
    images = _images(short_tmp)
    n1 = short_tmp / "n1"
    _capture(n1, images, "ho-a", ram)
    store1 = _store(s3, n1, images, lazy=False)
    assert store1.index("ho-a")["chunks"] > 0
    pending = json.loads(s3[0].get_object(Bucket=BUCKET, Key=f"{s3[1]}/snapshots/ho-a/pending.json")["Body"].read())
    assert all(isinstance(info.get("chunks"), list) for info in pending["image_files"].values())
    assert not _keys(s3[0], s3[1], "images/") and not _keys(s3[0], s3[1], "chunks/")

    images2 = _images(short_tmp / "other")
    (images2 / "base-abc" / "vmlinuz").write_bytes(b"another kernel build")
    n2 = short_tmp / "n2"
    store2 = _store(s3, n2, images2)
    with pytest.raises(Exception, match="neither on this node nor"):
        store2.local_dir("ho-a")  # a restore that was not told: the pending manifest is not its
    uploader = threading.Timer(1.0, store1.commit, args=("ho-a",))
    t0 = time.monotonic()
    uploader.start()
    try:  # the mount's own reads (the layers' headers, re-pointed) wait for the upload's chunks
        path = store2.local_dir("ho-a", pending_wait=30.0)
        waited = time.monotonic() - t0
    finally:
        uploader.join()
    print(f"\nthe mount waited {waited:.2f} s for the upload")
    assert waited > 0.8
    assert store2.take_mount_timings("ho-a")["mount_pending"] == 1
    shipped = json.loads((path / "manifest.json").read_text())["machine"]["kernel"]
    assert shipped.startswith(str(path)), "the other build's kernel was used"
    assert Path(shipped).read_bytes() == b"x"  # node 1's kernel, published by its commit
    keys = _keys(s3[0], s3[1], "snapshots/ho-a/")
    assert "snapshots/ho-a/manifest.json" in keys and "snapshots/ho-a/pending.json" not in keys
    assert (path / "memory.ram").read_bytes() == ram
