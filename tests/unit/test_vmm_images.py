"""Image recipe hashing and cache layout (no debootstrap here)."""

import json

import pytest

from vmm import images, toolsdrive
from vmm.images import GuestImage, ImageNotFound, find_image, stage_hashes


def test_recipe_hash_is_stable():
    assert stage_hashes() == stage_hashes()
    h = stage_hashes()
    assert set(h) == {"debootstrap", "system", "tools", "recipe"}
    assert all(len(v) == 16 for v in h.values())


def test_tools_change_does_not_touch_debootstrap(monkeypatch):
    before = stage_hashes()
    monkeypatch.setattr(toolsdrive, "recipe_inputs", lambda: {"envd": "something else"})
    after = stage_hashes()
    assert after["debootstrap"] == before["debootstrap"] and after["system"] == before["system"]
    assert after["tools"] != before["tools"] and after["recipe"] != before["recipe"]


def test_name_changes_recipe():
    assert stage_hashes("base")["recipe"] != stage_hashes("other")["recipe"]


def test_digest_order_independent():
    assert images.digest({"a": 1, "b": [1, 2]}) == images.digest({"b": [1, 2], "a": 1})


def test_find_image_follows_symlink(tmp_path):
    with pytest.raises(ImageNotFound):
        find_image(tmp_path, "base")
    d = tmp_path / "base-abc"
    d.mkdir()
    (d / "image.json").write_text(json.dumps({"name": "base", "recipe_hash": "abc", "kernel_release": "6.1"}))
    images._point(tmp_path, "base", d)
    img = find_image(tmp_path, "base")
    assert img == GuestImage("base", d / "vmlinuz", d / "initrd.cpio", d / "rootfs.qcow2", d / "tools.img", "abc", "6.1")
    images._point(tmp_path, "base", d)  # idempotent


def test_stage_build_is_atomic(tmp_path):
    def boom(out, work):
        (out / "half").write_text("x")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        images._stage(tmp_path, "tools", "h1", boom, lambda m: None)
    assert not (tmp_path / "stages" / "tools-h1").exists()
    assert not list((tmp_path / "stages").glob(".tmp-*"))
    built = images._stage(tmp_path, "tools", "h1", lambda out, work: (out / "ok").write_text("y"), lambda m: None)
    assert (built / "ok").read_text() == "y"
    assert images._stage(tmp_path, "tools", "h1", boom, lambda m: None) == built  # cached: not rebuilt


def test_cpio_writer(tmp_path):
    import subprocess

    from vmm.rootfs import write_cpio

    tree = tmp_path / "tree"
    (tree / "bin").mkdir(parents=True)
    (tree / "bin" / "tool").write_text("hello")
    (tree / "bin" / "link").symlink_to("tool")
    out = tmp_path / "a.cpio"
    write_cpio(tree, out)
    listing = subprocess.run(["busybox", "cpio", "-t"], stdin=open(out, "rb"), capture_output=True, text=True)
    assert listing.returncode == 0, listing.stderr
    assert set(listing.stdout.split()) == {"bin", "bin/tool", "bin/link"}


def test_unknown_template(tmp_path):
    with pytest.raises(ImageNotFound):
        images.ensure_image(tmp_path, "nope")


def _bzimage(tmp_path, protocol=0x20F, addr_max=0x7FFFFFFF, magic=b"HdrS"):
    data = bytearray(0x400)
    data[0x202:0x206] = magic
    data[0x206:0x208] = protocol.to_bytes(2, "little")
    data[0x22C:0x230] = addr_max.to_bytes(4, "little")
    data[0x300:0x304] = b"body"
    path = tmp_path / "vmlinuz"
    path.write_bytes(bytes(data))
    return path


def test_initrd_addr_max_lowered_below_qemu_10_acpi_page(tmp_path):
    """QEMU 10 microvm put a 2048 MiB guest's initrd over its ACPI page when the kernel allowed
    it up to 0x7fffffff: the image's kernel says 64 KiB lower, and only that field changes."""
    from vmm.rootfs import INITRD_ADDR_MAX, cap_initrd_addr_max
    kernel = _bzimage(tmp_path)
    before = kernel.read_bytes()
    assert cap_initrd_addr_max(kernel)
    after = kernel.read_bytes()
    assert int.from_bytes(after[0x22C:0x230], "little") == INITRD_ADDR_MAX == 0x7FFEFFFF
    assert (INITRD_ADDR_MAX + 1) % (1 << 20) != 0  # no guest RAM size in whole MiB ends there
    assert after[:0x22C] == before[:0x22C] and after[0x230:] == before[0x230:]
    assert not cap_initrd_addr_max(kernel)  # already low enough: untouched
    assert "initrd_addr_max" in images.rootfs_stage.system_inputs()


@pytest.mark.parametrize("kw", [dict(magic=b"MZ\0\0"), dict(protocol=0x202), dict(addr_max=0x37FFFFFF)])
def test_initrd_addr_max_left_alone(tmp_path, kw):
    from vmm.rootfs import cap_initrd_addr_max
    kernel = _bzimage(tmp_path, **kw)
    before = kernel.read_bytes()
    assert not cap_initrd_addr_max(kernel)
    assert kernel.read_bytes() == before
