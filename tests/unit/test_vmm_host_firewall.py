"""The node's accepts in a host firewall that drops forwarded traffic (vmm.net.host_firewall),
on Docker's shape built by the test in a network namespace of its own ("the host"), with
each iptables backend Docker may use: the accepts land in DOCKER-USER once, come back after
Docker recreates its chain, move there from FORWARD when Docker arrives, leave at stop; a
slot's forwarded traffic passes Docker's drop while the node's own drops still hold."""
import shutil
import subprocess
import time
import uuid
from contextlib import contextmanager

import pytest
from pyroute2 import netns as pyroute_netns

from vmm.net import host_firewall, host_table, slots
from vmm.net.slot_pool import SlotPool

pytestmark = pytest.mark.skipif(not slots.netns_supported(),
                                reason="needs root, nft (Debian nftables) and nsenter to make network namespaces")

TOOLS = [pytest.param(t, marks=pytest.mark.skipif(not shutil.which(t), reason=f"{t} not installed"))
         for t in ("iptables-nft", "iptables-legacy")]
POOL = "10.77.0.0/24"
EXT = "198.51.100.10"


def _sh(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30).stdout


@pytest.fixture
def host():
    """A namespace standing for the node's host: (its name, a prefix of this test's own)."""
    name = f"aenvfw{uuid.uuid4().hex[:6]}"
    _sh("ip", "netns", "add", name)
    try:
        yield name, "f" + uuid.uuid4().hex[:5]
    finally:
        for other in (f"{name}s", f"{name}x"):
            subprocess.run(["ip", "netns", "del", other], capture_output=True)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


@contextmanager
def inside(name: str):
    """This thread (and what it runs or starts) in namespace ``name``."""
    pyroute_netns.pushns(name)
    try:
        yield
    finally:
        pyroute_netns.popns()


def docker_shape(tool: str) -> None:
    """What dockerd makes in the filter table: FORWARD policy DROP, its chains, the jump to
    DOCKER-USER first (ending in RETURN)."""
    ipt = [tool, "-w", "-t", "filter"]
    _sh(*ipt, "-P", "FORWARD", "DROP")
    for chain in ("DOCKER", "DOCKER-ISOLATION-STAGE-1", "DOCKER-USER"):
        _sh(*ipt, "-N", chain)
    _sh(*ipt, "-A", "DOCKER-USER", "-j", "RETURN")
    _sh(*ipt, "-A", "FORWARD", "-j", "DOCKER-USER")
    _sh(*ipt, "-A", "FORWARD", "-j", "DOCKER-ISOLATION-STAGE-1")
    _sh(*ipt, "-A", "FORWARD", "-o", "docker0", "-j", "DOCKER")


def docker_restart(tool: str) -> None:
    """Docker's chain gone and made again, empty (a restart after a firewall reload)."""
    ipt = [tool, "-w", "-t", "filter"]
    _sh(*ipt, "-D", "FORWARD", "-j", "DOCKER-USER")
    _sh(*ipt, "-F", "DOCKER-USER")
    _sh(*ipt, "-X", "DOCKER-USER")
    _sh(*ipt, "-N", "DOCKER-USER")
    _sh(*ipt, "-A", "DOCKER-USER", "-j", "RETURN")
    _sh(*ipt, "-I", "FORWARD", "-j", "DOCKER-USER")


def chain(tool: str, name: str) -> list[str]:
    return _sh(tool, "-w", "-t", "filter", "-S", name).splitlines()


def ours(tool: str, prefix: str) -> list[str]:
    return [line for line in _sh(tool, "-w", "-t", "filter", "-S").splitlines() if host_firewall.tag(prefix) in line]


@pytest.mark.parametrize("tool", TOOLS)
def test_accepts_land_in_docker_user_once_and_come_back(host, tool):
    name, prefix = host
    with inside(name):
        docker_shape(tool)
        assert host_firewall.ensure(prefix, POOL)[tool] == "DOCKER-USER"
        listed = chain(tool, "DOCKER-USER")
        assert host_firewall.tag(prefix) in listed[1] and host_firewall.tag(prefix) in listed[2]
        assert listed[3:] == ["-A DOCKER-USER -j RETURN"]  # above Docker's RETURN
        host_firewall.ensure(prefix, POOL)
        assert chain(tool, "DOCKER-USER") == listed  # never twice
        docker_restart(tool)
        assert ours(tool, prefix) == []
        host_firewall.ensure(prefix, POOL)
        assert chain(tool, "DOCKER-USER") == listed
        assert host_firewall.remove(prefix) == 2
        assert ours(tool, prefix) == [] and chain(tool, "DOCKER-USER")[1:] == ["-A DOCKER-USER -j RETURN"]
        assert host_firewall.remove(prefix) == 0


@pytest.mark.parametrize("tool", TOOLS)
def test_a_forward_drop_without_docker_then_docker(host, tool):
    """Another firewall's FORWARD drop (no DOCKER-USER): at FORWARD's head; Docker arriving
    later: moved into its chain, nothing left behind."""
    name, prefix = host
    with inside(name):
        _sh(tool, "-w", "-t", "filter", "-P", "FORWARD", "DROP")
        _sh(tool, "-w", "-t", "filter", "-A", "FORWARD", "-i", "eth9", "-j", "ACCEPT")
        assert host_firewall.ensure(prefix, POOL)[tool] == "FORWARD"
        assert [host_firewall.tag(prefix) in line for line in chain(tool, "FORWARD")[1:]] == [True, True, False]
        docker_shape_after = [tool, "-w", "-t", "filter"]
        _sh(*docker_shape_after, "-N", "DOCKER-USER")
        _sh(*docker_shape_after, "-A", "DOCKER-USER", "-j", "RETURN")
        _sh(*docker_shape_after, "-I", "FORWARD", "-j", "DOCKER-USER")
        assert host_firewall.ensure(prefix, POOL)[tool] == "DOCKER-USER"
        assert all("DOCKER-USER" in line for line in ours(tool, prefix)) and len(ours(tool, prefix)) == 2


