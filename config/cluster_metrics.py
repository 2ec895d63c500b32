"""The API's Prometheus gauges and counters read from the database at scrape time:
sandboxes by state, creates by outcome (and placements that found no node), template
builds by status, and each node's figures from ``nodes.summary`` (the same ones
``GET /nodes`` shows). Aggregates only: no team, sandbox id or build id is a label.

Why from the database and not counters in the process: the API may run as several
processes (and restart); the events and rows are the one durable record they share.
"""
from __future__ import annotations

from django.db.models import Count
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from nodes import summary
from sandboxes.models import Sandbox, SandboxEvent
from sandboxes.states import LIVE
from template_builds.models import BuildStatus, TemplateBuild

CREATE_OUTCOMES = ("ok", "error", "aborted")


def _gauge(name: str, doc: str, labels: list[str], rows) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=labels)
    for label_values, value in rows:
        g.add_metric(list(label_values), value)
    return g


class ClusterCollector:
    def describe(self):
        return []  # queried at scrape time only

    def collect(self):
        by_state = dict(Sandbox.objects.filter(state__in=LIVE).order_by().values_list("state")
                        .annotate(n=Count("id")).values_list("state", "n"))
        yield _gauge("aenv_cluster_sandboxes", "Live sandboxes by state (every team)", ["state"],
                     [((state,), by_state.get(state, 0)) for state in sorted(LIVE)])

        creates = dict(SandboxEvent.objects.filter(operation="create", outcome__in=CREATE_OUTCOMES).order_by()
                       .values_list("outcome").annotate(n=Count("id")).values_list("outcome", "n"))
        c = CounterMetricFamily("aenv_cluster_sandbox_creates", "Finished creates (restores, fork children) by outcome",
                                labels=["outcome"])
        for outcome in CREATE_OUTCOMES:
            c.add_metric([outcome], creates.get(outcome, 0))
        yield c
        unplaced = SandboxEvent.objects.filter(operation="create", outcome="error",
                                               details__kind="NoNodeAvailable").count()
        yield CounterMetricFamily("aenv_cluster_placement_failures", "Creates refused because no node had room",
                                  value=unplaced)

        builds = dict(TemplateBuild.objects.order_by().values_list("status").annotate(n=Count("id"))
                      .values_list("status", "n"))
        yield _gauge("aenv_cluster_template_builds", "Template builds by status", ["status"],
                     [((status,), builds.get(status, 0)) for status in BuildStatus.values])

        yield from node_families(summary.summarize())


def node_families(nodes: list[summary.NodeSummary]):
    """Per-node gauges of the summaries (label ``node``)."""
    def per_node(name: str, doc: str, value_of):
        return _gauge(name, doc, ["node"], [((s.node.pk,), value_of(s)) for s in nodes])

    yield _gauge("aenv_cluster_node_status", "1 for the node's status (ready, draining, dead)", ["node", "status"],
                 [((s.node.pk, st), 1 if s.status == st else 0) for s in nodes
                  for st in (summary.READY, summary.DRAINING, summary.DEAD)])
    yield per_node("aenv_cluster_node_heartbeat_age_seconds", "Seconds since the node's last heartbeat",
                   lambda s: s.heartbeat_age if s.heartbeat_age is not None else float("nan"))
    yield per_node("aenv_cluster_node_capacity_vcpus", "vCPUs placement may reserve", lambda s: s.node.vcpu_capacity)
    yield per_node("aenv_cluster_node_capacity_memory_bytes", "Memory placement may reserve",
                   lambda s: s.node.memory_mb_capacity * summary.MIB)
    yield per_node("aenv_cluster_node_allocated_vcpus", "vCPUs placement reserves (live sandboxes but paused, builds)",
                   lambda s: s.cpu_reserved)
    yield per_node("aenv_cluster_node_allocated_memory_bytes", "Memory placement reserves",
                   lambda s: s.memory_reserved_mb * summary.MIB)
    yield per_node("aenv_cluster_node_paused_allocated_vcpus", "vCPUs of the node's paused sandboxes",
                   lambda s: s.paused_cpu)
    yield per_node("aenv_cluster_node_paused_allocated_memory_bytes", "Memory of the node's paused sandboxes",
                   lambda s: s.paused_memory_mb * summary.MIB)
    yield _gauge("aenv_cluster_node_sandboxes", "The node's sandboxes: running, starting, paused", ["node", "kind"],
                 [((s.node.pk, kind), value) for s in nodes
                  for kind, value in (("running", s.running), ("starting", s.starting), ("paused", s.paused))])
    creates = CounterMetricFamily("aenv_cluster_node_creates", "Creates that ended on the node, by outcome",
                                  labels=["node", "outcome"])
    for s in nodes:
        creates.add_metric([s.node.pk, "ok"], s.create_successes)
        creates.add_metric([s.node.pk, "error"], s.create_failures)
    yield creates
    yield per_node("aenv_cluster_node_host_cpu_percent", "Host CPU busy % at the last heartbeat",
                   lambda s: float(s.host.get("cpuPercent", 0.0)))
    yield per_node("aenv_cluster_node_host_memory_used_bytes", "Host memory in use at the last heartbeat",
                   lambda s: int(s.host.get("memoryUsedBytes", 0)))
    yield per_node("aenv_cluster_node_host_memory_total_bytes", "Host memory",
                   lambda s: int(s.host.get("memoryTotalBytes", 0)))


# Its own registry, exposed by the API's /metrics after the process's default one: only the
# API reads the database at scrape time (the data plane's exposition never does).
CLUSTER = CollectorRegistry()
CLUSTER.register(ClusterCollector())
