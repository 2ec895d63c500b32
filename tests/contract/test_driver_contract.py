"""The driver contract (vmm.driver.VMDriver), one suite for every driver: the in-memory fake and
the real QEMU driver (real microVMs: marked ``vm``).

Why one suite: code above the drivers (node tasks, reconcile, the snapshot stores, the template
cache) is unit-tested on the fake, so the fake must behave like QEMU; a future driver
(Firecracker) adds itself to DRIVERS and passes the same checks.

Cost: one booted parent per driver for the whole module (a TCG cold boot is ~6-10 s), plus one
restore and two fork children; the tests run in file order and leave the parent as the next one
expects it. A guest is reached through a ``Guest`` adapter (files via envd for QEMU, the fake's
dicts for the fake).

A VM's envd endpoint is the pair (envd_host, envd_port), never the port alone: QEMU's netns
backend gives every VM envd's own port on an address of its own (a slot), which a pause to
disk gives back and the resume replaces; slirp gives 127.0.0.1 and a port of its own. Tests
read the parent's current VMInfo (``now``) rather than the one its boot returned.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from vmm.driver import (BootSpec, NetworkSpec, SnapshotManifest, SnapshotUnusable, UnsupportedNetworkPolicy, VMError,
                        VMInfo, VMNotFound, VMStatus, get_driver)

PARENT = "ct-parent"


def endpoint(info: VMInfo) -> tuple[str, int]:
    """Where the VM's envd answers."""
    return info.envd_host, info.envd_port


def now(env) -> VMInfo:
    """The parent as the driver reports it now (its endpoint may have moved since its boot)."""
    info = env.driver.info(PARENT)
    assert info is not None
    return info


class FakeFiles:
    """Files of a fake guest: its disk dict."""

    def __init__(self, driver):
        self.driver = driver

    def write(self, info: VMInfo, path: str, text: str) -> None:
        self.driver.guest(info.sandbox_id).disk[path] = text

    def read(self, info: VMInfo, path: str) -> str | None:
        return self.driver.guest(info.sandbox_id).disk.get(path)


class EnvdFiles:
    """Files of a real guest, through its envd (the official SDK in debug mode)."""

    def write(self, info: VMInfo, path: str, text: str) -> None:
        from tests.vmm.test_lifecycle_vm import sh  # noqa: PLC0415

        sh(info, f"echo {text} > {path} && sync")

    def read(self, info: VMInfo, path: str) -> str | None:
        from tests.vmm.test_lifecycle_vm import sh  # noqa: PLC0415

        out = sh(info, f"cat {path} 2>/dev/null || echo '<missing>'").strip()
        return None if out == "<missing>" else out


@dataclass
class Env:
    name: str
    driver: object
    files: object
    images_dir: Path


@contextlib.contextmanager
def _fake(home: Path):
    yield Env("fake", (d := get_driver("fake", home, home / "images")), FakeFiles(d), home / "images")


@contextlib.contextmanager
def _qemu(home: Path):
    from tests.vmm.test_lifecycle_vm import real_driver  # noqa: PLC0415 - skips without QEMU / images
    from tests.vmm.test_qemu_vm import IMAGES_DIR  # noqa: PLC0415

    with real_driver(home) as d:
        yield Env("qemu", d, EnvdFiles(), IMAGES_DIR)


DRIVERS = {"fake": _fake, "qemu": _qemu}


# The tests take one parent VM through its life in order: with pytest-xdist they all run on
# one worker (scripts/test.sh passes --dist loadgroup), or a worker could get a later test alone.
pytestmark = pytest.mark.xdist_group("driver-contract")


@pytest.fixture(scope="module", params=["fake", pytest.param("qemu", marks=pytest.mark.vm)])
def env(request, tmp_path_factory):
    with DRIVERS[request.param](tmp_path_factory.mktemp(request.param) / "home") as e:
        yield e


@pytest.fixture(scope="module")
def parent(env):
    """One booted VM per driver for the module (the tests below take it through its life)."""
    info = env.driver.boot(BootSpec(PARENT, cpu_count=1, memory_mb=256, disk_size_mb=2048))
    yield info
    env.driver.kill(PARENT)


