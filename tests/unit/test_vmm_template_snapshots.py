"""Template snapshot lookup: one dir per image build + VM shape + accelerator + QEMU; misses are None."""
import json
from pathlib import Path

from vmm import template_snapshots
from vmm.images import GuestImage


def _image(tmp_path, recipe="r1"):
    return GuestImage(name="base", kernel=tmp_path / "k", initrd=tmp_path / "i", rootfs=tmp_path / "r.qcow2",
                      tools=tmp_path / "t", recipe_hash=recipe)


def test_key_covers_build_shape_accel_and_qemu(tmp_path, monkeypatch):
    monkeypatch.setattr(template_snapshots, "qemu_version", lambda qemu="q": f"QEMU {qemu}")
    img = _image(tmp_path)
    base = template_snapshots.snapshot_dir(tmp_path, img, 2, 512, 2048, "tcg")
    assert base.is_relative_to(tmp_path / "snapshots" / "base-r1")
    variants = {
        template_snapshots.snapshot_dir(tmp_path, _image(tmp_path, "r2"), 2, 512, 2048, "tcg"),
        template_snapshots.snapshot_dir(tmp_path, img, 1, 512, 2048, "tcg"),
        template_snapshots.snapshot_dir(tmp_path, img, 2, 256, 2048, "tcg"),
        template_snapshots.snapshot_dir(tmp_path, img, 2, 512, 4096, "tcg"),
        template_snapshots.snapshot_dir(tmp_path, img, 2, 512, 2048, "kvm"),
        template_snapshots.snapshot_dir(tmp_path, img, 2, 512, 2048, "tcg", qemu="other-qemu"),
    }
    assert base not in variants and len(variants) == 6
    assert template_snapshots.snapshot_dir(tmp_path, img, 2, 512, 2048, "tcg") == base  # stable


def test_find_needs_a_complete_manifest(tmp_path, monkeypatch):
    monkeypatch.setattr(template_snapshots, "qemu_version", lambda qemu="q": "QEMU x")
    img = _image(tmp_path)
    assert template_snapshots.find(tmp_path, img, 2, 512, 2048, "tcg") is None
    d = template_snapshots.snapshot_dir(tmp_path, img, 2, 512, 2048, "tcg")
    d.mkdir(parents=True)
    (d / "memory.ram").write_bytes(b"")  # an interrupted build: no manifest yet
    assert template_snapshots.find(tmp_path, img, 2, 512, 2048, "tcg") is None
    base = tmp_path / "base.qcow2"
    for f in (base, d / "layer-0.qcow2", d / "device.state", tmp_path / "k"):
        f.write_bytes(b"x")
    (d / "manifest.json").write_text(json.dumps({
        "dir": str(d), "layers": [str(base), str(d / "layer-0.qcow2")], "memory_file": str(d / "memory.ram"),
        "device_state_file": str(d / "device.state"), "cpu_count": 2, "memory_mb": 512, "disk_size_mb": 2048,
        "machine": {"accel": "tcg", "kernel": str(tmp_path / "k")}}))
    found = template_snapshots.find(tmp_path, img, 2, 512, 2048, "tcg")
    assert found is not None and Path(found.dir) == d and found.memory_mb == 512
    # a file it names is gone (e.g. recorded through a path that no longer exists): stale, a miss
    for gone in (base, tmp_path / "k"):
        data = gone.read_bytes()
        gone.unlink()
        assert template_snapshots.find(tmp_path, img, 2, 512, 2048, "tcg") is None
        gone.write_bytes(data)
    assert template_snapshots.find(tmp_path, img, 2, 512, 2048, "tcg") is not None
    assert template_snapshots.find(tmp_path, img, 2, 1024, 2048, "tcg") is None
    (d / "manifest.json").write_text("{not json")
    assert template_snapshots.find(tmp_path, img, 2, 512, 2048, "tcg") is None
