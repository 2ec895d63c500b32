"""The node's bounded image cache (``agent.builder.images`` over ``vmm.oci.usage``), on real
files: an OCI layout written in the store's format, disk dirs, guest image dirs made by
``vmm.oci.guest`` (hard links), the real ``LayerCache`` and snapshot manifests. Fake qcow2
bytes: nothing here reads them."""
import fcntl
import hashlib
import json
import os
import time
from pathlib import Path

import pytest

from agent.builder import images
from agent.builder.layers import LayerCache
from agent.stores.base import PosixFsStore
from agent.stores.s3 import S3Store
from vmm.oci import guest, store, usage
from vmm.oci.disks import OciDisk, disk_dir

MANIFEST = "application/vnd.oci.image.manifest.v1+json"
KEY = "0123456789ab"
KIB = 1024


@pytest.fixture
def node(tmp_path):
    """An images dir with a stand-in built ``base`` (kernel, initrd, tools to link) and a layer cache."""
    images_dir = tmp_path / "images"
    base = images_dir / "base-1234"
    base.mkdir(parents=True)
    for name in ("vmlinuz", "initrd.cpio", "rootfs.qcow2", "tools.img"):
        (base / name).write_bytes(os.urandom(8 * KIB))
    (base / "image.json").write_text(json.dumps({"name": "base", "recipe_hash": "1234", "kernel_release": "6.1"}))
    (images_dir / "base").symlink_to("base-1234")
    return images_dir, LayerCache(images_dir / "layers")


def _blob(layout: Path, data: bytes) -> str:
    h = hashlib.sha256(data).hexdigest()
    (layout / "blobs/sha256").mkdir(parents=True, exist_ok=True)
    (layout / "blobs/sha256" / h).write_bytes(data)
    return f"sha256:{h}"


def _add_image(images_dir: Path, layers: list[bytes], disk_kib: int = 64, used_ago: float | None = None,
               tag: str = "") -> OciDisk:
    """Pulls by hand: blobs + an index.json entry named after the digest, the disk dir, the
    guest image dir (``vmm.oci.guest``), and the used marker ``used_ago`` seconds old."""
    layout = store.layout_dir(images_dir)
    config = _blob(layout, json.dumps({"os": "linux", "architecture": "amd64", "config": {"Env": [f"T={tag}"]}})
                   .encode())
    manifest = _blob(layout, json.dumps({
        "schemaVersion": 2, "mediaType": MANIFEST,
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config, "size": 1},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": _blob(layout, x),
                    "size": len(x)} for x in layers]}).encode())
    index_path = layout / "index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else {"schemaVersion": 2, "manifests": []}
    index["manifests"].append({"mediaType": MANIFEST, "digest": manifest, "size": 1,
                               "annotations": {store.REF_ANNOTATION: f"sha256-{manifest[7:]}"}})
    index_path.write_text(json.dumps(index))
    d = disk_dir(images_dir, manifest, KEY)
    d.mkdir(parents=True)
    (d / "rootfs.qcow2").write_bytes(os.urandom(disk_kib * KIB))
    (d / "disk.json").write_text(json.dumps({"digest": manifest, "key": KEY, "sha256": "0" * 64, "size_mb": 1}))
    disk = OciDisk.from_dir(d)
    guest.guest_image(images_dir, disk)
    if used_ago is not None:
        images.touch(images_dir, manifest)
        t = time.time() - used_ago
        os.utime(usage.used_marker(images_dir, manifest), (t, t))
    return disk


def _layer(cache: LayerCache, key: str, chain_below: list[str], kib: int = 32, used_ago: float = 0.0):
    slot = cache.slot(key)
    slot.layer_path.write_bytes(os.urandom(kib * KIB))
    entry = slot.commit({"ctx": {}, "chain": [*chain_below, str(slot.layer_path)], "layer": True})
    t = time.time() - used_ago
    os.utime(entry.dir / "meta.json", (t, t))
    return entry


def _allocated(*paths: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in paths)


def _present(images_dir: Path) -> set[str]:
    return {i.digest for i in usage.inventory(images_dir)}


def _guest_dir(images_dir: Path, disk: OciDisk) -> Path:
    return (images_dir / guest.default_name(disk)).resolve()


# -- accounting -------------------------------------------------------------------------------