def test_boot_is_running_in_info_list_and_inspect(env, parent):
    d = env.driver
    assert parent.sandbox_id == PARENT and parent.status is VMStatus.RUNNING and parent.pid > 0
    assert parent.envd_host and parent.envd_port > 0 and parent.accel == d.accel
    assert endpoint(d.info(PARENT)) == endpoint(parent)
    assert d.info(PARENT).status is VMStatus.RUNNING
    assert [v.sandbox_id for v in d.list()] == [PARENT]
    seen = d.inspect(PARENT)
    assert seen.status is VMStatus.RUNNING and seen.pid == parent.pid
    assert PARENT in d.sandbox_ids() and d.stray() == []
    assert set(d.capacity()) >= {"vcpus", "memory_mb"}
    with pytest.raises(VMError, match="already exists"):
        d.boot(BootSpec(PARENT, cpu_count=1, memory_mb=256))
    env.files.write(parent, "/home/user/ct.txt", "booted")


def test_pause_and_resume_in_memory(env, parent):
    d = env.driver
    before = now(env)
    assert isinstance(d.pause(PARENT), dict)
    assert d.inspect(PARENT).status is VMStatus.PAUSED and d.info(PARENT).status is VMStatus.PAUSED
    assert endpoint(d.info(PARENT)) == endpoint(before)  # paused in memory: it keeps its network
    d.pause(PARENT)  # again: not an error
    info = d.resume(PARENT)
    assert info.status is VMStatus.RUNNING and d.inspect(PARENT).status is VMStatus.RUNNING
    assert info.pid == before.pid and endpoint(info) == endpoint(before)  # the same process, same endpoint
    assert env.files.read(info, "/home/user/ct.txt") == "booted"
    assert d.resume(PARENT).status is VMStatus.RUNNING  # resume of a running VM: not an error


def test_pause_to_disk_is_saved_and_resume_brings_it_back(env, parent):
    d = env.driver
    d.pause_to_disk(PARENT)
    seen = d.inspect(PARENT)
    assert seen.status is VMStatus.SAVED and seen.memory and seen.pid == 0
    assert d.info(PARENT).status is VMStatus.SAVED and d.info(PARENT).pid == 0
    assert [v.sandbox_id for v in d.list()] == [PARENT] and d.stray() == []
    assert d.pause_to_disk(PARENT) == {}  # already saved that way
    info = d.resume(PARENT)
    # Its endpoint may have moved (netns: a fresh slot): the driver reports the one the resume
    # returned, and the guest answers there.
    assert info.status is VMStatus.RUNNING and info.pid > 0 and endpoint(now(env)) == endpoint(info)
    assert d.inspect(PARENT).status is VMStatus.RUNNING
    assert env.files.read(info, "/home/user/ct.txt") == "booted"


def test_verbs_a_saved_vm_does_not_allow(env, parent, tmp_path):
    d = env.driver
    d.pause_to_disk(PARENT)
    with pytest.raises(VMError):
        d.pause(PARENT)
    with pytest.raises(VMError):
        d.snapshot(PARENT, tmp_path / "not-taken")
    with pytest.raises(VMError):
        d.fork(PARENT, 1)
    with pytest.raises(VMError):
        d.pause_to_disk(PARENT, memory=False)  # saved with its memory: resume first
    assert d.inspect(PARENT).status is VMStatus.SAVED
    info = d.resume(PARENT)
    assert info.status is VMStatus.RUNNING and endpoint(now(env)) == endpoint(info)
    assert env.files.read(info, "/home/user/ct.txt") == "booted"


def test_a_saved_vm_exports_a_snapshot_that_continues_it_elsewhere(env, parent, tmp_path):
    """How a paused sandbox moves to another node: its saved state as a self-contained snapshot."""
    d = env.driver
    with pytest.raises(VMError):
        d.export_saved(PARENT, tmp_path / "running")  # only a VM saved with its memory
    env.files.write(now(env), "/home/user/moved.txt", "before-move")
    d.pause_to_disk(PARENT)
    manifest = d.export_saved(PARENT, tmp_path / "moved")
    dest = tmp_path / "moved"
    assert manifest.memory_file and manifest.device_state_file
    assert all(Path(f).parent == dest for f in [*manifest.layers, manifest.memory_file, manifest.device_state_file])
    assert d.inspect(PARENT).status is VMStatus.SAVED  # the VM is unchanged
    moved = d.restore(manifest, BootSpec("ct-moved"), template=True)
    try:
        assert moved.status is VMStatus.RUNNING
        assert env.files.read(moved, "/home/user/moved.txt") == "before-move"
    finally:
        assert d.kill("ct-moved")
    d.resume(PARENT)
    assert env.files.read(now(env), "/home/user/moved.txt") == "before-move"


