"""A fork's early hand-off with real VMs (issue 24, fork across nodes): node A captures a running
guest as a fork does (``commit=False``) and hands it over before any of its upload
(``S3Store.index``: the pending manifest, its chunks offered to peers from A's own files); node
B, lazy restores and peer fetch on and no base disk of its own, restores it at once
(``local_dir(..., pending_wait=)``) while the bucket holds none of the capture's chunks nor of
the image files it runs on (the pending manifest lists the base disk's chunks). The guest answers with the parent's file
and its still-counting process, and what it read of the capture came from node A. Then A
uploads (``commit``) and stops serving peers: B's guest reads memory it had not touched yet,
now from the store, intact."""
from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from harness.moto_s3 import client as s3_client
from tests.vmm.test_lazy_restore_vm import BUCKET, _Driver, _node_images, _store, source_guest, world  # noqa: F401
from tests.vmm.test_lifecycle_vm import assert_continues, counter, real_driver, sh
from tests.vmm.test_qemu_vm import endpoint
from vmm.driver import BootSpec, SnapshotManifest

pytestmark = [pytest.mark.vm, pytest.mark.timeout(900)]

TOKEN = "fork-handoff-" * 3


def _keys(url: str, prefix: str, sub: str) -> list[str]:
    pages = s3_client(url).get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"{prefix}/{sub}")
    return [o["Key"][len(prefix) + 1:] for page in pages for o in page.get("Contents", [])]


def test_a_capture_handed_over_before_its_upload_restores_on_another_node(world):  # noqa: F811
    url, root = world
    prefix = f"ho-{uuid.uuid4().hex[:6]}"
    sid = f"fork-{uuid.uuid4().hex[:6]}"
    with real_driver(root / "a") as a:
        store_a = _store(url, prefix, root / "a", a, lazy=True)
        info, ep = source_guest(a, "ho-src", "from-the-parent")
        digest = sh(ep, "sha256sum < /dev/shm/ram.bin").split()[0]
        before = counter(ep)
        manifest = a.snapshot(info.sandbox_id, store_a.prepare(sid))  # the fork's capture; the parent runs on
        t0 = time.monotonic()
        handed = store_a.index(sid)
        listen_a = store_a.lazy.set_peers("127.0.0.1:0", TOKEN, [])
        assert store_a.lazy.offer_own(store_a.own_files())  # what index_snapshot does (offer_own_now)
        print(f"\nnode A handed {sid} over in {time.monotonic() - t0:.2f} s: {handed}")
        assert handed["chunks"] > 0
        build = Path(manifest.machine["image_dir"]).name
        images_b = _node_images(a.images_dir, build, root / "images-b")
        # a fresh bucket: nothing of the capture, nor of the image files it runs on, but its pending manifest
        assert _keys(url, prefix, "") == [f"snapshots/{sid}/pending.json"]

        with _Driver(root / "b", images_b) as b:
            store_b = _store(url, prefix, root / "b", b, lazy=True)
            store_b.lazy.set_peers("127.0.0.1:0", TOKEN, [listen_a])
            b.accel  # noqa: B018 - node start (its accelerator probe), not part of the restore
            t0 = time.monotonic()
            path = store_b.local_dir(sid, pending_wait=120.0)
            assert store_b.take_mount_timings(sid).get("mount_pending") == 1
            restored = b.restore(SnapshotManifest.load(path), BootSpec("ho-b"))
            ep_b = endpoint(restored)
            assert sh(ep_b, "cat /home/user/state.txt").strip() == "from-the-parent"
            print(f"node B: the guest answered {time.monotonic() - t0:.2f} s after the mount began")
            assert_continues(ep_b, before)
            figures = store_b.chunk_cache_figures()
            print(f"node B before the upload: {figures['peerBytes'] >> 20} MiB ({figures['peerChunks']} chunks) "
                  f"from node A, {figures['storeBytes'] >> 20} MiB ({figures['storeChunks']} chunks) from the store")
            assert figures["peerChunks"] > 0 and figures["peerCorrupt"] == 0
            assert f"snapshots/{sid}/manifest.json" not in _keys(url, prefix, f"snapshots/{sid}/"), \
                "the store had the capture before B's guest answered: nothing was handed over"

            t0 = time.monotonic()
            stats = store_a.commit(sid)
            print(f"node A uploaded {sid} in {time.monotonic() - t0:.2f} s: {stats}")
            keys = _keys(url, prefix, f"snapshots/{sid}/")
            assert f"snapshots/{sid}/manifest.json" in keys and f"snapshots/{sid}/pending.json" not in keys
            store_a.lazy.set_peers("", TOKEN, [])  # node A stops serving: what B reads next is the store's
            time.sleep(0.5)  # a fetch from A that was under way when it stopped has ended
            figures = store_b.chunk_cache_figures()
            peer_before, store_before = figures["peerChunks"], figures["storeChunks"]
            assert sh(ep_b, "sha256sum < /dev/shm/ram.bin").split()[0] == digest
            after = store_b.chunk_cache_figures()
            print(f"node B after the upload: {after['storeChunks'] - store_before} more chunks from the store")
            assert after["peerChunks"] == peer_before and after["storeChunks"] > store_before
            b.kill(restored.sandbox_id)
        a.kill(info.sandbox_id)
        assert store_a.delete(sid) is True
    assert _keys(url, prefix, "") == [], "the capture left objects behind"
