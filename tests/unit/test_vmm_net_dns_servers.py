"""E2B's ``network.dnsServers`` enforced by the slot (vmm.net.policy, vmm.net.slots) on real
namespaces: a stand-in guest (a netns behind a real slot's tap0) asks resolvers of the test's
own on the external host (harness.networld: EXT_A, EXT_B, and a private address) and a
stand-in for the node's resolver (what the slot sends 8.8.8.8:53 to). Each resolver answers
every query with its own address, so an answer says which server gave it. A policy that
denies everything drops DNS to EXT_A until dnsServers names it; then DNS (UDP, TCP, and a TCP
connection on 853) passes while port 80 of the same address, and the other resolvers, stay
denied; a domain sandbox gets E2B's default (8.8.8.8, the node's resolver), none for ``[]``,
or its list (TCP DNS not handed to the egress proxy); a private resolver stays unreachable
unless the operator reopened its range; and the node resolver's per-guest limits hold for
listed resolvers too. The API side (400 for a private entry, what the node is told) is in
test_api_network.py; a real guest in tests/integration/test_egress_domains.py."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.networld import EXT_A, EXT_B, ExternalHost
from tests.unit.test_vmm_net_conntrack import _guest
from vmm.net import host_table, slots
from vmm.net.dns import DNSLimits, _on_lo, service_ip
from vmm.net.netns import egress_of
from vmm.net.spec import NetworkSpec

# one worker with the egress proxy's tests: the external host (the run's external /24) exists once at a time
pytestmark = [pytest.mark.xdist_group("egress_proxy"),
              pytest.mark.skipif(not slots.netns_supported(), reason="needs root, nft and nsenter")]

REPO = Path(__file__).resolve().parents[2]
_SECOND = os.environ.get("AENV_NET_POOL", "10.100.0.0/20").split(".")[1]
POOL = f"10.19.{_SECOND}.0/24"  # this file's own (nothing else uses 10.19/16)
NODE_DNS = service_ip(POOL)  # where the slot sends the guest's 8.8.8.8:53
PRIVATE = f"172.31.{_SECOND}.53"  # a resolver in an always-denied range, on the external host
# what each resolver answers for any name
ANSWER = {NODE_DNS: "192.0.2.8", EXT_A: "192.0.2.10", EXT_B: "192.0.2.20", PRIVATE: "192.0.2.31"}
DENY_ALL = NetworkSpec(allow_internet_access=False)
DOMAINS = NetworkSpec(allow_out=("good.test",), deny_out=("0.0.0.0/0",))

RESOLVER = r'''
import socket, struct, sys, threading
address, answer = sys.argv[1], socket.inet_aton(sys.argv[2])

def reply(query):
    end = 12
    while query[end]:
        end += query[end] + 1
    question = query[12:end + 5]
    return (query[:2] + struct.pack(">HHHHH", 0x8180, 1, 1, 0, 0) + question
            + b"\xc0\x0c" + struct.pack(">HHIH", 1, 1, 60, 4) + answer)

def udp():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind((address, 53))
    while True:
        data, peer = s.recvfrom(4096)
        s.sendto(reply(data), peer)

def conn(c):
    with c:
        while True:
            head = c.recv(2, socket.MSG_WAITALL)
            if len(head) < 2:
                return
            c.sendall(struct.pack(">H", len(r := reply(c.recv(struct.unpack(">H", head)[0], socket.MSG_WAITALL))))
                      + r)

def tcp(port):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((address, port))
    s.listen(64)
    while True:
        threading.Thread(target=conn, args=(s.accept()[0],), daemon=True).start()

threading.Thread(target=udp, daemon=True).start()
threading.Thread(target=tcp, args=(853,), daemon=True).start()
print("ready", flush=True)
tcp(53)
'''

# run in the guest: each probe at once; a DNS answer's address, "open", "refused" or "-" (nothing)
PROBE = r'''
import json, socket, sys
from concurrent.futures import ThreadPoolExecutor
from harness.networld import dns_ask

def one(probe):
    kind, address, port = probe
    try:
        if kind == "connect":
            socket.create_connection((address, port), timeout=5).close()
            return "open"
        return dns_ask(address, "any.test", tcp=kind == "tcp", timeout=5)[0]
    except ConnectionRefusedError:
        return "refused"
    except Exception:
        return "-"

probes = json.loads(sys.argv[1])
with ThreadPoolExecutor(len(probes)) as pool:
    print(json.dumps(list(pool.map(one, probes))))
'''


def _start(argv: list[str], address: str) -> subprocess.Popen:
    proc = subprocess.Popen([*argv, sys.executable, "-c", RESOLVER, address, ANSWER[address]],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready", f"the resolver on {address} did not start"
    return proc


@pytest.fixture(scope="module")
def resolvers():
    """The external host with a resolver on EXT_A, EXT_B and PRIVATE (routed from the node
    like the rest of it), and one standing in for the node's on NODE_DNS."""
    ext = ExternalHost(name=f"aenvdnx{os.getpid() % 100000}").start()
    procs = []
    try:
        inside = ["ip", "netns", "exec", ext.name]
        subprocess.run([*inside, "ip", "addr", "add", f"{PRIVATE}/32", "dev", "xpeer"], check=True)
        subprocess.run(["ip", "route", "replace", f"{PRIVATE}/32", "dev", ext.veth], check=True)
        procs += [_start(inside, a) for a in (EXT_A, EXT_B, PRIVATE)]
        _on_lo(NODE_DNS, True)
        procs.append(_start([], NODE_DNS))
        yield ext
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        _on_lo(NODE_DNS, False)
        subprocess.run(["ip", "route", "del", f"{PRIVATE}/32"], capture_output=True)
        ext.stop()


