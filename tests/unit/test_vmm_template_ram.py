"""AENV_TEMPLATE_RAM: a create from a booted template copies the template's RAM into a file of
its own ("copy", the default: cheap later pauses) or maps it copy-on-write ("shared": denser)."""

import pytest

from vmm.errors import VMError
from vmm.qemu import snapshots


class RecordingDriver(snapshots.SnapshotMixin):
    def __init__(self, way):
        self.template_ram = way
        self.calls = []

    def _restore(self, manifest, spec, capture_ref, own_ram=False):
        self.calls.append((capture_ref, own_ram))
        return "info"


@pytest.mark.parametrize("way,template,own_ram", [
    ("copy", True, True), ("shared", True, False),
    ("copy", False, False), ("shared", False, False),  # a user's snapshot is copy-on-write either way
])
def test_template_ram_way(way, template, own_ram):
    d = RecordingDriver(way)
    assert d.restore("manifest", "spec", template=template) == "info"
    assert d.calls == [("", own_ram)]


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
