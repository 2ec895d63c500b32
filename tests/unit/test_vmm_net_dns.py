"""The node's resolver (vmm.net.dns) that every guest shares (issue 21): it runs as an
unprivileged user, reads its extra names from a hosts dir under a private (0700) home, keeps
no cache (one guest cannot learn which names another looked up), and each slot's table
limits what one guest may take of it. The real-dnsmasq tests forward to an upstream of the
test's own on loopback, never to the machine's resolvers."""
import os
import shutil
import socket
import struct
import subprocess
import tempfile
import threading
import uuid
from pathlib import Path

import pytest

from harness.networld import dns_ask as ask
from vmm.net import mount_scope, slots
from vmm.net.dns import DNSLimits, NodeDNS

root_only = pytest.mark.skipif(not slots.netns_supported(), reason="needs root, nft and nsenter (netns backend)")

_SECOND = os.environ.get("AENV_NET_POOL", "10.100.0.0/20").split(".")[1]
# A /24 of this session's own (numbered like its AENV_NET_POOL, tests/conftest.py): only its
# base + 1 is used, for the resolver on lo. Nothing else uses 10.15/16.
POOL = f"10.15.{_SECOND}.0/24"
UPSTREAM = f"127.53.{_SECOND}.1"  # the test's own upstream resolver (loopback)
TTL = 300


class Upstream:
    """A resolver that answers every A query with 192.0.2.99 and a full TTL, counting queries."""

    def __init__(self, address: str):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((address, 53))
        self.sock.settimeout(0.2)
        self.seen: list[bytes] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self._stop.is_set():
            try:
                data, peer = self.sock.recvfrom(4096)
            except TimeoutError:
                continue
            end = 12
            while data[end]:
                end += data[end] + 1
            question = data[12:end + 5]
            self.seen.append(question)
            header = data[:2] + struct.pack(">HHHHH", 0x8180, 1, 1, 0, 0)
            answer = b"\xc0\x0c" + struct.pack(">HHIH", 1, 1, TTL, 4) + socket.inet_aton("192.0.2.99")
            self.sock.sendto(header + question + answer, peer)

    def close(self):
        self._stop.set()
        self.thread.join(timeout=5)
        self.sock.close()


def test_limits_are_checked():
    assert DNSLimits() == DNSLimits(rate=200, burst=400, tcp=4, forward_max=4096)
    for bad in ({"rate": 0}, {"burst": -1}, {"tcp": True}, {"forward_max": "9"}, {"rate": 10**9}):
        with pytest.raises(ValueError, match="AENV_NET_DNS_"):
            DNSLimits(**bad)


def test_argv_unprivileged_no_cache_and_forward_capacity(tmp_path):
    argv = NodeDNS("p", POOL, tmp_path, DNSLimits(forward_max=777)).argv()
    assert "--cache-size=0" in argv and "--dns-forward-max=777" in argv
    user = next(a for a in argv if a.startswith("--user="))
    assert user in ("--user=dnsmasq", "--user=nobody")
    assert "--hostsdir=/run/aenv-dns/p" in argv  # hosts_dir as dnsmasq sees it (its own mount namespace)


def test_slot_ruleset_limits_each_guests_dns():
    slot = slots.Slot("p", 3, POOL)
    rules = slots.ruleset(slot, dns_ip="10.15.0.1", dns_limits=DNSLimits(rate=50, burst=70, tcp=2))
    chain = rules[rules.index("chain dns_limits"):]
    chain = chain[:chain.index("\n    }")]
    assert "ip daddr 8.8.8.8 meta l4proto { tcp, udp } th dport 53 limit rate over 50/second burst 70 packets drop" in chain
    assert "ip daddr 8.8.8.8 tcp dport 53 ct state new ct count over 2 reject with tcp reset" in chain
    assert "chain dns_limits" not in slots.ruleset(slot, dns_ip=None)  # no resolver, no DNS at all


