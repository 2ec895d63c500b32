"""What a node reports of its host with every heartbeat: CPU busy %, cores, memory, the
disks aenv writes to and what the machine is, as ``Node.host`` holds them (the names of
AgentENV's node ``metrics``, which ``GET /nodes`` serves as they are).

Why its own module: the heartbeat only carries the figures; reading them (the /proc
parsing shared with envd's guest ``/metrics``, ``envd.usage``) and remembering the CPU
baseline between beats is this module's job.
"""
from __future__ import annotations

import logging
import os
import platform
import time

from django.utils import timezone

from envd.usage import CpuMeter, disks, read_memory

log = logging.getLogger(__name__)

CPUINFO = "/proc/cpuinfo"


def machine_info(cpuinfo_text: str, architecture: str | None = None) -> dict:
    """AgentENV's ``machineInfo`` from /proc/cpuinfo's first processor."""
    fields: dict[str, str] = {}
    for line in cpuinfo_text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    return {"cpuFamily": fields.get("cpu family", ""), "cpuModel": fields.get("model", ""),
            "cpuModelName": fields.get("model name", ""),
            "cpuArchitecture": architecture if architecture is not None else platform.machine()}


def read_machine_info() -> dict:
    try:
        with open(CPUINFO) as f:
            return machine_info(f.read())
    except OSError:
        return machine_info("")


class HostSampler:
    """``sample()`` → the ``Node.host`` dict. CPU % is measured between two samples (the
    heartbeat interval), the first over a short window. ``paths`` are the directories
    whose filesystems are reported (root, AENV_HOME, the images, /dev/shm with the guests' RAM)."""

    def __init__(self, paths: list[str], cpu_meter: CpuMeter | None = None, cpu_count=None):
        self.paths = list(paths)
        self.cpu_meter = cpu_meter or CpuMeter(max_age=300.0)
        self._cpu_count = cpu_count
        self._machine = read_machine_info()
        self.extra: dict = {}  # e.g. {"metricsPort": 9464} once the node's exporter listens
        # figures read at each sample, e.g. {"chunkCache": store.chunk_cache_figures}; None: left out
        self.probes: dict = {}

    def sample(self) -> dict:
        if self.cpu_meter.needs_window():
            self.cpu_meter.baseline()
            time.sleep(self.cpu_meter.window)
        cpu = self.cpu_meter.percent()
        memory = read_memory()
        probed = {}
        for key, probe in self.probes.items():
            try:
                value = probe()
            except Exception:  # noqa: BLE001 - the host's own figures still go out
                log.exception("host figure %s could not be read", key)
                continue
            if value is not None:
                probed[key] = value
        return {
            "cpuPercent": cpu,
            "cpuCount": self._cpu_count or os.cpu_count() or 1,
            "memoryUsedBytes": memory.used,
            "memoryTotalBytes": memory.total,
            "disks": [{"mountPoint": d.mount_point, "device": d.device, "filesystemType": d.filesystem_type,
                       "usedBytes": d.used, "totalBytes": d.total} for d in disks(self.paths)],
            "machineInfo": self._machine,
            "sampledAt": timezone.now().isoformat(),
            **self.extra,
            **probed,
        }


def history_point(host: dict) -> list:
    """One chart point of a sample: [unix time, CPU %, memory used bytes]."""
    return [int(time.time()), host.get("cpuPercent", 0.0), host.get("memoryUsedBytes", 0)]
