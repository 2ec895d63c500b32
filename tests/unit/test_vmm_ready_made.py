"""What a restore from a booted template finds made ahead, without QEMU: the pristine empty
overlay copied as a sandbox's disk top (vmm.qemu.tops) and the RAM file made for the next
create of a template (vmm.qemu.warm_ram)."""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vmm.qemu import tops
from vmm.qemu.warm_ram import WarmRamCopies

MiB = 1 << 20
needs_qemu_img = pytest.mark.skipif(shutil.which("qemu-img") is None, reason="qemu-img not installed")


def qemu_img_info(path: Path) -> dict:
    out = subprocess.run(["qemu-img", "info", "-U", "--output=json", str(path)], capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out)


@needs_qemu_img
def test_top_is_an_empty_overlay_of_the_backing_file_and_size(tmp_path):
    base = tmp_path / "base.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(base), "64M"], check=True)
    cache = tmp_path / "tops"
    for i, size in enumerate((128, 128, 256)):
        dest = tmp_path / f"top{i}.qcow2"
        tops.create_top(cache, base, size, dest)
        info = qemu_img_info(dest)
        assert info["format"] == "qcow2"
        assert info["virtual-size"] == size * MiB
        assert info["full-backing-filename"] == str(base)
    assert len(list(cache.glob("*.qcow2"))) == 2  # one pristine overlay per (backing, size)
    assert (tmp_path / "top0.qcow2").read_bytes() == (tmp_path / "top1.qcow2").read_bytes()


@needs_qemu_img
def test_a_rebuilt_backing_file_gets_a_new_pristine_overlay(tmp_path):
    base = tmp_path / "base.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(base), "64M"], check=True)
    cache = tmp_path / "tops"
    tops.create_top(cache, base, 128, tmp_path / "a.qcow2")
    base.unlink()  # the layer rebuilt: same path, new file (a new inode, maybe a new size)
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(base), "96M"], check=True)
    tops.create_top(cache, base, 128, tmp_path / "b.qcow2")
    assert len(list(cache.glob("*.qcow2"))) == 2
    assert qemu_img_info(tmp_path / "b.qcow2")["full-backing-filename"] == str(base)


def test_prune_keeps_the_most_recently_used(tmp_path):
    for i in range(5):
        f = tmp_path / f"{i}.qcow2"
        f.write_bytes(b"x")
        os.utime(f, (1000 + i, 1000 + i))
    assert tops.prune(tmp_path, keep=2) == 3
    assert sorted(p.name for p in tmp_path.glob("*.qcow2")) == ["3.qcow2", "4.qcow2"]


def snapshot_ram(path: Path, size=8 * MiB) -> Path:
    with open(path, "wb") as f:  # data at two places, holes between
        f.truncate(size)
        f.seek(MiB)
        f.write(b"\x5a" * MiB)
        f.seek(6 * MiB)
        f.write(os.urandom(MiB))
    return path


