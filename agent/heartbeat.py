"""Node registration and the heartbeat thread: how the control plane learns that a
node is alive, what it can hold, how many VMs it runs and how busy its host is
(``agent.host_usage``: CPU, memory, disks, with a short history for the dashboard)."""
import logging
from collections import deque

from django.utils import timezone

from nodes.join import NodeRevoked
from nodes.models import Node

from agent.host_usage import history_point
from agent.periodic import Periodic

log = logging.getLogger(__name__)


def register_node(*, node_id: str, address: str, driver_name: str, accel: str,
                  vcpu_capacity: int, memory_mb_capacity: int, sandboxes_running: int = 0,
                  version: str = "", host: dict | None = None, snapshots_here: list[str] | None = None) -> Node:
    """Create or refresh this node's row; `draining` is the operator's and kept as is
    (so is the host history: a restart does not blank the dashboard's chart). A revoked
    node is refused (NodeRevoked): only a new join token issued for it re-admits it."""
    revoked = Node.objects.filter(pk=node_id, revoked_at__isnull=False).first()
    if revoked is not None:
        raise NodeRevoked(revoked)
    now = timezone.now()
    defaults = dict(address=address, driver=driver_name, accel=accel, vcpu_capacity=vcpu_capacity,
                    memory_mb_capacity=memory_mb_capacity, sandboxes_running=sandboxes_running,
                    version=version, started_at=now, last_heartbeat_at=now, stopped_at=None)
    if host is not None:
        defaults["host"] = host
    if snapshots_here is not None:
        defaults["snapshots_here"] = snapshots_here
    node, _ = Node.objects.update_or_create(pk=node_id, defaults=defaults)
    return node


def beat(node_id: str, count_running, host: dict | None = None, history: list | None = None,
         snapshots_here: list[str] | None = None) -> None:
    """One heartbeat: a fresh timestamp, the current number of running VMs and, when
    given, the host's figures and their recent history and the snapshots it has. A
    revoked node's beat changes nothing and raises NodeRevoked."""
    fields = {"last_heartbeat_at": timezone.now(), "sandboxes_running": count_running()}
    if host is not None:
        fields["host"] = host
    if history is not None:
        fields["host_history"] = history
    if snapshots_here is not None:
        fields["snapshots_here"] = snapshots_here
    if not Node.objects.filter(pk=node_id, revoked_at__isnull=True).update(**fields):
        revoked = Node.objects.filter(pk=node_id, revoked_at__isnull=False).first()
        if revoked is not None:
            raise NodeRevoked(revoked)


def mark_stopped(node_id: str) -> None:
    """The worker stopped cleanly (its beats too): placement leaves the node from now on, not
    once its last heartbeat is older than AENV_NODE_HEARTBEAT_TIMEOUT (nodes.models)."""
    Node.objects.filter(pk=node_id).update(stopped_at=timezone.now())


class Heartbeat(Periodic):
    """Beats every `interval` seconds until stopped; never dies on a DB or driver error.
    With a ``host_sampler`` (agent.host_usage.HostSampler) each beat carries the host's
    figures, and the last ``history`` of them as chart points; ``last_host`` is the newest
    sample (the node's Prometheus exporter reads it). ``local_snapshots`` (the store's
    ``local_ids``) says which snapshots' files the node has, for placement's locality.
    When the node is found revoked, the beats stop and ``on_revoked(error)`` is called
    (the worker stops itself: agent.worker)."""

    def __init__(self, node_id: str, interval: float, count_running, host_sampler=None, history: int = 0,
                 local_snapshots=None, on_revoked=None):
        super().__init__(f"heartbeat-{node_id}", interval)
        self.node_id = node_id
        self.count_running = count_running
        self.host_sampler = host_sampler
        self.local_snapshots = local_snapshots
        self.on_revoked = on_revoked
        self.last_host: dict = {}
        self._history = deque(maxlen=max(history, 1)) if history else None

    def beat_once(self) -> None:
        host = history = None
        if self.host_sampler is not None:
            try:
                host = self.host_sampler.sample()
            except Exception:  # noqa: BLE001 - the node is still alive: beat without figures
                log.exception("host figures of node %s could not be read", self.node_id)
        if host is not None:
            self.last_host = host
            if self._history is not None:
                if not self._history:  # a restarted node continues the chart its row holds
                    stored = Node.objects.filter(pk=self.node_id).values_list("host_history", flat=True).first()
                    self._history.extend(p for p in (stored or []) if isinstance(p, list))
                self._history.append(history_point(host))
                history = list(self._history)
        here = None
        if self.local_snapshots is not None:
            try:
                here = list(self.local_snapshots())
            except Exception:  # noqa: BLE001 - the node is still alive: beat without them
                log.exception("local snapshots of node %s could not be listed", self.node_id)
        beat(self.node_id, self.count_running, host, history, here)

    def round(self) -> None:
        try:
            self.beat_once()
        except NodeRevoked as exc:
            log.error("%s; stopping", exc.message)
            self.stop()
            if self.on_revoked is not None:
                self.on_revoked(exc)
