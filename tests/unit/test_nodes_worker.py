"""Node worker pieces: registration, heartbeats, capacity and the worker command line.
The VM driver is a stub; the Celery worker itself is replaced by a recorder."""
import time
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.test import override_settings
from django.utils import timezone

from agent import driver as node_driver, worker
from agent.heartbeat import Heartbeat, beat, register_node
from nodes.models import Node

pytestmark = pytest.mark.django_db(transaction=True)


class StubDriver:
    accel = "kvm"

    def __init__(self):
        self.vms = ["a", "b"]

    def capacity(self):
        return {"vcpus": 2, "memory_mb": 1000}

    def list(self):
        return list(self.vms)


def test_register_creates_then_updates_and_keeps_draining():
    node = register_node(node_id="n1", address="10.0.0.1", driver_name="qemu", accel="tcg",
                         vcpu_capacity=8, memory_mb_capacity=2048)
    assert node.is_alive() and node.queue == "node.n1"
    Node.objects.filter(pk="n1").update(draining=True, last_heartbeat_at=timezone.now() - timedelta(hours=1))
    register_node(node_id="n1", address="10.0.0.2", driver_name="qemu", accel="kvm",
                  vcpu_capacity=16, memory_mb_capacity=4096, sandboxes_running=3)
    node = Node.objects.get(pk="n1")
    assert (node.address, node.accel, node.vcpu_capacity, node.memory_mb_capacity, node.sandboxes_running) == \
        ("10.0.0.2", "kvm", 16, 4096, 3)
    assert node.draining and node.is_alive()


def test_heartbeat_thread_refreshes_and_counts():
    Node.objects.create(id="n2", address="x", last_heartbeat_at=timezone.now() - timedelta(hours=1))
    hb = Heartbeat("n2", 0.05, lambda: 7, local_snapshots=lambda: ["snap-1", "tpl-2"])
    hb.start()
    try:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and not Node.objects.get(pk="n2").is_alive():
            time.sleep(0.05)
    finally:
        hb.stop()
        hb.join(2)
    node = Node.objects.get(pk="n2")
    assert node.is_alive() and node.sandboxes_running == 7
    assert node.snapshots_here == ["snap-1", "tpl-2"]
    assert not hb.is_alive()


def test_heartbeat_survives_errors():
    Node.objects.create(id="n3", address="x")
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("driver hiccup")
        return 1

    hb = Heartbeat("n3", 0.02, flaky)
    hb.start()
    time.sleep(0.3)
    hb.stop()
    hb.join(2)
    assert len(calls) > 2 and Node.objects.get(pk="n3").is_alive()


def test_beat_updates_only_its_node():
    Node.objects.create(id="me", address="x")
    Node.objects.create(id="other", address="x")
    beat("me", lambda: 2)
    assert Node.objects.get(pk="me").sandboxes_running == 2
    assert Node.objects.get(pk="other").last_heartbeat_at is None


def test_capacity_applies_overcommit():
    assert worker.node_capacity(StubDriver(), 16, 1.5) == (32, 1500)


def test_worker_consumes_only_its_queue_with_threads():
    argv = worker.worker_argv("n9", 32)
    assert argv[argv.index("--queues") + 1] == "node.n9"
    assert argv[argv.index("--pool") + 1] == "threads"
    assert argv[argv.index("--concurrency") + 1] == "32"


@override_settings(AENV_NODE_ID="cmdnode", AENV_NODE_ADDRESS="192.0.2.5", AENV_NODE_HEARTBEAT_INTERVAL=1)
def test_run_node_command_registers_and_starts_worker(monkeypatch):
    node_driver.set_driver(StubDriver())
    seen = {}

    def fake_worker_main(argv):
        seen["argv"] = argv
        seen["node"] = Node.objects.get(pk="cmdnode")

    monkeypatch.setattr(worker.celery_app, "worker_main", fake_worker_main)
    try:
        call_command("run_node", "--concurrency", "12", "--vcpu-overcommit", "4", "--memory-overcommit", "1")
    finally:
        node_driver.set_driver(None)
    node = seen["node"]
    assert (node.address, node.accel, node.vcpu_capacity, node.memory_mb_capacity, node.sandboxes_running) == \
        ("192.0.2.5", "kvm", 8, 1000, 2)
    assert node.is_alive()
    assert seen["argv"][seen["argv"].index("--queues") + 1] == "node.cmdnode"
    assert seen["argv"][seen["argv"].index("--concurrency") + 1] == "12"


def test_the_default_templates_restores_are_readied_at_start(monkeypatch, settings):
    settings.AENV_BASE_CPU_COUNT, settings.AENV_BASE_MEMORY_MB, settings.AENV_BASE_DISK_MB = 2, 512, 2048
    asked, readied = [], []

    class Templates:
        def find(self, driver, spec):
            asked.append((spec.image, spec.cpu_count, spec.memory_mb, spec.disk_size_mb))
            return "the-manifest"

    class Driver:
        def prepare_restores(self, manifest):
            readied.append(manifest)

    monkeypatch.setattr(worker, "get_templates", lambda: Templates())
    worker.prepare_default_template(Driver())
    assert asked == [("base", 2, 512, 2048)] and readied == ["the-manifest"]
    worker.prepare_default_template(object())  # a driver without the verb: nothing to do

    class Broken(Templates):
        def find(self, driver, spec):
            raise OSError("images dir gone")

    monkeypatch.setattr(worker, "get_templates", lambda: Broken())
    worker.prepare_default_template(Driver())  # logged, never fatal to the node's start
    assert readied == ["the-manifest"]
