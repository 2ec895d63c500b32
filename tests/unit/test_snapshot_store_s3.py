"""The S3 snapshot store against a real S3 API (a ``moto_server`` subprocess, boto3
with endpoint_url; nothing mocked): chunking and zero-skipping, dedup between
snapshots, download onto another "node" (paths and qcow2 backing files re-pointed),
a missing base image, reference-counted delete, and the bounded LRU cache."""
import hashlib
import json
import os
import subprocess
import time
import uuid
from pathlib import Path
from unittest import mock

import pytest

from agent.stores.base import SnapshotStoreError
from agent.stores.cache import LAST_USED
from agent.stores.chunks import Chunk, chunk_spans, read_chunk
from agent.stores.s3 import S3Store
from harness.moto_s3 import moto_server, default_credentials
from harness.moto_s3 import client as _client
from vmm.qemu import QemuDriver

CHUNK = 64 << 10  # small chunks keep the test files small
BUCKET = "aenv-test"


@pytest.fixture(scope="module")
def s3_endpoint():
    """A real moto S3 server for this module, with an empty bucket."""
    default_credentials()
    with moto_server(BUCKET) as url:
        yield url


@pytest.fixture
def s3(s3_endpoint):
    """The raw client, and a fresh key prefix so tests do not see each other's objects."""
    return _client(s3_endpoint), f"t-{uuid.uuid4().hex[:8]}"


def _keys(client, prefix, sub=""):
    out = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"{prefix}/{sub}"):
        out += [o["Key"][len(prefix) + 1:] for o in page.get("Contents", [])]
    return sorted(out)


def _image_keys(client, prefix) -> set[str]:
    """What the published image files hold in the store (their index, chunks and markers)."""
    keys = set(_keys(client, prefix, "images/"))
    for key in list(keys):
        doc = json.loads(client.get_object(Bucket=BUCKET, Key=f"{prefix}/{key}")["Body"].read())
        owner = "image-" + Path(key).stem[:32]
        for _, _, sha in doc["chunks"]:
            keys |= {f"chunks/{sha}", f"refs/{sha}/{owner}"}
    return keys


def _snapshot_chunks(client, prefix) -> list[str]:
    """The chunks some snapshot holds a marker for (image files may share some of them)."""
    held = {k.split("/")[1] for k in _keys(client, prefix, "refs/") if not k.split("/")[2].startswith("image-")}
    return [k for k in _keys(client, prefix, "chunks/") if k.split("/")[1] in held]


def _store(s3, home, images, **kw) -> S3Store:
    """A node's store, with that node's QEMU driver (nothing boots: it adopts downloads and
    reads its vm.json records for the files its VMs use). The driver's network is pinned to
    slirp, the one the _capture() manifests (no "net" in a fingerprint) were taken on: a
    snapshot restores only on the network it was taken on, and the backend `auto` picks
    depends on the host (netns as root)."""
    client, prefix = s3
    driver = QemuDriver(home=home, images_dir=images, accel="tcg", network="slirp")
    return S3Store(home=home, images_dir=images, bucket=BUCKET, client=client, prefix=prefix, chunk_size=CHUNK,
                   concurrency=4, driver=driver, **kw)


def _images(tmp_path) -> Path:
    """A fake image build: base layer, kernel, initrd, tools (only their presence matters)."""
    d = tmp_path / "images" / "base-abc"
    d.mkdir(parents=True)
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(d / "rootfs.qcow2"), "64M"], check=True)
    for name in ("vmlinuz", "initrd.cpio", "tools.img"):
        (d / name).write_bytes(b"x")
    return tmp_path / "images"