def test_a_create_takes_the_copy_made_for_it_and_the_next_one_is_made(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    src = snapshot_ram(tmp_path / "memory.ram")
    warm = WarmRamCopies(shm, tag="t", per_source=1, headroom_mb=0)
    assert not warm.take(src, shm / "first.ram")  # nothing made yet: the caller copies itself
    warm.wait_idle()
    assert warm.ready_count() == 0  # nothing is made while the caller's VM starts
    warm.refill_later(src)  # its VM answers
    warm.wait_idle()
    assert warm.ready_count() == 1
    assert warm.take(src, shm / "second.ram")
    assert (shm / "second.ram").read_bytes() == src.read_bytes()
    assert os.stat(shm / "second.ram").st_blocks * 512 < 4 * MiB  # holes stayed holes
    warm.refill_later(src)
    warm.wait_idle()
    assert warm.ready_count() == 1  # made again for the next create
    assert len(list(shm.glob("aenv-warm-t-*.ram"))) == 1


def test_a_copy_of_a_lazily_filled_snapshot_skips_its_zeros(tmp_path, monkeypatch):
    """A lazy (FUSE) file reports no holes: the copy reads it in parallel and leaves zeros out."""
    from vmm.qemu import ramfile

    shm = tmp_path / "shm"
    shm.mkdir()
    src = snapshot_ram(tmp_path / "memory.ram")
    with open(src, "r+b") as f:  # written zeros: data to SEEK_DATA, as a FUSE file is all data
        f.seek(3 * MiB)
        f.write(bytes(2 * MiB))
    used = []
    monkeypatch.setattr(ramfile, "on_fuse", lambda path: True)
    monkeypatch.setattr(ramfile, "copy_sparse_into", lambda *a: used.append(a))
    warm = WarmRamCopies(shm, tag="z", per_source=1, headroom_mb=0)
    warm.prepare(src)
    warm.wait_idle()
    assert warm.take(src, shm / "first.ram") and not used
    assert (shm / "first.ram").read_bytes() == src.read_bytes()
    assert os.stat(shm / "first.ram").st_blocks * 512 <= 2 * MiB + (64 << 10)  # the two data MiBs only


def test_a_changed_source_never_hands_out_a_stale_copy(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    src = snapshot_ram(tmp_path / "memory.ram")
    warm = WarmRamCopies(shm, tag="t", per_source=1, headroom_mb=0)
    warm.take(src, shm / "a.ram")
    warm.refill_later(src)
    warm.wait_idle()
    time.sleep(0.01)
    src.unlink()
    snapshot_ram(src)  # the template rebuilt: new contents at the same path
    assert not warm.take(src, shm / "b.ram")
    warm.refill_later(src)
    warm.wait_idle()
    assert warm.take(src, shm / "c.ram")
    assert (shm / "c.ram").read_bytes() == src.read_bytes()
    warm.refill_later(src)
    warm.wait_idle()
    assert len(list(shm.glob("aenv-warm-t-*.ram"))) == 1  # the stale copy was removed


def test_copies_give_way_to_guests(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    src = snapshot_ram(tmp_path / "memory.ram")
    free_mb = shutil.disk_usage(shm).free >> 20
    crowded = WarmRamCopies(shm, tag="c", per_source=1, headroom_mb=free_mb)  # no room beyond the headroom
    crowded.take(src, shm / "x.ram")
    crowded.refill_later(src)
    crowded.wait_idle()
    assert crowded.ready_count() == 0
    warm = WarmRamCopies(shm, tag="w", per_source=1, headroom_mb=0)
    warm.take(src, shm / "y.ram")
    warm.refill_later(src)
    warm.wait_idle()
    assert warm.ready_count() == 1
    assert warm.drop_all() > 0
    assert warm.ready_count() == 0 and not list(shm.glob("aenv-warm-w-*.ram"))


def test_only_the_most_recent_templates_keep_copies_and_leftovers_go(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    srcs = [snapshot_ram(tmp_path / f"m{i}.ram") for i in range(3)]
    warm = WarmRamCopies(shm, tag="t", per_source=1, max_sources=2, headroom_mb=0)
    for src in srcs:
        warm.take(src, shm / f"{src.stem}-used.ram")
        warm.refill_later(src)
        warm.wait_idle()
    assert warm.ready_count() == 2
    (shm / "aenv-warm-t-999999999-dead.ram").write_bytes(b"x")  # a process that is gone
    (shm / "aenv-warm-other-999999999-dead.ram").write_bytes(b"x")  # … of another home
    mine = sorted(shm.glob(f"aenv-warm-t-{os.getpid()}-*.ram"))
    WarmRamCopies(shm, tag="u", per_source=1)
    assert not list(shm.glob("aenv-warm-*-999999999-*.ram"))
    assert sorted(shm.glob(f"aenv-warm-t-{os.getpid()}-*.ram")) == mine  # a live instance's stay


def test_disabled_makes_nothing(tmp_path):
    src = snapshot_ram(tmp_path / "memory.ram")
    warm = WarmRamCopies(tmp_path, tag="t", per_source=0)
    assert not warm.take(src, tmp_path / "a.ram")
    warm.wait_idle()
    assert warm.ready_count() == 0


def test_a_stopping_worker_leaves_no_copies(tmp_path):
    """The atexit hook, in a process of its own: its copies are gone when it exits."""
    shm = tmp_path / "shm"
    shm.mkdir()
    src = snapshot_ram(tmp_path / "memory.ram")
    code = (f"from pathlib import Path; from vmm.qemu.warm_ram import WarmRamCopies; "
            f"w = WarmRamCopies(Path({str(shm)!r}), tag='x', headroom_mb=0); "
            f"w.take(Path({str(src)!r}), Path({str(shm / 'taken.ram')!r})); w.refill_later(Path({str(src)!r})); "
            f"w.wait_idle(); assert w.ready_count() == 1")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])
    assert not list(shm.glob("aenv-warm-*.ram"))


def test_prepare_makes_a_copy_before_the_first_restore(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    src = snapshot_ram(tmp_path / "memory.ram")
    warm = WarmRamCopies(shm, tag="p", per_source=1, headroom_mb=0)
    warm.prepare(src)  # a node starting: its default template
    warm.wait_idle()
    assert warm.ready_count() == 1
    assert warm.take(src, shm / "first.ram")  # the node's first create finds it
    assert (shm / "first.ram").read_bytes() == src.read_bytes()
