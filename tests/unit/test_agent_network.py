"""The node tasks' side of the network settings, run in-process on vmm's fake driver: the
``network`` argument of boot / restore / resume / fork reaches the driver's backend, the
``update_network`` task replaces a VM's policy, every VM result carries ``guest_host``,
and a backend that cannot enforce a policy refuses it (without a cold-boot retry)."""
from pathlib import Path

import pytest

from agent import driver as node_driver
from agent import settle, tasks
from vmm.driver import BootSpec, UnsupportedNetworkPolicy, VMNotFound
from vmm.fake import FakeDriver, FakeNetwork
from vmm.net.spec import NetworkSpec

ENVD = 49983
DENY_ALL = {"allow_internet_access": False, "allow_out": ["8.8.8.8/32"], "deny_out": ["0.0.0.0/0"],
            "forward_ports": [ENVD]}
ONLY_9 = {"allow_internet_access": True, "allow_out": [], "deny_out": ["9.9.9.0/24"], "forward_ports": [ENVD]}
BOOT = dict(image="base", cpu_count=1, memory_mb=256, disk_size_mb=1024, env_vars={}, access_token=None)


class SlotNetwork(FakeNetwork):
    """A fake backend that filters and, like the netns backend, reaches every guest port at
    a slot address of its own."""

    def __init__(self):
        super().__init__(enforces_egress=True)
        self.slots = 0

    def attach(self, sandbox_id, state_dir, spec):
        attachment = super().attach(sandbox_id, state_dir, spec)
        self.slots += 1
        attachment.guest_host = f"10.11.0.{self.slots}"
        return attachment


class NoTemplates:
    def find(self, driver, spec):
        return None


@pytest.fixture
def inits(monkeypatch):
    calls = []
    monkeypatch.setattr(tasks, "init_envd", lambda host, port, env, token: calls.append((host, port)))
    monkeypatch.setattr(settle, "init_envd", lambda host, port, env, token: calls.append((host, port)))
    monkeypatch.setattr(tasks, "get_templates", NoTemplates)
    return calls


@pytest.fixture
def filtering(inits):
    driver = FakeDriver(network=SlotNetwork())
    node_driver.set_driver(driver)
    yield driver
    node_driver.set_driver(None)


@pytest.fixture
def slirp_like(inits):
    driver = FakeDriver()  # its backend cannot filter, like the slirp fallback
    node_driver.set_driver(driver)
    yield driver
    node_driver.set_driver(None)


def _policy(driver, sid) -> dict:
    return driver.net.policies[sid].to_json()


def test_boot_gives_the_vm_its_network_and_returns_guest_host(filtering):
    out = tasks.boot_sandbox(sandbox_id="b1", network=DENY_ALL, **BOOT)
    assert _policy(filtering, "b1") == DENY_ALL
    assert out["guest_host"] == "10.11.0.1" == filtering.info("b1").guest_host
    assert tasks.boot_sandbox(sandbox_id="b2", **BOOT)["guest_host"] == "10.11.0.2"
    assert _policy(filtering, "b2") == NetworkSpec().to_json()  # no network: the open default


def test_a_backend_that_cannot_filter_refuses_and_leaves_no_vm(slirp_like):
    with pytest.raises(UnsupportedNetworkPolicy, match="cannot restrict egress"):
        tasks.boot_sandbox(sandbox_id="s1", network=DENY_ALL, **BOOT)
    assert slirp_like.info("s1") is None
    assert tasks.boot_sandbox(sandbox_id="s2", network=NetworkSpec().to_json(), **BOOT)["guest_host"] == ""


def test_update_network_replaces_the_policy_or_changes_nothing(filtering, slirp_like):
    node_driver.set_driver(filtering)
    tasks.boot_sandbox(sandbox_id="u1", network=DENY_ALL, **BOOT)
    out = tasks.update_network(sandbox_id="u1", network=ONLY_9)
    assert out["timings"]["total_ms"] >= 0 and _policy(filtering, "u1") == ONLY_9
    tasks.update_network(sandbox_id="u1", network={})
    assert _policy(filtering, "u1") == NetworkSpec().to_json()
    with pytest.raises(VMNotFound):
        tasks.update_network(sandbox_id="nope", network=ONLY_9)

    node_driver.set_driver(slirp_like)
    tasks.boot_sandbox(sandbox_id="u2", **BOOT)
    with pytest.raises(UnsupportedNetworkPolicy):
        tasks.update_network(sandbox_id="u2", network=ONLY_9)
    assert _policy(slirp_like, "u2") == NetworkSpec().to_json()


def test_resume_applies_the_rows_policy_before_the_vm_runs(filtering):
    tasks.boot_sandbox(sandbox_id="r1", network=DENY_ALL, **BOOT)
    filtering.pause_to_disk("r1")
    out = tasks.resume_sandbox(sandbox_id="r1", env_vars={}, access_token=None, network=ONLY_9)
    assert _policy(filtering, "r1") == ONLY_9 and out["guest_host"] == "10.11.0.1"
    filtering.pause_to_disk("r1")
    tasks.resume_sandbox(sandbox_id="r1", env_vars={}, access_token=None)  # none given: the driver's kept
    assert _policy(filtering, "r1") == ONLY_9