def test_seal_layer_stacks_disk_states_a_boot_starts_from(env, parent, tmp_path):
    """The template builder's verb: one layer per step, a later VM booted on the chain."""
    d = env.driver
    info = now(env)
    env.files.write(info, "/home/user/seal.txt", "one")
    first = d.seal_layer(PARENT, tmp_path / "l1")
    assert first.path == str(tmp_path / "l1") and Path(first.path).is_file() and first.layers[-1] == first.path
    assert first.size_bytes > 0
    env.files.write(info, "/home/user/seal.txt", "two")
    second = d.seal_layer(PARENT, tmp_path / "l2")
    assert second.layers == [*first.layers, second.path]
    with pytest.raises(VMError, match="exists"):
        d.seal_layer(PARENT, tmp_path / "l2")
    assert d.inspect(PARENT).status is VMStatus.RUNNING
    env.files.write(info, "/home/user/seal.txt", "three")  # after the seal: in no layer
    child = d.boot(BootSpec("ct-sealed", cpu_count=1, memory_mb=256, disk_size_mb=2048, layers=second.layers))
    try:
        assert env.files.read(child, "/home/user/seal.txt") == "two"
        env.files.write(child, "/home/user/seal.txt", "child")
    finally:
        assert d.kill("ct-sealed")
    assert Path(first.path).is_file() and Path(second.path).is_file()  # the caller's files: kill leaves them
    assert env.files.read(info, "/home/user/seal.txt") == "three"
    with pytest.raises(VMNotFound):
        d.seal_layer("ct-nobody", tmp_path / "l9")


def test_snapshot_and_restore(env, parent, tmp_path):
    d = env.driver
    parent = now(env)  # as it is now: the pause to disk above may have moved its endpoint
    manifest = d.snapshot(PARENT, tmp_path / "snap")
    assert (tmp_path / "snap" / "manifest.json").is_file() and manifest.fingerprint == d.fingerprint()
    assert SnapshotManifest.load(tmp_path / "snap") == manifest
    assert d.inspect(PARENT).status is VMStatus.RUNNING  # the source keeps running
    env.files.write(parent, "/home/user/ct.txt", "after-snapshot")
    child = d.restore(manifest, BootSpec("ct-restored"))
    try:
        assert child.status is VMStatus.RUNNING and d.inspect("ct-restored").status is VMStatus.RUNNING
        assert endpoint(child) != endpoint(parent) and endpoint(now(env)) == endpoint(parent)
        assert env.files.read(child, "/home/user/ct.txt") == "booted"  # the snapshot's state
        assert {str(tmp_path / "snap")} & {str(Path(f).parent) for f in d.files_in_use()}
        mine = d.files_in_use("ct-restored")  # one VM's own (the node's VM watch)
        assert {str(tmp_path / "snap")} & {str(Path(f).parent) for f in mine} and mine <= d.files_in_use()
        assert d.disk_errors("ct-restored") == 0 and d.disk_errors("ct-nobody") == 0
        with pytest.raises(VMError, match="already exists"):
            d.restore(manifest, BootSpec("ct-restored"))
    finally:
        assert d.kill("ct-restored")
    assert d.inspect("ct-restored").status is VMStatus.UNKNOWN
    assert env.files.read(parent, "/home/user/ct.txt") == "after-snapshot"
    foreign = replace(manifest, fingerprint={**manifest.fingerprint, "driver": "elsewhere"})
    with pytest.raises(SnapshotUnusable):
        d.restore(foreign, BootSpec("ct-foreign"))
    assert d.inspect("ct-foreign").status is VMStatus.UNKNOWN


