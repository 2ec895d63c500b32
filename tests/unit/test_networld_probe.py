"""harness.networld.probe, the network tests' in-guest TCP probe, run here in a network namespace
of the test's own whose nftables drop two targets (as the node drops what a guest must not
reach): an open port is open, a refused one and the dropped ones closed, and the dropped ones
cost the one shared deadline together, not one each."""
import os
import subprocess
import time

import pytest

from harness.networld import probe
from vmm.net import slots

pytestmark = [pytest.mark.skipif(not slots.netns_supported(), reason="needs root, nft and nsenter (netns backend)")]


class _Ran:
    def __init__(self, stdout: str):
        self.stdout = stdout


class _InNetns:
    """What ``probe`` needs of a sandbox: ``commands.run``, here a shell in the namespace."""

    def __init__(self, netns: str):
        self.commands = self
        self.netns = netns

    def run(self, command: str, timeout: float):
        out = subprocess.run(["ip", "netns", "exec", self.netns, "bash", "-c", command], capture_output=True,
                             text=True, timeout=timeout, check=True)
        return _Ran(out.stdout)


@pytest.fixture
def netns():
    name = f"aenvprobe{os.getpid() % 100000}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        for cmd in (["ip", "link", "set", "lo", "up"], ["nft", "add", "table", "inet", "t"],
                    ["nft", "add", "chain", "inet", "t", "out", "{ type filter hook output priority 0; }"],
                    ["nft", "add", "rule", "inet", "t", "out", "tcp", "dport", "{ 9, 10 }", "drop"]):
            subprocess.run(["ip", "netns", "exec", name, *cmd], check=True, capture_output=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_open_refused_and_dropped_targets_share_one_deadline(netns):
    listener = subprocess.Popen(["ip", "netns", "exec", netns, "python3", "-c",
                                 "import socket, time; s = socket.socket(); s.bind(('127.0.0.1', 8080)); "
                                 "s.listen(64); print('up', flush=True); time.sleep(60)"],
                                stdout=subprocess.PIPE, text=True)
    try:
        assert listener.stdout.readline().strip() == "up"
        t0 = time.monotonic()
        seen = probe(_InNetns(netns), [("127.0.0.1", 8080), ("127.0.0.1", 7), ("127.0.0.1", 9), ("127.0.0.1", 10),
                                       ("127.0.0.1", 8080)], deadline=2.0)
        took = time.monotonic() - t0
    finally:
        listener.kill()
        listener.wait(timeout=10)
    assert seen == {("127.0.0.1", 8080): True, ("127.0.0.1", 7): False, ("127.0.0.1", 9): False,
                    ("127.0.0.1", 10): False}
    assert 2.0 <= took < 3.5, took  # the two dropped targets waited the deadline once, together