def test_fork_children_get_their_rows_policy_and_guest_hosts(filtering):
    tasks.boot_sandbox(sandbox_id="p1", network=DENY_ALL, **BOOT)
    out = tasks.fork_sandbox(sandbox_id="p1", env_vars={}, access_token=None, children=[
        {"sandbox_id": "c1", "env_vars": {}, "access_token": None, "network": ONLY_9},
        {"sandbox_id": "c2", "env_vars": {}, "access_token": None}])
    kids = {c["sandbox_id"]: c for c in out["children"]}
    assert all(c["ok"] for c in kids.values()), kids
    assert _policy(filtering, "c1") == ONLY_9  # the row's (an update raced the fork)
    assert _policy(filtering, "c2") == DENY_ALL  # inherited from the parent in the driver
    assert {kids["c1"]["guest_host"], kids["c2"]["guest_host"]} == {"10.11.0.2", "10.11.0.3"}


def test_a_child_whose_policy_is_refused_fails_alone(filtering, monkeypatch):
    tasks.boot_sandbox(sandbox_id="p2", **BOOT)
    real = filtering.update_network

    def refuse_c3(sid, network):
        if sid == "c3":
            raise UnsupportedNetworkPolicy("cannot restrict egress here")
        return real(sid, network)

    monkeypatch.setattr(filtering, "update_network", refuse_c3)
    out = tasks.fork_sandbox(sandbox_id="p2", env_vars={}, access_token=None, children=[
        {"sandbox_id": "c3", "env_vars": {}, "access_token": None, "network": ONLY_9},
        {"sandbox_id": "c4", "env_vars": {}, "access_token": None, "network": ONLY_9}])
    kids = {c["sandbox_id"]: c for c in out["children"]}
    assert kids["c3"]["ok"] is False and kids["c3"]["kind"] == "UnsupportedNetworkPolicy"
    assert filtering.info("c3") is None and kids["c4"]["ok"] and _policy(filtering, "c4") == ONLY_9


def test_an_unenforceable_policy_does_not_fall_back_to_a_cold_boot(slirp_like, monkeypatch):
    manifest = object()
    monkeypatch.setattr(tasks, "get_templates", lambda: type("T", (), {"find": lambda self, d, s: manifest})())
    boots = []
    monkeypatch.setattr(slirp_like, "restore", lambda *a, **k: (_ for _ in ()).throw(
        UnsupportedNetworkPolicy("cannot restrict egress")))
    monkeypatch.setattr(slirp_like, "boot", lambda spec: boots.append(spec))
    with pytest.raises(UnsupportedNetworkPolicy):
        tasks._start_vm(slirp_like, BootSpec("t1", network=NetworkSpec.from_json(DENY_ALL)))
    assert boots == []


def test_reconcile_continuing_a_vm_reports_its_guest_host(filtering):
    tasks.boot_sandbox(sandbox_id="k1", **BOOT)
    filtering.pause("k1")
    row = type("Row", (), {"pk": "k1", "env_vars": {}, "envd_access_token": ""})()
    assert settle.continue_vm(filtering, row)["guest_host"] == "10.11.0.1"


class _SnapshotAt:
    """The node's snapshot store as a restore uses it, holding one snapshot at ``where``."""

    def __init__(self, where):
        self.where = Path(where)

    def local_dir(self, snapshot_id, *, pending_wait=0.0):
        return self.where

    def take_mount_timings(self, snapshot_id):
        return {}

    def restored(self, snapshot_id):
        pass


def test_restore_gives_the_new_vm_the_requests_network(filtering, monkeypatch, tmp_path):
    tasks.boot_sandbox(sandbox_id="src", **BOOT)
    manifest = filtering.snapshot("src", tmp_path / "snap")

    monkeypatch.setattr(tasks, "_store", lambda: _SnapshotAt(manifest.dir))
    out = tasks.restore_sandbox(sandbox_id="rs1", snapshot_id="s1", env_vars={}, access_token=None,
                                network=ONLY_9)
    assert _policy(filtering, "rs1") == ONLY_9 and out["guest_host"] == filtering.info("rs1").guest_host


def test_restore_tells_the_store_once_the_vm_answers(filtering, monkeypatch, tmp_path):
    """A lazily restored snapshot records its first-read chunks until then (agent.stores.lazy)."""
    tasks.boot_sandbox(sandbox_id="src2", **BOOT)
    manifest = filtering.snapshot("src2", tmp_path / "snap")
    told = []

    class Store(_SnapshotAt):
        def restored(self, snapshot_id):
            told.append((snapshot_id, filtering.info("rs2") is not None))

    monkeypatch.setattr(tasks, "_store", lambda: Store(manifest.dir))
    tasks.restore_sandbox(sandbox_id="rs2", snapshot_id="s2", env_vars={}, access_token=None)
    assert told == [("s2", True)]