@pytest.fixture
def world(resolvers, slot_prefix):
    """``make(index, reopened, limits)``: a slot of the prefix with a stand-in guest, the
    external addresses ``reopened`` (AENV_NET_ALLOW_EXTRA: 198.19/16 is always denied, so the
    policy alone decides), in the node's table; returns (slot, the guest's argv prefix)."""
    made = []

    def make(index: int, reopened=(EXT_A, EXT_B), limits: DNSLimits = DNSLimits()):
        slot = slots.create(slots.Slot(slot_prefix, index, POOL), dns_ip=NODE_DNS,
                            allow_extra=tuple(f"{a}/32" for a in reopened), dns_limits=limits)
        made.append(slot)
        guest = _guest(slot)
        subprocess.run(["sysctl", "-q", "-w", f"net.ipv4.conf.{slot.host_veth}.forwarding=1"], check=True)
        host_table.install(slot_prefix, POOL, tuple(s.host_veth for s in made), NODE_DNS)
        return slot, guest

    try:
        yield make
    finally:
        for slot in made:
            subprocess.run(["ip", "netns", "del", f"{slot.netns}g"], capture_output=True)


def probe(guest: list[str], *probes: tuple[str, str, int]) -> list[str]:
    done = subprocess.run([*guest, sys.executable, "-c", PROBE, json.dumps(probes)], capture_output=True, text=True,
                          timeout=60, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def udp(address):
    return ("udp", address, 53)


def tcp(address):
    return ("tcp", address, 53)


def connect(address, port):
    return ("connect", address, port)


def test_a_listed_resolver_gets_dns_through_a_deny_all_policy_and_nothing_else_does(world):
    slot, guest = world(1)
    asked = (udp(EXT_A), tcp(EXT_A), connect(EXT_A, 853), connect(EXT_A, 80), udp(EXT_B), udp("8.8.8.8"))
    slots.apply_policy(slot, egress_of(NetworkSpec()))
    assert probe(guest, *asked) == [ANSWER[EXT_A], ANSWER[EXT_A], "open", "open", ANSWER[EXT_B], ANSWER[NODE_DNS]]
    slots.apply_policy(slot, egress_of(DENY_ALL))
    assert probe(guest, *asked) == ["-"] * 6
    slots.apply_policy(slot, egress_of(NetworkSpec(allow_internet_access=False, dns_servers=(EXT_A,))))
    # DNS and DNS over TLS to EXT_A only; its port 80 is still judged by the policy (denied)
    assert probe(guest, *asked) == [ANSWER[EXT_A], ANSWER[EXT_A], "open", "-", "-", "-"]
    slots.apply_policy(slot, egress_of(DENY_ALL))  # an update without it takes it back
    assert probe(guest, udp(EXT_A), tcp(EXT_A)) == ["-", "-"]


def test_a_domain_sandbox_gets_e2bs_default_none_or_its_own_list(world):
    slot, guest = world(2)
    asked = (udp("8.8.8.8"), tcp("8.8.8.8"), udp(EXT_A), tcp(EXT_A), connect(EXT_A, 853), udp(EXT_B))
    slots.apply_policy(slot, egress_of(DOMAINS))  # 8.8.8.8 (the node's resolver) and no other
    assert probe(guest, *asked) == [ANSWER[NODE_DNS], ANSWER[NODE_DNS], "-", "-", "-", "-"]
    slots.apply_policy(slot, egress_of(NetworkSpec(allow_out=DOMAINS.allow_out, deny_out=DOMAINS.deny_out,
                                                   dns_servers=())))
    assert probe(guest, *asked) == ["-"] * 6
    listed = NetworkSpec(allow_out=DOMAINS.allow_out, deny_out=DOMAINS.deny_out, dns_servers=(EXT_A,))
    slots.apply_policy(slot, egress_of(listed))
    # TCP DNS reaches EXT_A itself (not the egress proxy, not the node's resolver); port 80 of
    # EXT_A is sent to the egress proxy's port like any TCP of a domain sandbox (none listens here)
    assert probe(guest, *asked, connect(EXT_A, 80)) == ["-", "-", ANSWER[EXT_A], ANSWER[EXT_A], "open", "-",
                                                          "refused"]


def test_a_private_resolver_stays_unreachable_unless_the_operator_reopened_its_range(world):
    spec = NetworkSpec(allow_internet_access=False, dns_servers=(PRIVATE,))
    slot, guest = world(3)
    slots.apply_policy(slot, egress_of(spec))
    reopened, control = world(4, reopened=(PRIVATE,))
    slots.apply_policy(reopened, egress_of(spec))
    assert probe(guest, udp(PRIVATE), tcp(PRIVATE)) == ["-", "-"]
    assert probe(control, udp(PRIVATE), tcp(PRIVATE)) == [ANSWER[PRIVATE]] * 2  # the resolver is there


HOLD = r'''
import socket, sys
held, out = [], []
for _ in range(int(sys.argv[2])):
    s = socket.socket(); s.settimeout(5)
    try:
        s.connect((sys.argv[1], 53)); held.append(s); out.append("ok")
    except ConnectionRefusedError:
        out.append("refused")
    except OSError:
        out.append("-")
print(" ".join(out), flush=True)
'''

BURST = r'''
import os, socket, struct, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(0.3)
query = struct.pack(">HHHHHH", 1, 0x0100, 1, 0, 0, 0) + b"\x03any\x04test\x00" + struct.pack(">HH", 1, 1)
for _ in range(int(sys.argv[2])):
    s.sendto(query, (sys.argv[1], 53))
got, end = 0, time.monotonic() + 3
while time.monotonic() < end:
    try:
        s.recv(512); got += 1
    except TimeoutError:
        pass
print(got)
'''


def test_listed_resolvers_are_held_to_the_node_resolvers_per_guest_limits(world):
    spec = egress_of(NetworkSpec(allow_internet_access=False, dns_servers=(EXT_A,)))
    slot, guest = world(5, limits=DNSLimits(rate=1000, burst=1000, tcp=2))
    slots.apply_policy(slot, spec)
    answers = subprocess.run([*guest, sys.executable, "-c", HOLD, EXT_A, "3"], capture_output=True, text=True,
                             timeout=60).stdout.split()
    assert answers == ["ok", "ok", "refused"]  # the third TCP connection at once is reset
    slow, slow_guest = world(6, limits=DNSLimits(rate=1, burst=4, tcp=4))
    slots.apply_policy(slow, spec)
    got = int(subprocess.run([*slow_guest, sys.executable, "-c", BURST, EXT_A, "40"], capture_output=True, text=True,
                             timeout=60).stdout)
    assert 1 <= got <= 10, got  # a burst of 40 queries: the burst and a few more per second
