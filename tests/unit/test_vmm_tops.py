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