def _capture(home: Path, images: Path, sid: str, ram: bytes | dict[int, bytes]) -> Path:
    """A snapshot dir shaped like QemuDriver.snapshot()'s: two qcow2 layers chained by
    absolute backing paths onto the base, a sparse RAM file, a device state."""
    d = home / "snapshots" / sid
    d.mkdir(parents=True)
    base = images / "base-abc" / "rootfs.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(base), "-F", "qcow2",
                    str(d / "layer-0.qcow2"), "64M"], check=True)
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(d / "layer-0.qcow2"), "-F", "qcow2",
                    str(d / "layer-1.qcow2"), "64M"], check=True)
    with open(d / "memory.ram", "wb") as f:
        f.truncate(16 * CHUNK)
        for offset, data in (ram.items() if isinstance(ram, dict) else [(0, ram)]):
            f.seek(offset)
            f.write(data)
    (d / "device.state").write_bytes(b"QEVM" + b"\x01" * 1000)
    manifest = {
        "dir": str(d), "layers": [str(base), str(d / "layer-0.qcow2"), str(d / "layer-1.qcow2")],
        "memory_file": str(d / "memory.ram"), "device_state_file": str(d / "device.state"),
        "cpu_count": 1, "memory_mb": 1, "disk_size_mb": 64,
        "machine": {"kernel": str(images / "base-abc" / "vmlinuz"), "initrd": str(images / "base-abc" / "initrd.cpio"),
                    "tools": str(images / "base-abc" / "tools.img"), "image": "base",
                    "image_dir": str(images / "base-abc"), "accel": "tcg", "qemu": "qemu-system-x86_64"},
        "source_sandbox_id": "i1", "created_at": 1.0, "timings": {},
    }
    (d / "manifest.json").write_text(json.dumps(manifest))
    return d


def _backing(path: Path) -> str:
    out = subprocess.run(["qemu-img", "info", "--output=json", "-U", str(path)], check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out)["backing-filename"]


# --------------------------------------------------------------------------- chunking


def test_chunk_spans_skip_holes_and_read_chunk_drops_zeros(tmp_path):
    f = tmp_path / "sparse"
    with open(f, "wb") as fh:
        fh.truncate(10 * CHUNK + 100)
        fh.seek(3 * CHUNK + 5)
        fh.write(b"data")
        fh.seek(5 * CHUNK)
        fh.write(bytes(CHUNK))  # written zeros: allocated, but nothing to store
        fh.seek(10 * CHUNK)
        fh.write(b"tail")
    spans = list(chunk_spans(f, CHUNK))
    assert Chunk(0, CHUNK) not in spans, "a hole was read"
    assert Chunk(3 * CHUNK, CHUNK) in spans and Chunk(10 * CHUNK, 100) in spans
    stored = [c for c in spans if read_chunk(f, c) is not None]
    assert stored == [Chunk(3 * CHUNK, CHUNK), Chunk(10 * CHUNK, 100)]


# --------------------------------------------------------------------------- commit


def test_commit_stores_nonzero_chunks_once_and_is_idempotent(s3, tmp_path):
    client, prefix = s3
    images = _images(tmp_path)
    home = tmp_path / "n1"
    pattern = os.urandom(CHUNK)
    # the same non-zero chunk twice, zeros between: one chunk object for the RAM
    _capture(home, images, "snap-a", {0: pattern, 7 * CHUNK: pattern})
    store = _store(s3, home, images)
    stats = store.commit("snap-a")
    doc = json.loads(client.get_object(Bucket=BUCKET, Key=f"{prefix}/snapshots/snap-a/manifest.json")["Body"].read())
    ram = doc["files"]["memory.ram"]
    assert ram["size"] == 16 * CHUNK
    assert [c[0] for c in ram["chunks"]] == [0, 7 * CHUNK] and ram["chunks"][0][2] == ram["chunks"][1][2]
    assert set(doc["files"]) == {"layer-0.qcow2", "layer-1.qcow2", "memory.ram", "device.state"}
    # paths are relative: nothing of this node's directories is left in the manifest
    text = json.dumps(doc["manifest"])
    assert str(tmp_path) not in text
    assert doc["manifest"]["layers"] == ["$IMAGES/base-abc/rootfs.qcow2", "$SNAPSHOT/layer-0.qcow2",
                                         "$SNAPSHOT/layer-1.qcow2"]
    chunks = _snapshot_chunks(client, prefix)
    assert len(chunks) == stats["unique_chunks"] == stats["uploaded"]
    assert stats["chunks"] > stats["unique_chunks"]  # the repeated RAM chunk was sent once
    stored = sum(client.head_object(Bucket=BUCKET, Key=f"{prefix}/{k}")["ContentLength"] for k in chunks)
    assert stored < 6 * CHUNK, "zero chunks were uploaded"
    assert len([k for k in _keys(client, prefix, "refs/") if k.endswith("/snap-a")]) == len(chunks)
    # the files it takes from the images dir are in the store by content, once
    assert set(doc["image_files"]) == {"base", "kernel", "initrd", "tools"}
    assert doc["image_files"]["base"]["path"] == "$IMAGES/base-abc/rootfs.qcow2"
    published = {f"images/{f['digest']}.json" for f in doc["image_files"].values()}
    assert published == set(_keys(client, prefix, "images/"))  # kernel, initrd and tools: equal bytes, one file

    again = store.commit("snap-a")  # harmless, uploads nothing
    assert again["uploaded"] == 0 and again["reuploaded"] == 0
    assert _snapshot_chunks(client, prefix) == chunks


