"""vmm.oci.store's layout bookkeeping (load, images, remove, gc) on a layout written here, and
vmm.oci.guest's image dirs over a stand-in base image: no registry, no root."""

import hashlib
import json
from pathlib import Path

import pytest

from vmm.images import GuestImage, find_image
from vmm.oci import guest, store
from vmm.oci.disks import OciDisk
from vmm.oci.errors import OciError
from vmm.templates import snapshot_dir

MANIFEST = "application/vnd.oci.image.manifest.v1+json"


def _blob(layout: Path, data: bytes) -> str:
    h = hashlib.sha256(data).hexdigest()
    (layout / "blobs/sha256").mkdir(parents=True, exist_ok=True)
    (layout / "blobs/sha256" / h).write_bytes(data)
    return f"sha256:{h}"


def _image(layout: Path, layers: list[bytes], env=("A=1",), arch="amd64") -> str:
    config = _blob(layout, json.dumps({"os": "linux", "architecture": arch, "created": "2024-01-01T00:00:00Z",
                                       "config": {"Env": list(env), "WorkingDir": "/w"}}).encode())
    manifest = {"schemaVersion": 2, "mediaType": MANIFEST,
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config, "size": 1},
                "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": _blob(layout, x),
                            "size": len(x)} for x in layers]}
    return _blob(layout, json.dumps(manifest).encode())


def _index(layout: Path, entries: dict[str, str]) -> None:
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": MANIFEST, "digest": d, "size": 1, "annotations": {store.REF_ANNOTATION: name}}
        for name, d in entries.items()]}))


def test_load_remove_gc(tmp_path):
    layout = store.layout_dir(tmp_path)
    a = _image(layout, [b"base layer", b"layer a"])
    b = _image(layout, [b"base layer", b"layer b"], env=("B=2",))
    orphan = _blob(layout, b"left by a failed pull")
    _index(layout, {f"sha256-{a[7:]}": a, f"sha256-{b[7:]}": b, "pull-999999999-dead": orphan})
    assert sorted(store.images(tmp_path)) == sorted([a, b])
    image = store.load(tmp_path, a)
    assert image.env == {"A": "1"} and image.workdir == "/w" and len(image.layers) == 2
    assert image.created == "2024-01-01T00:00:00Z" and image.layout == layout
    assert store.gc(tmp_path) == 1  # the orphan (its pull process is gone); the shared base layer stays
    assert store.remove(tmp_path, a) and not store.remove(tmp_path, a)
    with pytest.raises(OciError, match="not in"):
        store.load(tmp_path, a)
    assert store.gc(tmp_path) == 3  # a's manifest, config and own layer; b keeps the shared layer
    assert store.load(tmp_path, b).layers[0].digest == image.layers[0].digest
    assert len(list((layout / "blobs/sha256").iterdir())) == 4


def test_other_platforms_are_refused(tmp_path):
    layout = store.layout_dir(tmp_path)
    arm = _image(layout, [b"x"], arch="arm64")
    _index(layout, {f"sha256-{arm[7:]}": arm})
    with pytest.raises(OciError, match="linux/arm64 image"):
        store.load(tmp_path, arm)


@pytest.fixture
def base(tmp_path):
    """A stand-in built `base` image (small files where the kernel, initrd and tools go)."""
    d = tmp_path / "base-1234"
    d.mkdir()
    for f in ("vmlinuz", "initrd.cpio", "rootfs.qcow2", "tools.img"):
        (d / f).write_bytes(f.encode())
    (d / "image.json").write_text(json.dumps({"name": "base", "recipe_hash": "1234", "kernel_release": "6.1"}))
    (tmp_path / "base").symlink_to("base-1234")
    return find_image(tmp_path, "base")


def _disk(tmp_path: Path, digest_hex: str, key: str = "k1") -> OciDisk:
    d = tmp_path / "oci/disks" / f"sha256-{digest_hex}-{key}"
    d.mkdir(parents=True)
    (d / "rootfs.qcow2").write_bytes(b"disk " + digest_hex.encode())
    meta = {"digest": f"sha256:{digest_hex}", "key": key, "sha256": hashlib.sha256(digest_hex.encode()).hexdigest(),
            "size_mb": 2048, "config": {"Env": ["X=1"]}, "ref": "r/app:v1"}
    (d / "disk.json").write_text(json.dumps(meta))
    return OciDisk.from_dir(d)


def test_guest_image_links_base_files_and_the_disk(tmp_path, base):
    disk = _disk(tmp_path, "ab" * 32)
    image = guest.guest_image(tmp_path, disk)
    assert image.name == "oci-" + "ab" * 6 and isinstance(image, GuestImage)
    assert find_image(tmp_path, image.name) == image
    for ours, theirs in ((image.kernel, base.kernel), (image.initrd, base.initrd), (image.tools, base.tools),
                         (image.rootfs, disk.rootfs)):
        assert ours.samefile(theirs)
    meta = json.loads((image.kernel.parent / "image.json").read_text())
    assert meta["oci"]["digest"] == disk.digest and meta["oci"]["config"] == {"Env": ["X=1"]}
    assert meta["kernel_release"] == "6.1" and meta["base"]["recipe_hash"] == "1234"
    assert guest.guest_image(tmp_path, disk) == image  # idempotent
    assert find_image(tmp_path, "base") == base and base.rootfs.read_bytes() == b"rootfs.qcow2"


def test_recipe_and_template_key_follow_the_rootfs(tmp_path, base):
    one = guest.guest_image(tmp_path, _disk(tmp_path, "ab" * 32, "k1"), name="app")
    other_converter = guest.guest_image(tmp_path, _disk(tmp_path, "ab" * 32, "k2"), name="app")
    assert other_converter.recipe_hash != one.recipe_hash
    assert find_image(tmp_path, "app") == other_converter  # the name points at the newest
    assert one.kernel.parent.exists()  # the older build stays for whoever uses it
    fp = {"driver": "qemu", "accel": "tcg"}
    dirs = {snapshot_dir(tmp_path, img, 2, 512, 2048, fp) for img in (one, other_converter, base)}
    assert len(dirs) == 3
    assert guest.remove_guest_image(tmp_path, "app") == 2
    assert not (tmp_path / "app").exists() and find_image(tmp_path, "base") == base


@pytest.mark.parametrize("name", ["base", "oci", "Bad", "../x", "a/b", ""])
def test_bad_names(tmp_path, base, name):
    with pytest.raises(OciError, match="invalid image name"):
        guest.guest_image(tmp_path, _disk(tmp_path, "cd" * 32), name=name or "-")