def test_accounting_counts_hard_links_once_and_orphaned_links_fully(node):
    images_dir, cache = node
    disk = _add_image(images_dir, [b"layer-1" * 1000, b"layer-2" * 1000], disk_kib=256)
    _layer(cache, "k1", [str(disk.rootfs)], kib=64)
    gdir = _guest_dir(images_dir, disk)
    assert os.path.samefile(gdir / "rootfs.qcow2", disk.rootfs)  # the guest dir is links
    blobs = list((store.layout_dir(images_dir) / "blobs/sha256").iterdir())
    m = images.measure(images_dir, cache)
    assert m["disks"] == _allocated(disk.rootfs, disk.dir / "disk.json")
    assert m["blobs"] == _allocated(*blobs)
    assert m["guest"] == _allocated(gdir / "image.json")  # its rootfs, kernel, initrd and tools are links
    assert m["layers"] == _allocated(*(p for p in cache.root.rglob("*") if p.is_file()))
    assert m["total"] == m["layers"] + m["disks"] + m["blobs"] + m["guest"]
    # a link that is the last one left costs its bytes
    (disk.rootfs).unlink()
    assert images.measure(images_dir, cache)["guest"] == _allocated(gdir / "image.json", gdir / "rootfs.qcow2")


# -- nothing to do ----------------------------------------------------------------------------


def test_under_the_limit_nothing_is_evicted(node):
    images_dir, cache = node
    old = _add_image(images_dir, [b"a"], used_ago=9000)
    _layer(cache, "k1", [str(old.rootfs)], used_ago=9000)
    _add_image(images_dir, [b"b"], used_ago=10)
    total = images.measure(images_dir, cache)["total"]
    files_before = sorted(str(p) for p in images_dir.rglob("*"))
    report = images.enforce(total, images_dir=images_dir, layers=cache, in_use=set())
    assert report["layers_evicted"] == [] and report["images_evicted"] == [] and report["freed_bytes"] == 0
    assert sorted(str(p) for p in images_dir.rglob("*")) == files_before


# -- LRU --------------------------------------------------------------------------------------


def test_images_go_least_recently_used_first_until_under_the_limit(node):
    images_dir, cache = node
    a = _add_image(images_dir, [b"a" * 5000], used_ago=300)
    b = _add_image(images_dir, [b"b" * 5000], used_ago=200)
    c = _add_image(images_dir, [b"c" * 5000], used_ago=100)
    images.touch(images_dir, a.digest)  # used again just now: a is the newest
    assert images.last_used(images_dir, a.digest) > time.time() - 60
    total = images.measure(images_dir, cache)["total"]
    report = images.enforce(total - 1, images_dir=images_dir, layers=cache, in_use=set())
    assert report["images_evicted"] == [b.digest]
    assert _present(images_dir) == {a.digest, c.digest}
    assert not b.dir.exists() and not (images_dir / guest.default_name(b)).exists()
    assert not any(p.name.startswith(guest.default_name(b)) for p in images_dir.iterdir())
    assert b.digest not in store.images(images_dir)
    assert report["after_bytes"] <= total - 1 < report["before_bytes"] and report["freed_bytes"] > 0
    report = images.enforce(report["after_bytes"] - 1, images_dir=images_dir, layers=cache, in_use=set())
    assert report["images_evicted"] == [c.digest] and _present(images_dir) == {a.digest}


def test_layers_go_before_images_and_then_the_image_they_stacked_on(node):
    images_dir, cache = node
    old = _add_image(images_dir, [b"old" * 3000], used_ago=900)
    new = _add_image(images_dir, [b"new" * 3000], used_ago=10)
    l1 = _layer(cache, "k1", [str(new.rootfs)], kib=64, used_ago=50)
    l2 = _layer(cache, "k2", [str(old.rootfs)], kib=64, used_ago=40)
    m = images.measure(images_dir, cache)
    # just over by less than one layer: the older layer goes, no image
    report = images.enforce(m["total"] - 1, images_dir=images_dir, layers=cache, in_use=set())
    assert report["layers_evicted"] == ["k1"] and report["images_evicted"] == []
    assert not l1.dir.exists() and l2.dir.exists()
    # limit 0: every layer, then the images (k2 stacked on old, but it went too)
    report = images.enforce(0, images_dir=images_dir, layers=cache, in_use=set())
    assert report["layers_evicted"] == ["k2"] and report["images_evicted"] == [old.digest, new.digest]
    assert _present(images_dir) == set() and cache.entries() == []
    assert list((store.layout_dir(images_dir) / "blobs/sha256").iterdir()) == []


def test_a_recently_used_image_stays(node):
    images_dir, cache = node
    a = _add_image(images_dir, [b"a"], used_ago=30)
    b = _add_image(images_dir, [b"b"], used_ago=7200)
    report = images.enforce(0, images_dir=images_dir, layers=cache, in_use=set(), recent_s=3600)
    assert report["images_evicted"] == [b.digest] and "recently" in report["kept"][a.digest]


