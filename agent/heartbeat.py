"""Node registration and the heartbeat thread: how the control plane learns that a
node is alive, what it can hold, and how many VMs it runs."""
import logging
import threading

from django.db import close_old_connections
from django.utils import timezone

from nodes.models import Node

log = logging.getLogger(__name__)


def register_node(*, node_id: str, address: str, driver_name: str, accel: str,
                  vcpu_capacity: int, memory_mb_capacity: int, sandboxes_running: int = 0,
                  version: str = "") -> Node:
    """Create or refresh this node's row; `draining` is the operator's and kept as is."""
    now = timezone.now()
    node, _ = Node.objects.update_or_create(
        pk=node_id,
        defaults=dict(address=address, driver=driver_name, accel=accel, vcpu_capacity=vcpu_capacity,
                      memory_mb_capacity=memory_mb_capacity, sandboxes_running=sandboxes_running,
                      version=version, started_at=now, last_heartbeat_at=now),
    )
    return node


def beat(node_id: str, count_running) -> None:
    """One heartbeat: a fresh timestamp and the current number of running VMs."""
    running = count_running()
    Node.objects.filter(pk=node_id).update(last_heartbeat_at=timezone.now(), sandboxes_running=running)


class Heartbeat(threading.Thread):
    """Beats every `interval` seconds until stopped; never dies on a DB or driver error."""

    def __init__(self, node_id: str, interval: float, count_running):
        super().__init__(name=f"heartbeat-{node_id}", daemon=True)
        self.node_id = node_id
        self.interval = interval
        self.count_running = count_running
        self._stopped = threading.Event()

    def run(self) -> None:
        while not self._stopped.wait(self.interval):
            try:
                beat(self.node_id, self.count_running)
            except Exception:
                log.exception("heartbeat of node %s failed", self.node_id)
            finally:
                close_old_connections()

    def stop(self) -> None:
        self._stopped.set()
