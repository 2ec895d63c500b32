"""A real QEMU VM restored lazily on another node (issue 24): node A boots a guest, starts a
counter process, writes a file, snapshots it with its base disk (as a pause image travels:
912 MiB of base disk, layers and RAM) and commits it to S3 (a moto_server); node B — another
AENV_HOME and an images dir with the build's kernel, initrd and tools drive but no base disk,
lazy restores on — restores it from lazily filled files (its chunkfs daemon) without
downloading it. The guest answers with its file and its still-counting process, and the bytes
fetched before it answered are a small part of the snapshot (figures printed: run with -s). A
lazy restore on a third node replays the prefetch list the first one recorded."""
from __future__ import annotations

import json
import os
import shutil
import signal
import time
import uuid
from pathlib import Path

import pytest

from agent.stores.s3 import S3Store
from chunkfs.client import ChunkfsClient, ChunkfsError
from harness.moto_s3 import CREDENTIALS, REGION, moto_server
from harness.moto_s3 import client as s3_client
from tests.vmm.test_lifecycle_vm import COUNTER, assert_continues, counter, exists, real_driver, sh
from tests.vmm.test_qemu_vm import endpoint
from vmm.driver import BootSpec, SnapshotManifest, get_driver

pytestmark = [pytest.mark.vm, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
BUCKET = "aenv-lazy"


@pytest.fixture
def world():
    """A moto S3 server and a short root for the nodes' homes (unix socket paths)."""
    if not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None:
        pytest.fail("lazy restores need /dev/fuse and fusermount3 (the fuse3 package; scripts/setup.sh)")
    for name, value in CREDENTIALS.items():
        os.environ.setdefault(name, value)
    root = ROOT / "var" / "test-runs" / f"lzvm-{uuid.uuid4().hex[:6]}"
    root.mkdir(parents=True)
    with moto_server(BUCKET) as url:
        yield url, root
    for control in root.glob("*/chunkfs/control.sock"):
        try:
            pid = ChunkfsClient(control, timeout=2).ping()["pid"]
            os.kill(pid, signal.SIGTERM)
            time.sleep(1)
        except (ChunkfsError, OSError):
            pass
    shutil.rmtree(root, ignore_errors=True)


def _node_images(images: Path, build: str, dest: Path) -> Path:
    """Another node's images dir: the build's files hard-linked in, but not its base disk."""
    (dest / build).mkdir(parents=True)
    for f in (images / build).iterdir():
        if f.is_file() and f.name != "rootfs.qcow2":
            os.link(f, dest / build / f.name)
    if build != "base":
        (dest / "base").symlink_to(build)
    if (images / "accel.json").exists():
        shutil.copy(images / "accel.json", dest / "accel.json")
    return dest


class _Driver:
    """A QEMU driver of another node's home and images dir; its VMs are killed after."""

    def __init__(self, home: Path, images: Path):
        self.driver = get_driver("qemu", home, images)

    def __enter__(self):
        return self.driver

    def __exit__(self, *exc):
        for vm in self.driver.list():
            self.driver.kill(vm.sandbox_id)


def _store(url: str, prefix: str, home: Path, driver, lazy: bool) -> S3Store:
    return S3Store(home=home, images_dir=driver.images_dir, bucket=BUCKET, endpoint=url, region=REGION,
                   prefix=prefix, driver=driver, lazy=lazy, chunk_cache_mb=2048)


def test_a_snapshot_from_node_a_restores_lazily_on_node_b(world):
    url, root = world
    prefix = f"lz-{uuid.uuid4().hex[:6]}"
    sid = f"lazy-{uuid.uuid4().hex[:6]}"
    with real_driver(root / "a") as a:
        store_a = _store(url, prefix, root / "a", a, lazy=False)
        info = a.boot(BootSpec("lz-src", cpu_count=1, memory_mb=256))
        ep = endpoint(info)
        sh(ep, f"cat > /home/user/counter.py <<'EOF'\n{COUNTER}EOF\necho from-node-a > /home/user/state.txt")
        sh(ep, "setsid nohup python3 /home/user/counter.py >/dev/null 2>&1 </dev/null &")
        deadline = time.monotonic() + 30
        while not exists(ep, "/home/user/count"):
            assert time.monotonic() < deadline, "counter did not start"
            time.sleep(0.3)
        before = counter(ep)
        manifest_a = a.snapshot(info.sandbox_id, store_a.prepare(sid), with_base=True)
        committed = store_a.commit(sid)
        a.kill(info.sandbox_id)
        build = Path(manifest_a.machine["image_dir"]).name
        images_b = _node_images(a.images_dir, build, root / "images-b")
    doc = json.loads(s3_client(url).get_object(Bucket=BUCKET, Key=f"{prefix}/snapshots/{sid}/manifest.json")["Body"]
                     .read())
    total = int(doc["stored_bytes"])
    print(f"\ncommitted {sid}: {committed}; stored {total >> 20} MiB")

    with _Driver(root / "b", images_b) as b:
        store_b = _store(url, prefix, root / "b", b, lazy=True)
        store_b.prefetch_settle = 0.5
        t0 = time.monotonic()  # a node hashes its own image files once (kept under cache/chunk-index)
        store_b.on_disk.locate([])
        print(f"node B: its own image files indexed in {time.monotonic() - t0:.2f} s (once)")
        t0 = time.monotonic()
        path = store_b.local_dir(sid)
        t_mount = time.monotonic() - t0
        assert path == root / "b" / "lazy" / "snapshots" / sid
        assert not (root / "b" / "cache" / "snapshots" / sid).exists(), "downloaded, not mounted"
        manifest = SnapshotManifest.load(path)
        restored = b.restore(manifest, BootSpec("lz-b"))
        t_answer = time.monotonic() - t0
        stats = store_b.lazy.mount_stats(sid)
        fetched = stats["fetched_bytes"]
        print(f"node B: mounted in {t_mount:.2f} s, guest answered after {t_answer:.2f} s; fetched "
              f"{fetched >> 20} MiB of {total >> 20} MiB stored ({100 * fetched / total:.1f} %) before it answered; "
              f"restore timings {restored.timings}; mount {stats}")
        by_file = {}
        for name, _ in stats["recorded"] or []:
            by_file[name] = by_file.get(name, 0) + 1
        print(f"first-touched chunks by file: {by_file}; files {[(n, f['size'] >> 20, len(f['chunks'])) for n, f in doc['files'].items()]}")
        ep_b = endpoint(restored)
        assert sh(ep_b, "cat /home/user/state.txt").strip() == "from-node-a"
        assert_continues(ep_b, before)
        assert fetched < 0.25 * total, f"fetched {fetched} of {total} bytes before the guest answered"
        timer = store_b.restored(sid)
        assert timer is not None
        timer.join(30)
        b.kill(restored.sandbox_id)
    order = json.loads(s3_client(url).get_object(Bucket=BUCKET, Key=f"{prefix}/snapshots/{sid}/prefetch.json")
                       ["Body"].read())["order"]
    print(f"prefetch list: {len(order)} chunks")

    with _Driver(root / "c", _node_images(a.images_dir, build, root / "images-c")) as c:  # replays the list
        store_c = _store(url, prefix, root / "c", c, lazy=True)
        t0 = time.monotonic()
        restored = c.restore(SnapshotManifest.load(store_c.local_dir(sid)), BootSpec("lz-c"))
        t_answer = time.monotonic() - t0
        stats = store_c.lazy.mount_stats(sid)
        print(f"node C (prefetch): guest answered after {t_answer:.2f} s; fetched {stats['fetched_bytes'] >> 20} MiB; "
              f"prefetch {stats['prefetch']}")
        assert stats["prefetch"]["queued"] == len(order)
        assert sh(endpoint(restored), "cat /home/user/state.txt").strip() == "from-node-a"
        c.kill(restored.sandbox_id)
        # for comparison: the whole download (AENV_LAZY_RESTORE=0) of the same snapshot
        store_d = _store(url, prefix, root / "d", c, lazy=False)
        t0 = time.monotonic()
        store_d.local_dir(sid)
        print(f"whole download of the same snapshot: {time.monotonic() - t0:.2f} s before a restore could start")
        assert store_c.delete(sid) is True
        assert not (root / "c" / "lazy" / "snapshots" / sid).exists()
