"""Port allocation: concurrent boots (threads and processes) never get the same port."""

import socket
import subprocess
import sys
import threading
from pathlib import Path

from vmm.net import ports

ROOT = Path(__file__).resolve().parents[2]


def test_threads_get_distinct_ports(tmp_path):
    sandboxes = tmp_path / "sandboxes"
    got, lock = [], threading.Lock()

    def worker(i):
        p = ports.allocate(sandboxes, sandboxes / f"sb{i}", port_range=(45000, 45040))
        with lock:
            got.append(p)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 12 and len(set(got)) == 12
    assert ports.claimed_ports(sandboxes) == set(got)


ALLOCATE = (
    "import sys; from pathlib import Path; from vmm.net import ports; "
    "d = Path(sys.argv[1]); print(ports.allocate(d, d / sys.argv[2], port_range=(45100, 45130)))"
)


def test_processes_get_distinct_ports(tmp_path):
    """Separate processes (like several node workers) started at once. Real
    subprocesses, not a fork pool: forking a test process that runs threads can
    deadlock the children."""
    sandboxes = tmp_path / "sandboxes"
    procs = [subprocess.Popen([sys.executable, "-c", ALLOCATE, str(sandboxes), f"p{i}"],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True) for i in range(12)]
    got = [int(p.communicate(timeout=60)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len(set(got)) == 12


def _busy_port_with_free_neighbour(busy: socket.socket) -> int:
    """Binds `busy` to a port whose next port is free right now (VMs of concurrent runs
    hold ports anywhere in the ephemeral range)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            candidate = probe.getsockname()[1]
        if candidate < 65535 and ports.bind_free("127.0.0.1", candidate + 1):
            try:
                busy.bind(("127.0.0.1", candidate))
            except OSError:
                continue
            busy.listen()
            return candidate
    raise AssertionError("no port with a free neighbour found")


def test_skips_ports_in_use_and_claimed(tmp_path):
    sandboxes = tmp_path / "sandboxes"
    with socket.socket() as busy:
        busy_port = _busy_port_with_free_neighbour(busy)
        port = ports.allocate(sandboxes, sandboxes / "a", port_range=(busy_port, busy_port + 1))
        assert port == busy_port + 1
        try:
            ports.allocate(sandboxes, sandboxes / "b", port_range=(busy_port, busy_port + 1))
        except ports.PortsExhausted:
            pass
        else:
            raise AssertionError("expected exhaustion: one port busy, the other claimed")


def _port_free_now() -> int:
    """A port nothing listens on right now (VMs of concurrent runs use the default range)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_released_when_state_dir_goes(tmp_path):
    import shutil

    sandboxes = tmp_path / "sandboxes"
    only = _port_free_now()
    p1 = ports.allocate(sandboxes, sandboxes / "a", port_range=(only, only))
    shutil.rmtree(sandboxes / "a")
    assert ports.allocate(sandboxes, sandboxes / "b", port_range=(only, only)) == p1
