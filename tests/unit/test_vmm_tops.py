"""vmm.qemu.tops: a sandbox's empty disk top over its layer chain, made without opening that
chain (its headers are the VM's to read; read here they cost a lazily filled layer a fetch on
the create's path, issue 24), then copied from the pristine one for every later sandbox."""
import json
import subprocess

from vmm.qemu.tops import create_top


def _info(path) -> dict:
    return json.loads(subprocess.run(["qemu-img", "info", "--output=json", "-U", str(path)], check=True,
                                     capture_output=True, text=True).stdout)


def test_the_top_is_made_without_reading_its_backing(tmp_path):
    backing = tmp_path / "layer.qcow2"
    backing.write_bytes(b"not a qcow2 image: reading it would fail" * 100)
    first, second = tmp_path / "a.qcow2", tmp_path / "b.qcow2"
    create_top(tmp_path / "tops", backing, 2048, first)
    create_top(tmp_path / "tops", backing, 2048, second)  # the pristine copy this time
    for top in (first, second):
        info = _info(top)
        assert info["format"] == "qcow2" and info["virtual-size"] == 2048 << 20
        assert info["backing-filename"] == str(backing) and info["backing-filename-format"] == "qcow2"
    assert first.read_bytes() == second.read_bytes()
    assert len(list((tmp_path / "tops").glob("*.qcow2"))) == 1


def test_a_drafted_top_is_what_the_first_create_over_an_arriving_layer_copies(tmp_path, monkeypatch):
    """``draft`` while the layer is still elsewhere (a snapshot being installed), ``adopt`` with
    its stat once it is as it will be there: the first create runs no qemu-img of its own."""
    import os

    from vmm.qemu import tops

    staging, final = tmp_path / "staging", tmp_path / "final"
    staging.mkdir()
    (staging / "layer.qcow2").write_bytes(b"x" * 4096)
    drafted = tops.draft(tmp_path / "tops", final / "layer.qcow2", 1024)
    tops.adopt(tmp_path / "tops", drafted, final / "layer.qcow2", 1024, os.stat(staging / "layer.qcow2"))
    assert not drafted.exists()
    os.rename(staging, final)
    monkeypatch.setattr(tops, "run", lambda *a, **kw: (_ for _ in ()).throw(AssertionError("qemu-img ran")))
    tops.create_top(tmp_path / "tops", final / "layer.qcow2", 1024, tmp_path / "top.qcow2")
    info = _info(tmp_path / "top.qcow2")
    assert info["backing-filename"] == str(final / "layer.qcow2") and info["virtual-size"] == 1024 << 20
    # a layer that changed since (another size or mtime) gets a top of its own
    (final / "layer.qcow2").write_bytes(b"y" * 8192)
    monkeypatch.undo()
    tops.create_top(tmp_path / "tops", final / "layer.qcow2", 1024, tmp_path / "top2.qcow2")
    assert len(list((tmp_path / "tops").glob("*.qcow2"))) == 2
