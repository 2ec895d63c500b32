"""Booted templates (vmm.templates): one dir per image build + VM shape + driver fingerprint;
misses are None; and the node's create decides "template hit → restore, else boot"."""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from vmm import templates
from vmm.driver import BootSpec, SnapshotUnusable, VMError
from vmm.images import GuestImage

FP = {"driver": "qemu", "accel": "tcg", "qemu": "QEMU x", "cmdline": "c1"}


class Driver:
    """Just what the cache asks of a driver."""

    def __init__(self, fingerprint=FP, usable=True):
        self.fp, self.usable = fingerprint, usable

    def fingerprint(self):
        if self.fp is None:
            raise VMError("no qemu")
        return dict(self.fp)

    def check_snapshot(self, manifest):
        if not self.usable:
            raise SnapshotUnusable("needs its guest kernel")


def _image(tmp_path, recipe="r1"):
    return GuestImage(name="base", kernel=tmp_path / "k", initrd=tmp_path / "i", rootfs=tmp_path / "r.qcow2",
                      tools=tmp_path / "t", recipe_hash=recipe)


def _built_image(images: Path, recipe="r1") -> GuestImage:
    """A fake image build that find_image() accepts."""
    d = images / f"base-{recipe}"
    d.mkdir(parents=True)
    (d / "image.json").write_text(json.dumps({"name": "base", "recipe_hash": recipe}))
    (images / "base").symlink_to(d.name)
    return GuestImage.from_dir(d)


def test_key_covers_build_shape_and_fingerprint(tmp_path):
    img = _image(tmp_path)
    base = templates.snapshot_dir(tmp_path, img, 2, 512, 2048, FP)
    assert base.is_relative_to(tmp_path / "snapshots" / "base-r1") and base.name.startswith("c2-m512-d2048-tcg-")
    variants = {
        templates.snapshot_dir(tmp_path, _image(tmp_path, "r2"), 2, 512, 2048, FP),
        templates.snapshot_dir(tmp_path, img, 1, 512, 2048, FP),
        templates.snapshot_dir(tmp_path, img, 2, 256, 2048, FP),
        templates.snapshot_dir(tmp_path, img, 2, 512, 4096, FP),
        templates.snapshot_dir(tmp_path, img, 2, 512, 2048, {**FP, "accel": "kvm"}),
        templates.snapshot_dir(tmp_path, img, 2, 512, 2048, {**FP, "qemu": "QEMU y"}),
        templates.snapshot_dir(tmp_path, img, 2, 512, 2048, {**FP, "cmdline": "c2"}),
        templates.snapshot_dir(tmp_path, img, 2, 512, 2048, {"driver": "fake"}),
    }
    assert base not in variants and len(variants) == 8
    assert templates.snapshot_dir(tmp_path, img, 2, 512, 2048, dict(FP)) == base  # stable


def test_find_needs_a_complete_usable_manifest(tmp_path):
    images = tmp_path / "images"
    img = _built_image(images)
    cache, driver, spec = templates.TemplateCache(images), Driver(), BootSpec("s1")
    assert cache.find(driver, spec) is None
    d = cache.dir_for(driver, img, 2, 512, 2048)
    d.mkdir(parents=True)
    (d / "memory.ram").write_bytes(b"")  # an interrupted build: no manifest yet
    assert cache.find(driver, spec) is None
    base = tmp_path / "base.qcow2"
    for f in (base, d / "layer-0.qcow2", d / "device.state"):
        f.write_bytes(b"x")
    (d / "manifest.json").write_text(json.dumps({
        "dir": str(d), "layers": [str(base), str(d / "layer-0.qcow2")], "memory_file": str(d / "memory.ram"),
        "device_state_file": str(d / "device.state"), "cpu_count": 2, "memory_mb": 512, "disk_size_mb": 2048,
        "machine": {"accel": "tcg"}}))
    found = cache.find(driver, spec)
    assert found is not None and Path(found.dir) == d and found.memory_mb == 512
    # one of its files is gone: stale, a miss (rebuilt by the next build)
    (d / "device.state").unlink()
    assert cache.find(driver, spec) is None
    (d / "device.state").write_bytes(b"x")
    assert cache.find(driver, spec) is not None
    assert cache.find(Driver(usable=False), spec) is None  # e.g. its kernel is gone
    assert cache.find(Driver(fingerprint=None), spec) is None  # the driver cannot say what it restores
    assert cache.find(Driver({**FP, "qemu": "QEMU y"}), spec) is None
    assert cache.find(driver, BootSpec("s1", memory_mb=1024)) is None
    assert cache.find(driver, BootSpec("s1", image="other")) is None  # not built: boot() reports it
    assert cache.find(driver, BootSpec("s1", layers=[str(base)])) is None  # a disk snapshot boots
    (d / "manifest.json").write_text("{not json")
    assert cache.find(driver, spec) is None


class NodeDriver:
    """Records what the node's create asked for."""

    def __init__(self, restore_fails=False):
        self.calls, self.restore_fails = [], restore_fails

    def restore(self, manifest, spec, template=False, source_stays=False):
        assert source_stays  # the node's own booted template stays while its sandboxes run
        self.calls.append(("restore", spec.sandbox_id, template))
        if self.restore_fails:
            raise VMError("device state damaged")
        return SimpleNamespace(sandbox_id=spec.sandbox_id, timings={"total_ms": 1.0})

    def boot(self, spec):
        self.calls.append(("boot", spec.sandbox_id))
        return SimpleNamespace(sandbox_id=spec.sandbox_id, timings={"total_ms": 2.0})


@pytest.mark.parametrize("hit, fails, calls, flag", [
    (True, False, [("restore", "s1", True)], 1),
    (False, False, [("boot", "s1")], 0),
    (True, True, [("restore", "s1", True), ("boot", "s1")], 0),
])
def test_node_create_restores_a_template_hit_else_boots(monkeypatch, hit, fails, calls, flag):
    from agent import tasks

    cache = SimpleNamespace(find=lambda driver, spec: object() if hit else None)
    monkeypatch.setattr(tasks, "get_templates", lambda: cache)
    driver = NodeDriver(restore_fails=fails)
    info = tasks._start_vm(driver, BootSpec("s1"))
    assert driver.calls == calls and info.timings["from_template_snapshot"] == flag
