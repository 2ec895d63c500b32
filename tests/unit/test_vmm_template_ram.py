"""AENV_TEMPLATE_RAM: a create from a booted template copies the template's RAM into a file of
its own ("copy": cheap later pauses), maps it copy-on-write ("shared": denser), or ("auto", the
default) copies it unless it is still arriving on this node (then maps it: the driver decides,
told whether the snapshot stays)."""

import pytest

from vmm.errors import VMError
from vmm.qemu import snapshots


class RecordingDriver(snapshots.SnapshotMixin):
    def __init__(self, way):
        self.template_ram = way
        self.calls = []

    def _restore(self, manifest, spec, capture_ref, own_ram=False, source_stays=False):
        self.calls.append((capture_ref, own_ram, source_stays))
        return "info"


@pytest.mark.parametrize("way,template,own_ram", [
    ("auto", True, True), ("copy", True, True), ("shared", True, False),
    ("auto", False, False), ("copy", False, False), ("shared", False, False),  # a user's snapshot: copy-on-write
])
@pytest.mark.parametrize("stays", [True, False])
def test_template_ram_way(way, template, own_ram, stays):
    d = RecordingDriver(way)
    assert d.restore("manifest", "spec", template=template, source_stays=stays) == "info"
    assert d.calls == [("", own_ram, stays)]


def test_an_unknown_way_is_refused_before_anything_starts():
    d = RecordingDriver("lazy")
    with pytest.raises(VMError, match="AENV_TEMPLATE_RAM"):
        d.restore("manifest", "spec", template=True)
    assert d.calls == []


def test_a_driver_with_an_unknown_way_does_not_start(monkeypatch, tmp_path):
    """Refused when the node's driver is made, not per create (a refused template restore
    would fall back to a cold boot, hiding the mistake behind slow creates)."""
    from vmm.qemu.driver import QemuDriver

    monkeypatch.setattr(QemuDriver, "template_ram", "lazy")
    with pytest.raises(VMError, match="AENV_TEMPLATE_RAM='lazy'"):
        QemuDriver(tmp_path / "home", tmp_path / "images")