def test_a_host_without_a_forward_drop_gets_nothing(host):
    name, prefix = host
    with inside(name):
        assert set(host_firewall.ensure(prefix, POOL).values()) <= {None}
        assert _sh("nft", "list", "ruleset").strip() == ""  # no table made by looking
        assert "filter" not in open("/proc/net/ip_tables_names").read().split()  # nor a legacy one


def _world(name: str, prefix: str) -> tuple[str, str]:
    """A slot namespace on veth ``<prefix>v1`` (pool side .1) and an external host (EXT:80)
    on the host ``name``, which forwards and runs the node's table with that veth."""
    slot_ns, ext_ns = f"{name}s", f"{name}x"
    veth = f"{prefix}v1"
    for ns in (slot_ns, ext_ns):
        _sh("ip", "netns", "add", ns)
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
    _sh("ip", "-n", name, "link", "add", veth, "type", "veth", "peer", "name", "vpeer", "netns", slot_ns)
    _sh("ip", "-n", name, "link", "add", "uplink", "type", "veth", "peer", "name", "xpeer", "netns", ext_ns)
    _sh("ip", "-n", name, "addr", "add", "10.77.0.0/31", "dev", veth)
    _sh("ip", "-n", name, "addr", "add", "198.51.100.1/24", "dev", "uplink")
    _sh("ip", "-n", slot_ns, "addr", "add", "10.77.0.1/31", "dev", "vpeer")
    _sh("ip", "-n", ext_ns, "addr", "add", f"{EXT}/24", "dev", "xpeer")
    for ns, dev in ((name, veth), (name, "uplink"), (slot_ns, "vpeer"), (ext_ns, "xpeer")):
        _sh("ip", "-n", ns, "link", "set", dev, "up")
    _sh("ip", "-n", slot_ns, "route", "add", "default", "via", "10.77.0.0")
    _sh("ip", "-n", ext_ns, "route", "add", "10.77.0.0/24", "via", "198.51.100.1")  # a LAN host that routes the pool
    _sh("ip", "netns", "exec", name, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
    with inside(name):
        host_table.install(prefix, POOL, (veth,))
    return slot_ns, ext_ns


def _connects(ns: str, address: str, port: int) -> bool:
    code = f"import socket; socket.create_connection(('{address}', {port}), 2)"
    return subprocess.run(["ip", "netns", "exec", ns, "python3", "-c", code], capture_output=True).returncode == 0


@pytest.mark.parametrize("tool", TOOLS)
def test_a_slot_passes_dockers_drop_and_the_nodes_drops_hold(host, tool):
    name, prefix = host
    slot_ns, ext_ns = _world(name, prefix)
    servers = [subprocess.Popen(["ip", "netns", "exec", ns, "python3", "-m", "http.server", "--bind", address, "80"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/tmp")
               for ns, address in ((ext_ns, EXT), (slot_ns, "10.77.0.1"))]
    try:
        deadline = time.monotonic() + 20
        while not (_connects(ext_ns, EXT, 80) and _connects(slot_ns, "10.77.0.1", 80)):
            assert time.monotonic() < deadline, "the test's servers did not start"
            time.sleep(0.1)
        assert _connects(slot_ns, EXT, 80)  # the node's table alone: egress works
        with inside(name):
            docker_shape(tool)
        assert not _connects(slot_ns, EXT, 80)  # the bug: Docker's FORWARD drop wins over the node's accept
        with inside(name):
            assert host_firewall.ensure(prefix, POOL)[tool] == "DOCKER-USER"
        assert _connects(slot_ns, EXT, 80)
        # DOCKER-USER accepts traffic to the slot, yet the node's table still refuses new flows into it
        assert not _connects(ext_ns, "10.77.0.1", 80)
        with inside(name):
            host_firewall.remove(prefix)
        assert not _connects(slot_ns, EXT, 80)
    finally:
        for server in servers:
            server.kill()
            server.wait(timeout=10)


def test_the_slot_pool_keeps_them_and_removes_them_at_stop(host, monkeypatch):
    """At node start, after Docker recreates its chain (the periodic check), and at stop."""
    name, prefix = host
    monkeypatch.setattr(host_firewall, "RECHECK", 0.2)
    with inside(name):
        docker_shape("iptables-nft")
        pool = SlotPool(prefix, POOL, warm=0)
        try:
            pool.adopt(set())
            assert len(ours("iptables-nft", prefix)) == 2
            pool.start()
            docker_restart("iptables-nft")
            deadline = time.monotonic() + 10
            while len(ours("iptables-nft", prefix)) != 2:
                assert time.monotonic() < deadline, "the pool did not put the accepts back"
                time.sleep(0.05)
            time.sleep(1)  # several more checks: still once
            assert len(ours("iptables-nft", prefix)) == 2
        finally:
            pool.close()
        assert ours("iptables-nft", prefix) == []
        host_table.remove(prefix)


def test_a_native_nftables_filter_table_is_reported_not_misread(host):
    """An ``ip filter`` table of nftables' own (not iptables'): iptables-nft lists it as
    policy ACCEPT; the node says it cannot help there instead of believing that."""
    name, prefix = host
    with inside(name):
        subprocess.run(["nft", "-f", "-"], check=True, text=True, input=(
            "table ip filter {\n chain forward { type filter hook forward priority 0; policy drop; }\n}\n"))
        with pytest.raises(host_firewall.HostFirewallError, match="nftables' own"):
            host_firewall.ensure(prefix, POOL)
