"""Reading CPU, memory and disks from /proc (envd.usage, shared by envd's /metrics and the
node's heartbeat), and the heartbeat carrying the host's figures and their history."""
import os

import pytest

from agent.heartbeat import Heartbeat, beat, register_node
from agent.host_usage import HostSampler, history_point, machine_info
from envd import usage
from nodes.models import Node

STAT = """cpu  1000 50 500 8000 200 10 40 30 99 7
cpu0 500 25 250 4000 100 5 20 15 0 0
intr 12345
"""
MEMINFO = """MemTotal:        2048000 kB
MemFree:          100000 kB
MemAvailable:     512000 kB
Buffers:           20000 kB
Cached:           300000 kB
"""


def test_cpu_times_count_iowait_as_idle_and_leave_guest_time_out():
    t = usage.parse_cpu_times(STAT)
    assert t.total == 1000 + 50 + 500 + 8000 + 200 + 10 + 40 + 30
    assert t.busy == t.total - 8000 - 200


def test_cpu_percent_between_two_readings():
    before = usage.CpuTimes(busy=100, total=1000)
    assert usage.cpu_percent(before, usage.CpuTimes(busy=150, total=1200)) == 25.0
    assert usage.cpu_percent(before, before) == 0.0
    assert usage.cpu_percent(before, usage.CpuTimes(busy=400, total=1100)) == 100.0  # clamped


def test_no_cpu_line_is_an_error():
    with pytest.raises(ValueError):
        usage.parse_cpu_times("intr 1\n")


def test_meminfo_used_is_total_minus_available():
    m = usage.parse_meminfo(MEMINFO)
    assert m.total == 2048000 * 1024 and m.used == (2048000 - 512000) * 1024 and m.cache == 300000 * 1024
    old_kernel = usage.parse_meminfo(MEMINFO.replace("MemAvailable:     512000 kB\n", ""))
    assert old_kernel.used == (2048000 - 100000 - 300000 - 20000) * 1024


def test_mount_of_picks_the_longest_mount_point():
    mounts = usage.parse_mounts("/dev/vda1 / ext4 rw 0 0\ntmpfs /dev/shm tmpfs rw 0 0\n"
                                "/dev/vdb /var/lib/aenv\\040data xfs rw 0 0\n")
    assert usage.mount_of("/dev/shm", mounts)[:3] == ("/dev/shm", "tmpfs", "tmpfs")
    assert usage.mount_of("/var/lib/aenv data/images", mounts)[0] == "/var/lib/aenv data"
    assert usage.mount_of("/var/lib/aenv", mounts)[0] == "/"
    assert usage.mount_of("/dev/shmx", mounts)[0] == "/"


def test_disks_are_the_real_filesystems_each_once(tmp_path):
    found = usage.disks(["/", "/", str(tmp_path), "/no/such/dir"])
    points = [d.mount_point for d in found]
    assert len(points) == len(set(points)) and "/" in points
    root = next(d for d in found if d.mount_point == "/")
    st = os.statvfs("/")
    assert root.total == st.f_blocks * st.f_frsize and 0 < root.used <= root.total


def test_cpu_meter_measures_since_the_last_reading_and_renews_a_stale_one():
    readings = iter([usage.CpuTimes(0, 0), usage.CpuTimes(10, 100), usage.CpuTimes(60, 200),
                     usage.CpuTimes(60, 300)])
    now = [0.0]
    meter = usage.CpuMeter(window=0.1, max_age=30, read=lambda: next(readings), clock=lambda: now[0])
    assert meter.needs_window()
    meter.baseline()
    now[0] = 0.1
    assert not meter.needs_window()
    assert meter.percent() == 10.0
    now[0] = 5.0
    assert meter.percent() == 50.0
    now[0] = 100.0
    assert meter.needs_window()  # the last reading is stale (a restored guest): measure anew


def test_machine_info_from_the_first_processor():
    info = machine_info("processor\t: 0\ncpu family\t: 6\nmodel\t\t: 85\nmodel name\t: Intel Xeon\n\n"
                        "processor\t: 1\nmodel name\t: other\n", architecture="x86_64")
    assert info == {"cpuFamily": "6", "cpuModel": "85", "cpuModelName": "Intel Xeon", "cpuArchitecture": "x86_64"}


def test_host_sample_has_the_node_api_fields(tmp_path):
    sample = HostSampler(["/", str(tmp_path)]).sample()
    with open("/proc/meminfo") as f:
        total = usage.parse_meminfo(f.read()).total
    assert sample["memoryTotalBytes"] == total and 0 < sample["memoryUsedBytes"] <= total
    assert sample["cpuCount"] == os.cpu_count() and 0 <= sample["cpuPercent"] <= 100
    assert any(d["mountPoint"] == "/" for d in sample["disks"])
    assert set(sample["machineInfo"]) == {"cpuFamily", "cpuModel", "cpuModelName", "cpuArchitecture"}
    point = history_point(sample)
    assert point[1:] == [sample["cpuPercent"], sample["memoryUsedBytes"]]


class _FixedSampler:
    def __init__(self):
        self.n = 0

    def sample(self):
        self.n += 1
        return {"cpuPercent": float(self.n), "memoryUsedBytes": self.n * 100, "cpuCount": 2}


@pytest.mark.django_db
def test_heartbeat_writes_host_figures_and_a_bounded_history():
    register_node(node_id="hb", address="10.0.0.1", driver_name="qemu", accel="tcg", vcpu_capacity=8,
                  memory_mb_capacity=1024, host={"cpuPercent": 0.0})
    hb = Heartbeat("hb", 60, lambda: 3, host_sampler=_FixedSampler(), history=3)
    for _ in range(5):
        hb.beat_once()
    node = Node.objects.get(pk="hb")
    assert node.host["cpuPercent"] == 5.0 and node.sandboxes_running == 3
    assert [p[1] for p in node.host_history] == [3.0, 4.0, 5.0]
    assert hb.last_host == node.host
    # a restarted node continues the stored history
    hb2 = Heartbeat("hb", 60, lambda: 0, host_sampler=_FixedSampler(), history=3)
    hb2.beat_once()
    assert [p[1] for p in Node.objects.get(pk="hb").host_history] == [4.0, 5.0, 1.0]


@pytest.mark.django_db
def test_a_failing_host_reading_still_beats():
    register_node(node_id="hb2", address="10.0.0.1", driver_name="qemu", accel="tcg", vcpu_capacity=8,
                  memory_mb_capacity=1024, host={"cpuPercent": 9.0})
    Node.objects.filter(pk="hb2").update(last_heartbeat_at=None)

    class Broken:
        def sample(self):
            raise OSError("no /proc")

    Heartbeat("hb2", 60, lambda: 1, host_sampler=Broken(), history=3).beat_once()
    node = Node.objects.get(pk="hb2")
    assert node.last_heartbeat_at is not None and node.host == {"cpuPercent": 9.0}
    beat("hb2", lambda: 2)  # the old call still works without figures
    assert Node.objects.get(pk="hb2").sandboxes_running == 2
