"""``GET /nodes`` and ``GET /nodes/{id}`` as AgentENV answers them (``Node``,
``NodeDetail``), from ``nodes.summary``: its field names where it has the figure
(``sandboxCount``, ``createSuccesses``, ``createFails``, ``metrics{allocatedCPU, ...}``),
and aenv's own beside them (``address``, ``driver``, ``accel``, ``capacity``,
``lastHeartbeatAt``, ``metricsPort``). Memory is in bytes, as AgentENV's.

Those are the operators' (``X-Admin-Token``). A team's key gets ``TenantNodeSerializer``:
the node's id and status and the team's own sandbox counts (``nodes.summary.for_team``),
never an address, a port, the host or another team's load."""
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from nodes.summary import MIB, STATUSES


class DiskSerializer(serializers.Serializer):
    mountPoint = serializers.CharField()
    device = serializers.CharField()
    filesystemType = serializers.CharField()
    usedBytes = serializers.IntegerField()
    totalBytes = serializers.IntegerField()


class MachineInfoSerializer(serializers.Serializer):
    cpuFamily = serializers.CharField(default="")
    cpuModel = serializers.CharField(default="")
    cpuModelName = serializers.CharField(default="")
    cpuArchitecture = serializers.CharField(default="")


class NodeMetricsSerializer(serializers.Serializer):
    """Allocated: what placement reserves (every live sandbox but the paused ones, and
    running template builds); paused: what paused sandboxes would take back on resume;
    the rest: the host, from the node's last heartbeat (0 / empty before its first)."""

    allocatedCPU = serializers.IntegerField(source="cpu_reserved")
    allocatedMemoryBytes = serializers.SerializerMethodField()
    pausedAllocatedCPU = serializers.IntegerField(source="paused_cpu")
    pausedAllocatedMemoryBytes = serializers.SerializerMethodField()
    cpuPercent = serializers.SerializerMethodField()
    cpuCount = serializers.SerializerMethodField()
    memoryUsedBytes = serializers.SerializerMethodField()
    memoryTotalBytes = serializers.SerializerMethodField()
    disks = serializers.SerializerMethodField()

    def get_allocatedMemoryBytes(self, s) -> int:
        return s.memory_reserved_mb * MIB

    def get_pausedAllocatedMemoryBytes(self, s) -> int:
        return s.paused_memory_mb * MIB

    def get_cpuPercent(self, s) -> float:
        return float(s.host.get("cpuPercent", 0.0))

    def get_cpuCount(self, s) -> int:
        return int(s.host.get("cpuCount", 0))

    def get_memoryUsedBytes(self, s) -> int:
        return int(s.host.get("memoryUsedBytes", 0))

    def get_memoryTotalBytes(self, s) -> int:
        return int(s.host.get("memoryTotalBytes", 0))

    @extend_schema_field(DiskSerializer(many=True))
    def get_disks(self, s) -> list:
        return DiskSerializer([d for d in s.host.get("disks") or [] if isinstance(d, dict)], many=True).data


class CapacitySerializer(serializers.Serializer):
    """What placement may reserve here: host size times the overcommit factors."""

    cpu = serializers.IntegerField(source="node.vcpu_capacity")
    memoryBytes = serializers.SerializerMethodField()

    def get_memoryBytes(self, s) -> int:
        return s.node.memory_mb_capacity * MIB


class TenantNodeSerializer(serializers.Serializer):
    """``GET /nodes`` for a team's key: the counts are the caller's team's sandboxes."""

    id = serializers.CharField(source="node.id")
    status = serializers.ChoiceField(choices=STATUSES)
    sandboxCount = serializers.IntegerField(source="running")
    sandboxStartingCount = serializers.IntegerField(source="starting")
    sandboxPausedCount = serializers.IntegerField(source="paused")


class NodeSerializer(TenantNodeSerializer):
    """``GET /nodes`` for operators: AgentENV's ``Node`` whole (the counts are every team's)."""

    version = serializers.CharField(source="node.version")
    address = serializers.CharField(source="node.address")
    driver = serializers.CharField(source="node.driver")
    accel = serializers.CharField(source="node.accel")
    startedAt = serializers.DateTimeField(source="node.started_at")
    lastHeartbeatAt = serializers.DateTimeField(source="node.last_heartbeat_at", allow_null=True)
    # aenv's: when an operator revoked the node (nodes.join); null while it may work
    revokedAt = serializers.DateTimeField(source="node.revoked_at", allow_null=True)
    machineInfo = serializers.SerializerMethodField()
    createSuccesses = serializers.IntegerField(source="create_successes")
    createFails = serializers.IntegerField(source="create_failures")
    capacity = CapacitySerializer(source="*")
    metrics = NodeMetricsSerializer(source="*")
    metricsPort = serializers.SerializerMethodField()

    @extend_schema_field(MachineInfoSerializer)
    def get_machineInfo(self, s) -> dict:
        info = s.host.get("machineInfo")
        return MachineInfoSerializer(info if isinstance(info, dict) else {}).data

    def get_metricsPort(self, s) -> int | None:
        port = s.host.get("metricsPort")
        return int(port) if port else None


class NodeDetailSerializer(NodeSerializer):
    """AgentENV's ``NodeDetail``: ``Node`` without ``sandboxStartingCount``, with
    ``cachedBuilds`` (the caller's team's ready builds made on the node)."""

    sandboxStartingCount = None
    cachedBuilds = serializers.ListField(child=serializers.CharField(), source="cached_builds")


class TenantNodeDetailSerializer(TenantNodeSerializer):
    """``GET /nodes/{id}`` for a team's key: as ``NodeDetail``, no ``sandboxStartingCount``."""

    sandboxStartingCount = None
    cachedBuilds = serializers.ListField(child=serializers.CharField(), source="cached_builds")