def test_second_snapshot_uploads_only_what_changed(s3, tmp_path):
    client, prefix = s3
    images = _images(tmp_path)
    home = tmp_path / "n1"
    ram = {i * CHUNK: os.urandom(CHUNK) for i in range(6)}
    _capture(home, images, "parent", ram)
    store = _store(s3, home, images)
    first = store.commit("parent")
    changed = dict(ram)
    changed[2 * CHUNK] = os.urandom(CHUNK)  # the child touched one page range
    _capture(home, images, "child", changed)
    second = store.commit("child")
    # one RAM chunk, plus the layer headers that name their own (different) directory
    assert second["uploaded"] <= 3, second
    assert second["chunks"] == first["chunks"]
    assert len(_snapshot_chunks(client, prefix)) == first["unique_chunks"] + second["uploaded"]


def test_ram_is_cut_smaller_than_disks_each_file_naming_its_chunk_size(s3, tmp_path):
    """Guest RAM at its own (smaller) chunk size, disks at the store's: the manifest names
    each file's, equal RAM pieces are one object, and a download rebuilds every byte."""
    client, prefix = s3
    images = _images(tmp_path)
    piece = CHUNK // 4
    same = os.urandom(piece)
    ram = {0: same, 5 * piece: same, 9 * piece: os.urandom(piece // 2)}  # within 3 disk-sized chunks
    src = _capture(tmp_path / "n1", images, "snap-r", ram)
    stats = _store(s3, tmp_path / "n1", images, ram_chunk_size=piece).commit("snap-r")
    doc = json.loads(client.get_object(Bucket=BUCKET, Key=f"{prefix}/snapshots/snap-r/manifest.json")["Body"].read())
    assert doc["chunk_size"] == CHUNK
    mem = doc["files"]["memory.ram"]
    assert mem["chunk_size"] == piece
    assert [c[:2] for c in mem["chunks"]] == [[0, piece], [5 * piece, piece], [9 * piece, piece]]
    assert mem["chunks"][0][2] == mem["chunks"][1][2]  # equal pieces: one object
    assert {doc["files"][n]["chunk_size"] for n in ("layer-0.qcow2", "layer-1.qcow2", "device.state")} == {CHUNK}
    assert stats["chunks"] > stats["unique_chunks"]
    local = _store(s3, tmp_path / "n2", images).local_dir("snap-r")  # a node with the default RAM size
    for name in ("memory.ram", "device.state"):
        assert (local / name).read_bytes() == (src / name).read_bytes()
    subprocess.run(["qemu-img", "check", "-q", str(local / "layer-1.qcow2")], check=True)


def test_a_manifest_from_before_per_file_chunk_sizes_still_restores(s3, tmp_path):
    """Older manifests name one chunk size for all files (and had RAM at it): read as such."""
    client, prefix = s3
    images = _images(tmp_path)
    src = _capture(tmp_path / "n1", images, "snap-o", {3 * CHUNK + 7: os.urandom(CHUNK)})
    _store(s3, tmp_path / "n1", images, ram_chunk_size=CHUNK).commit("snap-o")
    key = f"{prefix}/snapshots/snap-o/manifest.json"
    doc = json.loads(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    for info in doc["files"].values():
        del info["chunk_size"]
    client.put_object(Bucket=BUCKET, Key=key, Body=json.dumps(doc).encode())
    local = _store(s3, tmp_path / "n2", images, ram_chunk_size=CHUNK // 4).local_dir("snap-o")
    assert (local / "memory.ram").read_bytes() == (src / "memory.ram").read_bytes()


def test_local_chunks_index_ram_files_at_the_ram_chunk_size(tmp_path):
    from agent.stores.local_chunks import LocalChunks

    root = tmp_path / "files"
    root.mkdir()
    data = os.urandom(2 * CHUNK)
    for name in ("memory.ram", "disk.qcow2"):
        (root / name).write_bytes(data)
    index = LocalChunks([root], tmp_path / "index", CHUNK, CHUNK // 4)
    assert [c[:2] for c in index.file_chunks(root / "memory.ram")] == [[i * CHUNK // 4, CHUNK // 4] for i in range(8)]
    assert [c[:2] for c in index.file_chunks(root / "disk.qcow2")] == [[0, CHUNK], [CHUNK, CHUNK]]
    piece = index.file_chunks(root / "memory.ram")[3]
    assert index.read(piece[2], CHUNK // 4) == data[3 * CHUNK // 4:CHUNK]
    # the saved index of a file is per chunk size: another size hashes it again
    again = LocalChunks([root], tmp_path / "index", CHUNK, CHUNK // 2)
    assert len(again.file_chunks(root / "memory.ram")) == 4


# --------------------------------------------------------------------------- download


def test_other_node_downloads_rewrites_paths_and_rebases(s3, tmp_path):
    images = _images(tmp_path)
    src = _capture(tmp_path / "n1", images, "snap-b", {CHUNK: os.urandom(CHUNK)})
    _store(s3, tmp_path / "n1", images).commit("snap-b")

    other = _store(s3, tmp_path / "n2", images)
    assert other.local_ids() == []
    # what a crashed worker left: a half-removed entry and another id's download
    crumbs = tmp_path / "n2" / "cache" / "snapshots"
    for name in (".tmp-rm-old-1234abcd", ".tmp-zzz-1234abcd"):
        (crumbs / name).mkdir(parents=True)
        (crumbs / name / "memory.ram").write_bytes(b"x" * 100)
    local = other.local_dir("snap-b")
    assert not list(crumbs.glob(".tmp-*")), "leftovers were not swept"
    assert local == tmp_path / "n2" / "cache" / "snapshots" / "snap-b"
    for name in ("memory.ram", "device.state"):
        assert (local / name).read_bytes() == (src / name).read_bytes()
    assert os.stat(local / "memory.ram").st_blocks * 512 < 4 * CHUNK, "the RAM file was not kept sparse"
    manifest = json.loads((local / "manifest.json").read_text())
    assert manifest["dir"] == str(local)
    assert manifest["layers"] == [str(images / "base-abc" / "rootfs.qcow2"), str(local / "layer-0.qcow2"),
                                  str(local / "layer-1.qcow2")]
    assert manifest["memory_file"] == str(local / "memory.ram")
    assert manifest["machine"]["kernel"] == str(images / "base-abc" / "vmlinuz")
    assert _backing(local / "layer-0.qcow2") == str(images / "base-abc" / "rootfs.qcow2")
    assert _backing(local / "layer-1.qcow2") == str(local / "layer-0.qcow2")
    subprocess.run(["qemu-img", "check", "-q", str(local / "layer-1.qcow2")], check=True)
    assert other.local_dir("snap-b") == local  # a second lookup is the cache
    assert not list(local.parent.glob(".tmp-*"))
    assert other.local_ids() == ["snap-b"]  # what its heartbeat reports for placement (no staging dirs)

    # the node that took it uses its own copy
    assert _store(s3, tmp_path / "n1", images).local_dir("snap-b") == src


def test_a_download_reads_the_chunks_this_node_has_from_its_own_files(s3, tmp_path):
    """A snapshot carrying RAM the downloading node already has (here: in a template
    snapshot of its images dir) fetches only the rest from the store; a local file whose
    bytes changed since it was indexed is not trusted (re-hashed: the store's copy is used)."""
    images = _images(tmp_path)
    shared, own = os.urandom(CHUNK), os.urandom(CHUNK)
    src = _capture(tmp_path / "n1", images, "snap-l", {0: shared, 2 * CHUNK: own})
    _store(s3, tmp_path / "n1", images).commit("snap-l")
    template = images / "snapshots" / "base-abc" / "c1-m1"
    template.mkdir(parents=True)
    (template / "memory.ram").write_bytes(os.urandom(CHUNK) + shared)  # the same bytes, at another offset

    client, _ = s3
    gets = []
    real_get = client.get_object

    def counting_get(**kw):
        gets.append(kw["Key"])
        return real_get(**kw)

    other = _store(s3, tmp_path / "n2", images)
    other.s3 = mock.Mock(wraps=client, get_object=counting_get)
    local = other.local_dir("snap-l")
    assert (local / "memory.ram").read_bytes() == (src / "memory.ram").read_bytes()
    fetched = {k.rsplit("/", 1)[-1] for k in gets if "/chunks/" in k}
    assert hashlib.sha256(shared).hexdigest() not in fetched  # read from the template's RAM file
    assert hashlib.sha256(own).hexdigest() in fetched

    # the index is trusted only as long as the bytes are the same
    third = _store(s3, tmp_path / "n3", images)
    third.on_disk.read(hashlib.sha256(shared).hexdigest(), CHUNK)  # indexed now
    with open(template / "memory.ram", "r+b") as f:  # same size, same mtime: only the bytes change
        st = os.fstat(f.fileno())
        f.seek(CHUNK)
        f.write(os.urandom(CHUNK))
    os.utime(template / "memory.ram", ns=(st.st_atime_ns, st.st_mtime_ns))
    gets.clear()
    third.s3 = mock.Mock(wraps=client, get_object=counting_get)
    local = third.local_dir("snap-l")
    assert (local / "memory.ram").read_bytes() == (src / "memory.ram").read_bytes()
    assert hashlib.sha256(shared).hexdigest() in {k.rsplit("/", 1)[-1] for k in gets}


def test_a_node_with_another_build_of_the_image_gets_the_files_with_the_snapshot(s3, tmp_path):
    """Two nodes' builds of one image recipe may differ byte for byte (debootstrap is not
    reproducible); a layer over another base, or a guest over another tools drive, would read
    garbage. So a node uses its own image files only when their content is the snapshot's;
    otherwise they come from the store into the snapshot's own dir (its disk chain and
    machine re-pointed there); a node that has them uses its own."""
    images = _images(tmp_path)
    src = _capture(tmp_path / "n1", images, "snap-c", {CHUNK: os.urandom(CHUNK)})
    _store(s3, tmp_path / "n1", images).commit("snap-c")
    base = images / "base-abc" / "rootfs.qcow2"

    same = _store(s3, tmp_path / "n2", images).local_dir("snap-c")
    manifest = json.loads((same / "manifest.json").read_text())
    assert manifest["layers"][0] == str(base) and not list(same.glob("image-*"))

    other = tmp_path / "other-images"  # the same recipe (dir name), another build of it
    (other / "base-abc").mkdir(parents=True)
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(other / "base-abc" / "rootfs.qcow2"), "128M"],
                   check=True)
    for name in ("vmlinuz", "initrd.cpio"):
        (other / "base-abc" / name).write_bytes(b"x")
    (other / "base-abc" / "tools.img").write_bytes(b"another tools drive")
    local = _store(s3, tmp_path / "n3", other).local_dir("snap-c")
    manifest = json.loads((local / "manifest.json").read_text())
    assert manifest["layers"][0] == str(local / "image-base.qcow2")
    assert (local / "image-base.qcow2").read_bytes() == base.read_bytes()
    assert _backing(local / "layer-0.qcow2") == str(local / "image-base.qcow2")
    assert manifest["machine"]["tools"] == str(local / "image-tools.img")
    assert (local / "image-tools.img").read_bytes() == b"x"
    assert manifest["machine"]["kernel"] == str(other / "base-abc" / "vmlinuz")  # the same bytes: its own
    assert (local / "memory.ram").read_bytes() == (src / "memory.ram").read_bytes()
    subprocess.run(["qemu-img", "check", "-q", str(local / "layer-1.qcow2")], check=True)

    nothing = tmp_path / "no-images"  # no build at all: everything comes with it
    nothing.mkdir()
    local = _store(s3, tmp_path / "n4", nothing).local_dir("snap-c")
    assert sorted(p.name for p in local.glob("image-*")) == ["image-base.qcow2", "image-initrd.cpio",
                                                             "image-kernel", "image-tools.img"]


def test_a_snapshot_or_image_file_the_store_lacks_is_a_clear_error(s3, tmp_path):
    client, prefix = s3
    images = _images(tmp_path)
    _capture(tmp_path / "n1", images, "snap-d", b"x")
    _store(s3, tmp_path / "n1", images).commit("snap-d")
    for key in _keys(client, prefix, "images/"):
        client.delete_object(Bucket=BUCKET, Key=f"{prefix}/{key}")
    elsewhere = tmp_path / "other-images"
    elsewhere.mkdir()
    with pytest.raises(SnapshotStoreError, match="needs image file \\$IMAGES/base-abc/.* which s3://.* does not have"):
        _store(s3, tmp_path / "n2", elsewhere).local_dir("snap-d")
    assert not (tmp_path / "n2" / "cache" / "snapshots" / "snap-d").exists()
    with pytest.raises(SnapshotStoreError, match="neither on this node nor in s3://"):
        _store(s3, tmp_path / "n2", images).local_dir("nope")
    with pytest.raises(SnapshotStoreError, match="invalid snapshot id"):
        _store(s3, tmp_path / "n2", images).local_dir("../etc")


# --------------------------------------------------------------------------- delete


def test_delete_keeps_shared_chunks_until_the_last_user_goes(s3, tmp_path):
    client, prefix = s3
    images = _images(tmp_path)
    home = tmp_path / "n1"
    shared, own = os.urandom(CHUNK), os.urandom(CHUNK)
    _capture(home, images, "s1", {0: shared})
    _capture(home, images, "s2", {0: shared, CHUNK: own})
    store = _store(s3, home, images)
    store.commit("s1")
    store.commit("s2")
    other = _store(s3, tmp_path / "n2", images)
    other.local_dir("s2")  # a cached copy on another node

    assert store.delete("s1") is True
    assert not (home / "snapshots" / "s1").exists()
    assert "snapshots/s1/manifest.json" not in _keys(client, prefix)
    assert not [k for k in _keys(client, prefix, "refs/") if k.endswith("/s1")]
    # s2 is whole: every chunk it lists is still there, and it downloads on a fresh node
    doc = json.loads(client.get_object(Bucket=BUCKET, Key=f"{prefix}/snapshots/s2/manifest.json")["Body"].read())
    left = set(_keys(client, prefix, "chunks/"))
    assert {f"chunks/{c[2]}" for f in doc["files"].values() for c in f["chunks"]} <= left
    fresh = _store(s3, tmp_path / "n3", images).local_dir("s2")
    assert (fresh / "memory.ram").read_bytes()[:CHUNK] == shared

    # s2 still runs on the image files both used: they stay, whole
    assert _image_keys(client, prefix) and _image_keys(client, prefix) <= set(_keys(client, prefix))
    assert other.delete("s2") is True  # from another node: its cache entry goes too
    assert not (tmp_path / "n2" / "cache" / "snapshots" / "s2").exists()
    assert _keys(client, prefix) == [], "objects left behind (the image files go with their last user)"
    assert other.delete("s2") is False
    assert store.delete("s1") is False


def test_interrupted_delete_is_finished_by_the_next(s3, tmp_path):
    client, prefix = s3
    images = _images(tmp_path)
    _capture(tmp_path / "n1", images, "s3", {0: os.urandom(CHUNK)})
    store = _store(s3, tmp_path / "n1", images)
    store.commit("s3")
    # a delete that stopped after moving the manifest to the trash
    manifest_key = f"{prefix}/snapshots/s3/manifest.json"
    body = client.get_object(Bucket=BUCKET, Key=manifest_key)["Body"].read()
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/trash/s3.json", Body=body)
    client.delete_object(Bucket=BUCKET, Key=manifest_key)
    assert store.delete("s3") is True
    assert _keys(client, prefix) == []


def test_commit_restores_a_chunk_a_racing_delete_removed(s3, tmp_path):
    """The reference scheme's guarantee: a snapshot committed while another one with
    the same chunk is deleted still has every chunk afterwards."""
    client, prefix = s3
    images = _images(tmp_path)
    home = tmp_path / "n1"
    data = os.urandom(CHUNK)
    _capture(home, images, "old", {0: data})
    _capture(home, images, "new", {0: data})
    store = _store(s3, home, images)
    store.commit("old")
    # "new" has written its markers and seen the chunks present; then "old" is deleted
    store.commit("new")
    store.delete("old")
    doc = json.loads(client.get_object(Bucket=BUCKET, Key=f"{prefix}/snapshots/new/manifest.json")["Body"].read())
    needed = {f"chunks/{c[2]}" for f in doc["files"].values() for c in f["chunks"]}
    assert needed <= set(_keys(client, prefix, "chunks/"))
    # and if a chunk did vanish (a delete in the window), a re-commit puts it back
    victim = sorted(needed)[0]
    client.delete_object(Bucket=BUCKET, Key=f"{prefix}/{victim}")
    assert store.commit("new")["uploaded"] >= 1
    assert needed <= set(_keys(client, prefix, "chunks/"))
    store.delete("new")
    assert _keys(client, prefix) == []


# --------------------------------------------------------------------------- cache


def test_cache_evicts_least_recently_used_but_never_what_a_vm_uses(s3, tmp_path):
    images = _images(tmp_path)
    src_home = tmp_path / "n1"
    src = _store(s3, src_home, images)
    for sid in ("c1", "c2", "c3", "c4"):
        _capture(src_home, images, sid, {i * CHUNK: os.urandom(CHUNK) for i in range(8)})
        src.commit(sid)

    node = tmp_path / "n2"
    probe = _store(s3, node, images, cache_limit_bytes=1 << 40, pin_seconds=0)
    one = probe.local_dir("c1")
    entry_size = sum(os.stat(p).st_blocks * 512 for p in one.iterdir())
    probe.cache.remove("c1")
    # room for two entries (and a bit), not three
    store = _store(s3, node, images, cache_limit_bytes=int(entry_size * 2.5), pin_seconds=0)
    c1 = store.local_dir("c1")
    time.sleep(0.05)
    c2 = store.local_dir("c2")
    # a VM on this node was restored from c1: its state file names c1's files
    vm = node / "sandboxes" / "i-live"
    vm.mkdir(parents=True)
    (vm / "vm.json").write_text(json.dumps({"chain": json.loads((c1 / "manifest.json").read_text())["layers"],
                                            "ram": str(c1 / "memory.ram")}))
    time.sleep(0.05)
    store.local_dir("c3")  # c1 is the least recently used, but in use: c2 goes
    cached = sorted(p.name for p in store.cache.entries())
    assert cached == ["c1", "c3"]
    assert (c1 / "memory.ram").exists() and not c2.exists()

    # a lookup pins an entry for a while (a restore between lookup and its vm.json)
    pinned = _store(s3, node, images, cache_limit_bytes=int(entry_size * 2.5), pin_seconds=3600)
    (pinned.cache.path("c3") / LAST_USED).touch()
    with pytest.raises(SnapshotStoreError, match="cache .* is full"):
        pinned.local_dir("c4")  # c1 is used by a VM, c3 just looked up: no room
    assert not (node / "cache" / "snapshots" / "c4").exists()
    assert not list((node / "cache" / "snapshots").glob(".tmp-c4-*"))

    # once the VM is gone c1 can be evicted, and a delete of a used entry keeps it
    (vm / "vm.json").unlink()
    store.local_dir("c4")
    assert sorted(p.name for p in store.cache.entries()) == ["c3", "c4"]
    for sid in ("c1", "c2", "c3", "c4"):
        src.delete(sid)


def test_delete_keeps_a_cached_copy_a_vm_still_reads(s3, tmp_path):
    images = _images(tmp_path)
    _capture(tmp_path / "n1", images, "u1", b"abc")
    _store(s3, tmp_path / "n1", images).commit("u1")
    node = _store(s3, tmp_path / "n2", images, pin_seconds=0)
    entry = node.local_dir("u1")
    vm = tmp_path / "n2" / "sandboxes" / "i-x"
    vm.mkdir(parents=True)
    (vm / "vm.json").write_text(json.dumps({"ram": str(entry / "memory.ram")}))
    assert node.delete("u1") is True  # the remote objects go
    assert entry.exists(), "a running VM's snapshot files were deleted"
    (vm / "vm.json").unlink()
    assert node.cache.remove("u1") is True and not entry.exists()


# --------------------------------------------------------------------------- configuration


def test_get_store_follows_the_backend_setting(settings, s3_endpoint, tmp_path):
    from agent.stores import PosixFsStore, get_store

    settings.AENV_SNAPSHOT_BACKEND = "posix_fs"
    assert isinstance(get_store(), PosixFsStore)
    settings.AENV_SNAPSHOT_BACKEND = "s3"
    settings.AENV_S3_ENDPOINT, settings.AENV_S3_BUCKET, settings.AENV_S3_REGION = s3_endpoint, BUCKET, "us-east-1"
    settings.AENV_S3_PREFIX, settings.AENV_SNAPSHOT_CACHE_MB = "cfg", 64
    store = get_store()
    assert isinstance(store, S3Store) and store.bucket == BUCKET and store.prefix == "cfg/"
    assert store.cache.limit_bytes == 64 << 20 and get_store() is store
    assert store.cache.root == settings.AENV_HOME / "cache" / "snapshots"
    assert store._get_json(store.manifest_key("absent")) is None  # really talks to the server
    settings.AENV_S3_BUCKET = ""
    with pytest.raises(SnapshotStoreError, match="AENV_S3_BUCKET"):
        get_store()
    settings.AENV_SNAPSHOT_BACKEND = "ftp"
    with pytest.raises(SnapshotStoreError, match="unknown snapshot backend"):
        get_store()


# --------------------------------------------------------------------------- a fork's early hand-off


def test_a_hand_off_puts_a_pending_manifest_that_only_a_told_restore_reads(s3, tmp_path):
    client, prefix = s3
    images = _images(tmp_path)
    home = tmp_path / "n1"
    store = _store(s3, home, images)
    _capture(home, images, "fk", {0: os.urandom(CHUNK), 3 * CHUNK: os.urandom(CHUNK)})
    _capture(home, images, "early", {0: os.urandom(CHUNK)})
    # the image files are not in the store yet: the pending manifest lists their chunks itself
    # (their upload is the commit's), and nothing else is written
    assert store.index("early")["chunks"] > 0
    assert _keys(client, prefix) == ["snapshots/early/pending.json"]
    doc = json.loads(client.get_object(Bucket=BUCKET, Key=f"{prefix}/snapshots/early/pending.json")["Body"].read())
    base = doc["image_files"]["base"]
    assert base["path"] == "$IMAGES/base-abc/rootfs.qcow2" and base["chunks"] and base["size"] > 0
    assert store.delete("early") is True and _keys(client, prefix) == []

    _capture(home, images, "s0", {0: os.urandom(CHUNK)})
    store.commit("s0")  # publishes the image files
    before = set(_keys(client, prefix))
    stats = store.index("fk")
    assert stats["chunks"] > 2 and stats["bytes"] > 2 * CHUNK
    added = set(_keys(client, prefix)) - before
    # the pending manifest and the image files' marks, nothing else: no chunk, no chunk marker
    assert "snapshots/fk/pending.json" in added and "snapshots/fk/manifest.json" not in added
    assert {k for k in added if k != "snapshots/fk/pending.json"} == {
        k for k in added if k.startswith("image-users/") and k.endswith("/fk")} != set()
    pending = json.loads(client.get_object(Bucket=BUCKET, Key=f"{prefix}/snapshots/fk/pending.json")["Body"].read())
    assert all("chunks" not in i for i in pending["image_files"].values())  # in the store: named by digest
    assert pending["pending"] is True and set(pending["files"]) == {"layer-0.qcow2", "layer-1.qcow2", "memory.ram",
                                                                   "device.state"}
    # this node serves its chunks to peers from its own files at once
    own = store.own_files()
    assert own[str(home / "snapshots" / "fk" / "memory.ram")] == pending["files"]["memory.ram"]["chunks"]

    other = _store(s3, tmp_path / "n2", images)  # no lazy restores: it cannot read a pending capture
    with pytest.raises(SnapshotStoreError, match="neither on this node nor"):
        other.local_dir("fk")
    with pytest.raises(SnapshotStoreError, match="still being stored"):
        other.local_dir("fk", pending_wait=5.0)
    assert other._snapshot_doc("fk", pending=True)["pending"] is True

    store.commit("fk")
    keys = _keys(client, prefix)
    assert "snapshots/fk/manifest.json" in keys and "snapshots/fk/pending.json" not in keys
    doc = json.loads(client.get_object(Bucket=BUCKET, Key=f"{prefix}/snapshots/fk/manifest.json")["Body"].read())
    assert doc["files"] == pending["files"] and doc["image_files"] == pending["image_files"]
    assert (other.local_dir("fk", pending_wait=5.0) / "memory.ram").read_bytes() == (
        home / "snapshots" / "fk" / "memory.ram").read_bytes()


def test_a_hand_off_whose_upload_never_ended_is_deleted_whole(s3, tmp_path):
    client, prefix = s3
    images = _images(tmp_path)
    home = tmp_path / "n1"
    store = _store(s3, home, images)
    _capture(home, images, "s0", {0: os.urandom(CHUNK)})
    store.commit("s0")
    kept = _keys(client, prefix)
    _capture(home, images, "fk", {0: os.urandom(CHUNK)})
    assert store.index("fk")["chunks"] > 0
    assert store.delete("fk") is True
    assert _keys(client, prefix) == kept, "the hand-off left objects behind"
    assert store.delete("s0") is True
    assert _keys(client, prefix) == [], "the image files' marks of the hand-off kept them"