def test_fork_gives_independent_children(env, parent, tmp_path):
    d = env.driver
    parent = now(env)  # as it is now: the pause to disk above may have moved its endpoint
    children = d.fork(PARENT, 2, ["ct-child-a", "ct-child-b"])
    try:
        assert [c.sandbox_id for c in children] == ["ct-child-a", "ct-child-b"]
        assert all(isinstance(c, VMInfo) and c.status is VMStatus.RUNNING for c in children)
        assert len({endpoint(c) for c in children} | {endpoint(parent)}) == 3  # an endpoint each
        assert d.inspect(PARENT).status is VMStatus.RUNNING  # the parent keeps its id and runs
        assert endpoint(now(env)) == endpoint(parent)  # and its endpoint
        a, b = children
        assert env.files.read(a, "/home/user/ct.txt") == env.files.read(b, "/home/user/ct.txt") == "after-snapshot"
        env.files.write(a, "/home/user/ct.txt", "only-a")
        assert env.files.read(b, "/home/user/ct.txt") == "after-snapshot"
        assert env.files.read(parent, "/home/user/ct.txt") == "after-snapshot"
        assert env.files.read(a, "/home/user/ct.txt") == "only-a"
    finally:
        for c in children:
            if isinstance(c, VMInfo):
                d.kill(c.sandbox_id)
    assert d.stray() == []  # the capture went with its last child
    with pytest.raises(VMError, match="cannot be sealed"):  # snapshots changed its disk chain
        d.seal_layer(PARENT, tmp_path / "never-sealed")


def test_a_snapshot_with_its_base_holds_every_layer_itself(env, parent, tmp_path):
    d = env.driver
    dest = tmp_path / "based"
    manifest = d.snapshot(PARENT, dest, with_base=True)
    assert manifest.layers and all(Path(layer).parent == dest for layer in manifest.layers)
    child = d.restore(manifest, BootSpec("ct-based"))
    try:
        assert env.files.read(child, "/home/user/ct.txt") == "after-snapshot"
    finally:
        assert d.kill("ct-based")


def test_verbs_on_unknown_ids(env, tmp_path):
    d = env.driver
    for verb in (d.pause, d.pause_to_disk, d.resume):
        with pytest.raises(VMNotFound):
            verb("ct-nobody")
    with pytest.raises(VMNotFound):
        d.snapshot("ct-nobody", tmp_path / "s")
    with pytest.raises(VMNotFound):
        d.fork("ct-nobody", 1)
    assert d.kill("ct-nobody") is False and d.info("ct-nobody") is None
    assert d.inspect("ct-nobody").status is VMStatus.UNKNOWN and d.stray("ct-nobody") == []


def test_fingerprint_is_stable_across_instances(env, tmp_path):
    fp = env.driver.fingerprint()
    assert fp["driver"] == env.name and fp == env.driver.fingerprint()
    again = get_driver(env.name, tmp_path / "other-home", env.images_dir)
    assert again.fingerprint() == fp


def test_a_network_policy_the_backend_cannot_enforce_is_refused(env):
    """A backend that cannot filter egress (slirp, the fake's by default) refuses a restriction
    before anything starts, never accepting and ignoring it. One that can (QEMU's netns)
    accepts the restrictions it enforces and refuses, the same way, what it cannot (domain
    names in allowOut)."""
    d = env.driver
    restricted = (NetworkSpec(allow_internet_access=False), NetworkSpec(allow_out=("10.1.0.0/16",)),
                  NetworkSpec(deny_out=("0.0.0.0/0",)))
    if not d.net.enforces_egress:
        for network in restricted:
            with pytest.raises(UnsupportedNetworkPolicy, match="cannot restrict egress"):
                d.boot(BootSpec("ct-net", cpu_count=1, memory_mb=256, network=network))
            assert d.inspect("ct-net").status is VMStatus.UNKNOWN
        return
    for network in restricted:
        d.net.check(network)  # accepted: no UnsupportedNetworkPolicy
    info = d.boot(BootSpec("ct-net", cpu_count=1, memory_mb=256, network=restricted[0]))
    try:
        assert info.status is VMStatus.RUNNING and d.inspect("ct-net").status is VMStatus.RUNNING
        assert endpoint(info) != endpoint(now(env))
    finally:
        assert d.kill("ct-net")
    unenforceable = NetworkSpec(allow_out=("example.com",), deny_out=("0.0.0.0/0",))
    with pytest.raises(UnsupportedNetworkPolicy, match="domain names"):
        d.boot(BootSpec("ct-net", cpu_count=1, memory_mb=256, network=unenforceable))
    assert d.inspect("ct-net").status is VMStatus.UNKNOWN


def test_kill_leaves_nothing(env, parent):
    d = env.driver
    assert d.kill(PARENT) is True
    assert d.inspect(PARENT).status is VMStatus.UNKNOWN and d.info(PARENT) is None
    assert d.list() == [] and d.sandbox_ids() == set()
    assert d.stray() == [] and d.gc() == [] and d.files_in_use() == set()
    assert d.kill(PARENT) is False