@pytest.fixture
def resolver(tmp_path):
    """A NodeDNS whose state dir sits under a 0700 directory (a private home), forwarding to
    the test's upstream."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    shared = Path(tempfile.mkdtemp(prefix="aenv-dns-test-"))  # dnsmasq reads it as its own user
    shared.chmod(0o755)
    resolv = shared / "resolv.conf"
    resolv.write_text(f"nameserver {UPSTREAM}\n")
    resolv.chmod(0o644)
    upstream = Upstream(UPSTREAM)
    dns = NodeDNS("dt" + uuid.uuid4().hex[:4], POOL, private / "net", resolv_file=str(resolv))
    try:
        dns.ensure()
        yield dns, upstream
    finally:
        dns.stop()
        upstream.close()
        shutil.rmtree(shared, ignore_errors=True)


@root_only
def test_resolver_runs_unprivileged_and_reads_a_private_hosts_dir(resolver):
    dns, _ = resolver
    status = Path(f"/proc/{dns.pid()}/status").read_text()
    uids = next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1:]
    assert uids and all(uid != "0" for uid in uids), status
    (dns.hosts_dir / "names").write_text("192.0.2.7 mirror.test\n")  # picked up by itself (inotify)
    for _ in range(50):
        try:
            assert ask(dns.ip, "mirror.test", timeout=0.2)[0] == "192.0.2.7"
            break
        except (TimeoutError, AssertionError):
            continue
    else:
        pytest.fail("dnsmasq does not answer a name of its hosts dir")
    dns.ensure()  # a node start keeps the one it finds when its command line is the wanted one
    assert dns.running()


@root_only
def test_no_answer_comes_from_another_guests_lookup(resolver):
    """Guest A looks a name up, then guest B (another source address): B's answer comes from
    upstream again, with its full TTL, so B cannot tell that A looked it up."""
    dns, upstream = resolver
    name = f"secret-{uuid.uuid4().hex[:8]}.example"
    first = ask(dns.ip, name, source="127.0.0.1")
    second = ask(dns.ip, name, source=dns.ip)
    assert first == second == ("192.0.2.99", TTL)
    assert len(upstream.seen) == 2, "the second lookup was answered from a cache"


@root_only
def test_an_old_resolver_is_replaced(resolver):
    """A node start after an upgrade: a dnsmasq started with other options (e.g. as root) is
    stopped and started again with the wanted ones."""
    dns, _ = resolver
    before = dns.pid()
    dns.limits = DNSLimits(forward_max=99)
    dns.ensure()
    assert dns.pid() != before and "--dns-forward-max=99" in Path(f"/proc/{dns.pid()}/cmdline").read_text()


@root_only
def test_the_resolver_holds_none_of_the_nodes_other_mounts(tmp_path, request):
    """A mount of the node made before the resolver starts (a volume's image) is not copied
    into the resolver's namespace for good: unmounted by the node, it is gone, not held (a
    private root mount propagates nothing). The resolver still has what it needs."""
    volume = tmp_path / "volume"
    volume.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "aenv-test-volume", str(volume)], check=True)
    try:
        dns, _ = request.getfixturevalue("resolver")
        seen = mount_scope.mount_points(Path(f"/proc/{dns.pid()}/mountinfo").read_text())
        assert str(volume) not in seen, seen
        assert str(dns.mount_point) in seen and "/proc" in seen
        assert ask(dns.ip, "name.example", timeout=2)[0] == "192.0.2.99"  # it still forwards
    finally:
        subprocess.run(["umount", "-l", str(volume)], check=False)


def test_mount_scope_detaches_only_the_topmost_mounts_holding_nothing_needed():
    points = ["/", "/proc", "/sys/fs/cgroup", "/dev/shm", "/tmp", "/tmp/a/vol", "/var/lib/aenv",
              "/var/lib/aenv/volumes/t/v", "/var/lib/aenv/volumes/t/v/inner", "/run", "/run/aenv-dns/p"]
    needed = ["/var/lib/aenv/net", "/run/aenv-dns/p", "/etc"]
    assert mount_scope.detachable(points, needed) == ["/tmp", "/var/lib/aenv/volumes/t/v"]


def test_mount_scope_reads_escaped_mount_points():
    line = "36 35 7:0 / /tmp/with\\040space rw,relatime - ext4 /dev/loop0 rw\n"
    assert mount_scope.mount_points(line) == ["/tmp/with space"]