# -- what must stay ---------------------------------------------------------------------------


def test_an_image_or_layer_in_use_is_never_evicted(node):
    images_dir, cache = node
    booted = _add_image(images_dir, [b"booted"], used_ago=9000)
    stacked = _add_image(images_dir, [b"stacked"], used_ago=8000)
    free = _add_image(images_dir, [b"free"], used_ago=7000)
    layer = _layer(cache, "k1", [str(stacked.rootfs)], used_ago=9000)
    loose = _layer(cache, "k2", [str(free.rootfs)], used_ago=9000)
    # a VM booted the guest image by its symlinked name, another one runs on the layer
    in_use = {str(images_dir / guest.default_name(booted) / "vmlinuz"), str(layer.layer)}
    report = images.enforce(0, images_dir=images_dir, layers=cache, in_use=in_use)
    assert report["layers_evicted"] == ["k2"] and not loose.dir.exists() and layer.dir.exists()
    assert report["images_evicted"] == [free.digest]
    assert _present(images_dir) == {booted.digest, stacked.digest}
    assert "in use" in report["kept"][booted.digest] and "layer" in report["kept"][stacked.digest]
    assert booted.rootfs.is_file() and (_guest_dir(images_dir, booted) / "vmlinuz").is_file()
    assert report["after_bytes"] > 0  # still over: nothing else may go


def test_keep_digests_stay(node):
    images_dir, cache = node
    a = _add_image(images_dir, [b"a"], used_ago=9000)
    b = _add_image(images_dir, [b"b"], used_ago=8000)
    report = images.enforce(0, images_dir=images_dir, layers=cache, in_use=set(), keep_digests={a.digest})
    assert report["images_evicted"] == [b.digest] and _present(images_dir) == {a.digest}


def test_an_image_a_snapshot_on_the_node_stacks_on_stays(node, tmp_path):
    images_dir, cache = node
    posix = _add_image(images_dir, [b"posix"], used_ago=9000)
    cached = _add_image(images_dir, [b"downloaded"], used_ago=8000)
    booted = _add_image(images_dir, [b"booted template"], used_ago=7500)
    gone = _add_image(images_dir, [b"gone"], used_ago=7000)
    home = tmp_path / "home"
    booted_root = images_dir / "snapshots" / _guest_dir(images_dir, booted).name
    for root, disk, sid in ((home / "snapshots", posix, "snap1"), (home / "cache" / "snapshots", cached, "snap2"),
                            (booted_root, booted, "c2-m512-d2048-tcg-0")):
        (root / sid).mkdir(parents=True)
        gdir = images_dir / guest.default_name(disk)
        (root / sid / "manifest.json").write_text(json.dumps({
            "dir": str(root / sid), "layers": [str(disk.rootfs), str(root / sid / "layer-0.qcow2")],
            "machine": {"kernel": str(gdir / "vmlinuz"), "tools": str(gdir / "tools.img")}}))
    s3 = S3Store(home=home, images_dir=images_dir, bucket="b", client=object(), driver=object())
    assert images.snapshot_roots(PosixFsStore(home / "snapshots")) == [home / "snapshots"]
    refs = images.referenced_paths(images.snapshot_roots(s3), images_dir)
    assert {str(posix.rootfs), str(cached.rootfs), str(booted.rootfs)} <= refs and str(gone.rootfs) not in refs
    report = images.enforce(0, images_dir=images_dir, layers=cache, in_use=refs)
    assert report["images_evicted"] == [gone.digest]
    assert _present(images_dir) == {posix.digest, cached.digest, booted.digest}


def test_a_build_from_an_image_marks_it_used_after_the_pull_and_after_the_disk(node, monkeypatch):
    import vmm.oci
    from agent.builder import base as bases

    images_dir, _cache = node
    disk = _add_image(images_dir, [b"a"], used_ago=9000)
    pulled = store.load(images_dir, disk.digest)
    seen = []

    def ensure_disk(_images_dir, image, progress, modules=None):
        seen.append(images.last_used(images_dir, image.digest))
        t = time.time() - 5000
        os.utime(usage.used_marker(images_dir, image.digest), (t, t))
        return disk

    monkeypatch.setattr(vmm.oci, "pull", lambda *a, **k: pulled)
    monkeypatch.setattr(vmm.oci, "ensure_disk", ensure_disk)
    found = bases.from_image("127.0.0.1:5000/x:1", None, images_dir, [], say=lambda m: None,
                             private_allowed=["127.0.0.1"])
    assert found.layers == [str(disk.rootfs)]
    assert seen[0] > time.time() - 60  # touched before the disk is made (a long step)
    assert images.last_used(images_dir, disk.digest) > time.time() - 60  # and again after it


