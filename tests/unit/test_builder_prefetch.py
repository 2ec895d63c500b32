"""A template build records its snapshot's prefetch list (agent.builder.build, issue 24): with a
store that can (``S3Store.record_prefetch``, tested on a real chunkfs mount in
test_lazy_restore), the build's VM goes, one VM is restored from the recording mount under a
build VM's id with its RAM mapped, /init'ed as a create's, and killed after; a failure is
logged in the build's log and never fails the build."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from agent.builder.build import BUILD_VM_PREFIX, Build, Node, Outcome, Request, recording_vm_id

BUILD_ID = "5b0c1a52-6c1e-4a4e-9d8e-0a1b2c3d4e5f"


class Driver:
    def __init__(self, fail: Exception | None = None):
        self.calls, self.fail = [], fail

    def restore(self, manifest, spec, template=False, source_stays=False):
        self.calls.append(("restore", manifest.dir, spec.sandbox_id, template))
        if self.fail is not None:
            raise self.fail
        return SimpleNamespace(envd_host="10.9.0.2", envd_port=49983)

    def kill(self, vm_id):
        self.calls.append(("kill", vm_id))
        return True


class Store:
    """Records as S3Store.record_prefetch does: the restore runs on the mounted dir, the
    list is what was read meanwhile."""

    def __init__(self, snapshot_dir: Path):
        self.dir, self.inside = snapshot_dir, None

    def record_prefetch(self, snapshot_id, restore):
        with restore(self.dir) as info:
            self.inside = (snapshot_id, info.envd_host)
        return 42


class Log:
    def __init__(self):
        self.lines = []

    def info(self, message, step=""):
        self.lines.append((step, message))


def _build(tmp_path, driver, store) -> Build:
    node = Node(node_id="n1", driver=driver, store=store, files=None, images_dir=tmp_path, cache=None)
    return Build(node, Request(BUILD_ID, "tpl", {"team_id": "t"}, 2, 512, 2048), Log())


@pytest.fixture
def snapshot_dir(tmp_path):
    from vmm.driver import SnapshotManifest

    d = tmp_path / "lazy" / "snap1"
    d.mkdir(parents=True)
    manifest = SnapshotManifest(dir=str(d), layers=[str(d / "layer-0.qcow2")], memory_file=str(d / "memory.ram"),
                                device_state_file=str(d / "device.state"), cpu_count=2, memory_mb=512,
                                disk_size_mb=2048, machine={})
    manifest.save()
    return d


def test_the_build_records_the_prefetch_list_with_a_restored_vm(tmp_path, snapshot_dir, monkeypatch):
    inits = []
    monkeypatch.setattr("agent.guest.init_envd", lambda host, port, env, token: inits.append((host, port, env, token)))
    driver, store = Driver(), Store(snapshot_dir)
    build = _build(tmp_path, driver, store)
    outcome = Outcome(snapshot_id="snap1", manifest={}, size_bytes=1, image="base")
    build._record_prefetch(outcome)
    vm = recording_vm_id(BUILD_ID)
    assert vm.startswith(BUILD_VM_PREFIX) and vm != build.vm_id  # a node restart kills it with the build VMs
    assert driver.calls == [("restore", snapshot_dir, vm, False), ("kill", vm)]  # RAM mapped, not copied
    assert inits == [("10.9.0.2", 49983, {}, None)] and store.inside == ("snap1", "10.9.0.2")
    assert outcome.details["prefetch_chunks"] == 42 and "prefetch_s" in build.timings
    assert any("prefetch list: 42 chunks" in line for _, line in build.log.lines)


def test_a_failing_recording_never_fails_the_build_and_leaves_no_vm(tmp_path, snapshot_dir, monkeypatch):
    monkeypatch.setattr("agent.guest.init_envd", lambda *a: None)
    from vmm.driver import VMError

    driver = Driver(fail=VMError("the guest did not answer"))
    build = _build(tmp_path, driver, Store(snapshot_dir))
    outcome = Outcome(snapshot_id="snap1", manifest={}, size_bytes=1, image="base")
    build._record_prefetch(outcome)  # no exception
    vm = recording_vm_id(BUILD_ID)
    assert driver.calls[-1] == ("kill", vm) and "prefetch_chunks" not in outcome.details
    assert any("no prefetch list recorded: the guest did not answer" in line for _, line in build.log.lines)
    # a store that cannot record (posix_fs): nothing at all, no VM
    plain = Driver()
    _build(tmp_path, plain, object())._record_prefetch(outcome)
    assert plain.calls == []