def test_blobs_of_an_evicted_image_go_and_shared_ones_stay(node):
    images_dir, cache = node
    shared = b"shared base layer" * 500
    a = _add_image(images_dir, [shared, b"only a" * 500], used_ago=9000, tag="a")
    b = _add_image(images_dir, [shared, b"only b" * 500], used_ago=10, tag="b")
    blobs = store.layout_dir(images_dir) / "blobs/sha256"
    a_blobs = {a.digest[7:]} | {x.digest[7:] for x in store.load(images_dir, a.digest).layers}
    a_blobs.add(json.loads((blobs / a.digest[7:]).read_text())["config"]["digest"][7:])
    shared_hex = hashlib.sha256(shared).hexdigest()
    before = images.measure(images_dir, cache)["total"]
    report = images.enforce(before - 1, images_dir=images_dir, layers=cache, in_use=set())
    assert report["images_evicted"] == [a.digest] and report["blobs_removed"] == len(a_blobs) - 1
    left = {p.name for p in blobs.iterdir()}
    assert shared_hex in left and not (a_blobs - {shared_hex}) & left
    image = store.load(images_dir, b.digest)  # b is whole
    assert [x.digest[7:] for x in image.layers][0] == shared_hex and all(x.digest[7:] in left for x in image.layers)


def test_nothing_is_removed_while_a_disk_is_being_built(node):
    images_dir, cache = node
    a = _add_image(images_dir, [b"a"], used_ago=9000)
    lock = a.dir.parent / ".build.lock"
    fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # what vmm.oci.disks.ensure_disk holds while building
        report = images.enforce(0, images_dir=images_dir, layers=cache, in_use=set())
    finally:
        os.close(fd)
    assert report["images_evicted"] == [] and "being built" in report["kept"][a.digest]
    assert a.rootfs.is_file() and a.digest in store.images(images_dir)
    assert images.enforce(0, images_dir=images_dir, layers=cache, in_use=set())["images_evicted"] == [a.digest]


def test_the_node_limit_is_read_at_call_time(node, settings):
    images_dir, cache = node
    a = _add_image(images_dir, [b"a"], used_ago=9000)

    class Driver:
        def files_in_use(self):
            return set()

    store_ = PosixFsStore(images_dir.parent / "snapshots")
    settings.AENV_IMAGE_CACHE_MB = 1024
    assert images.enforce_on_node(images_dir=images_dir, layers=cache, driver=Driver(), store=store_,
                                  recent_s=0)["images_evicted"] == []
    settings.AENV_IMAGE_CACHE_MB = 0
    report = images.enforce_on_node(images_dir=images_dir, layers=cache, driver=Driver(), store=store_, recent_s=0)
    assert report["images_evicted"] == [a.digest] and report["limit_bytes"] == 0


# -- the node's hooks -------------------------------------------------------------------------


def test_every_build_ends_with_a_trim_that_never_fails_it(node, monkeypatch):
    import agent.builder as builder
    from agent.builder.build import Node
    from template_builds import progress

    images_dir, cache = node

    class BrokenDriver:
        def files_in_use(self):
            raise RuntimeError("no VM records")

    n = Node(node_id="n1", driver=BrokenDriver(), store=PosixFsStore(images_dir.parent / "snapshots"), files=None,
             images_dir=images_dir, cache=cache, build_timeout=1234.0)
    assert builder.trim_image_cache(n, recent_s=0) is None  # logged, not raised
    trims = []
    monkeypatch.setattr(progress, "accept", lambda build_id, node_id: True)
    monkeypatch.setattr(builder, "trim_image_cache", lambda node, recent_s: trims.append((node, recent_s)))
    monkeypatch.setattr(builder, "_build_and_report", lambda *a: {"status": "ready"})
    assert builder.build_template(build_id="b", template_id="t", spec={}, cpu_count=1, memory_mb=128,
                                  disk_size_mb=1024, node=n) == {"status": "ready"}

    def crash(*a):
        raise RuntimeError("boom")

    monkeypatch.setattr(builder, "_build_and_report", crash)
    with pytest.raises(RuntimeError):
        builder.build_template(build_id="b", template_id="t", spec={}, cpu_count=1, memory_mb=128,
                               disk_size_mb=1024, node=n)
    assert trims == [(n, 1234.0), (n, 1234.0)]  # in-flight builds' images are protected that long
