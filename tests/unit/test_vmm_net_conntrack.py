"""Guests' conntrack limits (vmm.net.conntrack) and the ranges no guest reaches (vmm.net.slots):
the rules as text everywhere; as root, on real namespaces, a stand-in guest (a netns joined to
a real slot by a veth named tap0, in place of QEMU's tap) that holds its limit of connections
to a listener on the node: its next one is refused at once, the node's connections into it
and another slot's guest are not, and the node's table holds no more of its flows than the
limit and none once its slot is gone. The VM test: tests/integration/test_network_limits_e2e.py."""
import ipaddress
import subprocess
import sys
import time
import uuid

import pytest

from vmm.net import conntrack, host_table, slots
from vmm.net.conntrack import GuestLimits, LimitsError

netns_only = pytest.mark.skipif(not slots.netns_supported(), reason="needs root, nft and nsenter")

POOL = "10.216.0.0/24"  # this file's own: no other test puts these addresses on the node
OUTSIDE, NODE_SIDE = "198.18.216.1", "198.18.216.2"  # a host out there (a netns of the test's own), the node


def test_the_guard_sends_every_new_flow_through_the_limits_before_any_accept():
    text = slots.ruleset(slots.Slot("aenvq", 1, POOL), dns_ip="10.216.0.1")
    guard = text[text.index("chain guard"):text.index("chain ct_limits")]
    order = [guard.index(r) for r in ("ct state established,related accept", "ct state new jump ct_limits",
                                      "ip daddr @node_deny drop", "ip daddr @user_allow accept")]
    assert order == sorted(order)
    assert "ct count over 4096 jump refuse" in text
    assert "limit rate over 200/second burst 1000 packets jump refuse" in text
    assert "meta l4proto tcp reject with tcp reset" in text and "reject with icmpx admin-prohibited" in text
    small = slots.ruleset(slots.Slot("aenvq", 1, POOL), limits=GuestLimits(50, 20, 7))
    assert "ct count over 50 jump refuse" in small and "limit rate over 20/second burst 7 packets" in small


def test_the_node_table_shortens_the_guests_tcp_timeouts():
    text = host_table.ruleset("aenvq", POOL, ("aenvqv1",))
    assert "policy = { established: 7440, time_wait: 10, close: 10 }" in text
    assert 'iifname @veths ct state new meta l4proto tcp ct timeout set "guest_tcp"' in text


@pytest.mark.parametrize("kwargs, words", [
    ({"max_flows": 0}, "AENV_NET_CT_MAX_PER_SANDBOX=0"), ({"new_rate": -1}, "AENV_NET_CT_NEW_RATE=-1"),
    ({"new_burst": 10**7}, "AENV_NET_CT_NEW_BURST=10000000"), ({"max_flows": "50"}, "AENV_NET_CT_MAX_PER_SANDBOX='50'"),
    ({"max_flows": True}, "AENV_NET_CT_MAX_PER_SANDBOX=True"),
])
def test_limits_that_cannot_be_enforced_are_refused(kwargs, words):
    with pytest.raises(LimitsError, match=words.replace("(", r"\(")):
        GuestLimits(**kwargs)


def test_the_special_purpose_ranges_are_always_denied():
    denied = [ipaddress.ip_network(c) for c in slots.ALWAYS_DENIED]
    for address in ("192.0.0.9", "198.18.0.1", "198.19.255.1", "192.0.2.1", "198.51.100.10", "203.0.113.5",
                    "169.254.169.254", "10.1.2.3", "127.0.0.1"):
        assert any(ipaddress.ip_address(address) in n for n in denied), address
    for address in ("1.1.1.1", "192.0.1.1", "198.17.255.255", "198.20.0.1", "203.0.114.1"):
        assert not any(ipaddress.ip_address(address) in n for n in denied), address


@pytest.mark.parametrize("bad, words", [
    ("169.254.169.254", "the guests' link-local side"), ("169.0.0.0/8", "the guests' link-local side"),
    ("10.216.0.128/25", "the slot pool"), ("10.0.0.0/8", "the slot pool"),
    ("192.0.2.7", "the node's 192.0.2.7/32"), ("fd00::/8", "not IPv4"), ("mirror", "not an IPv4 address"),
])
def test_allow_extra_never_reopens_the_guests_side_the_pool_or_the_node(bad, words):
    with pytest.raises(slots.SlotError, match=f"AENV_NET_ALLOW_EXTRA: .*{words}"):
        slots.allow_extra_ranges((bad,), POOL, ("192.0.2.7/32",))


def test_allow_extra_keeps_other_always_denied_ranges():
    assert slots.allow_extra_ranges(["10.99.0.0/16", " 198.51.100.10 ", "10.99.0.0/16"], POOL,
                                    ("192.0.2.7/32",)) == ("10.99.0.0/16", "198.51.100.10/32")


@netns_only
@pytest.mark.parametrize("bad", ["169.254.169.254/32", "127.0.0.1", POOL])
def test_a_node_refuses_to_start_with_an_allow_extra_that_reopens_them(tmp_path, bad):
    from vmm.net.netns import NetnsBackend  # noqa: PLC0415

    with pytest.raises(slots.SlotError, match="AENV_NET_ALLOW_EXTRA"):
        NetnsBackend(tmp_path, prefix="ck" + uuid.uuid4().hex[:4], pool=POOL, warm=0, dns=False, allow_extra=(bad,))


# -- real namespaces --------------------------------------------------------------------------------


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


def _guest(slot: slots.Slot) -> list[str]:
    """Replaces the slot's tap0 by a veth to a guest netns of the test's own; its argv prefix."""
    name = f"{slot.netns}g"
    _sh("ip", "netns", "add", name)
    inside = ["ip", "netns", "exec", slot.netns]
    for cmd in (["ip", "link", "del", "tap0"],
                ["ip", "link", "add", "tap0", "address", slots.GATEWAY_MAC, "type", "veth", "peer", "name", "eth0",
                 "address", slots.GUEST_MAC, "netns", name],
                ["ip", "addr", "add", f"{slots.GATEWAY_IP}/{slots.GUEST_PREFIX}", "dev", "tap0"],
                ["ip", "link", "set", "tap0", "up"],
                ["ip", "neigh", "replace", slots.GUEST_IP, "lladdr", slots.GUEST_MAC, "dev", "tap0",
                 "nud", "permanent"]):
        _sh(*inside, *cmd)
    for cmd in (["ip", "link", "set", "lo", "up"], ["ip", "addr", "add", f"{slots.GUEST_IP}/{slots.GUEST_PREFIX}",
                                                    "dev", "eth0"],
                ["ip", "link", "set", "eth0", "up"], ["ip", "route", "add", "default", "via", slots.GATEWAY_IP]):
        _sh("ip", "netns", "exec", name, *cmd)
    return ["ip", "netns", "exec", name]


HOLD = r"""
import socket, sys, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
held, out = [], []
for _ in range(n):
    s = socket.socket(); s.settimeout(5); t = time.monotonic()
    try:
        s.connect((host, port)); held.append(s); out.append("ok")
    except OSError as e:
        out.append(f"{e.errno}:{time.monotonic() - t:.2f}")
print(" ".join(out), flush=True)
sys.stdin.read()  # holds its connections until the test closes stdin
"""


def _hold(argv: list[str], host: str, port: int, n: int) -> tuple[subprocess.Popen, list[str]]:
    proc = subprocess.Popen([*argv, sys.executable, "-c", HOLD, host, str(port), str(n)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().split()


LISTEN = r"""
import selectors, socket, sys
sel = selectors.DefaultSelector(); s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 0)); s.listen(1024); sel.register(s, selectors.EVENT_READ)
print(s.getsockname()[1], flush=True)
while True:
    for key, _ in sel.select():
        if key.fileobj is s:
            sel.register(s.accept()[0], selectors.EVENT_READ)
        elif not key.fileobj.recv(64):
            sel.unregister(key.fileobj); key.fileobj.close()
"""


def _listen(argv: list[str], address: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([*argv, sys.executable, "-c", LISTEN, address], stdout=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline())


@pytest.fixture
def world(slot_prefix):
    """Two slots of a pool of the file's own, each with a stand-in guest, in the node's table
    of the prefix; a host out there (a netns, OUTSIDE) the node routes and masquerades to,
    which both slots may reach (as AENV_NET_ALLOW_EXTRA opens a mirror)."""
    procs, made = [], []
    outside, veth = f"{slot_prefix}x", f"{slot_prefix}xh"
    try:
        for index in (1, 2):
            slot = slots.create(slots.Slot(slot_prefix, index, POOL), allow_extra=(f"{OUTSIDE}/32",),
                                limits=GuestLimits(max_flows=5, new_rate=1000, new_burst=1000))
            made.append((slot, _guest(slot)))
            _sh("sysctl", "-q", "-w", f"net.ipv4.conf.{slot.host_veth}.forwarding=1")
        host_table.install(slot_prefix, POOL, tuple(s.host_veth for s, _ in made))
        _sh("ip", "netns", "add", outside)
        _sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "xpeer", "netns", outside)
        _sh("ip", "addr", "add", f"{NODE_SIDE}/30", "dev", veth)
        _sh("ip", "link", "set", veth, "up")
        _sh("sysctl", "-q", "-w", f"net.ipv4.conf.{veth}.forwarding=1")
        for cmd in (["ip", "link", "set", "lo", "up"], ["ip", "addr", "add", f"{OUTSIDE}/30", "dev", "xpeer"],
                    ["ip", "link", "set", "xpeer", "up"]):
            _sh("ip", "netns", "exec", outside, *cmd)
        listener, port = _listen(["ip", "netns", "exec", outside], OUTSIDE)
        procs.append(listener)
        yield made, port, procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        for slot, _ in made:
            subprocess.run(["ip", "netns", "del", f"{slot.netns}g"], capture_output=True)
        subprocess.run(["ip", "link", "del", veth], capture_output=True)
        subprocess.run(["ip", "netns", "del", outside], capture_output=True)


def _entries(address: str) -> list[str]:
    """The node's conntrack entries whose original source is ``address`` (a slot's guest)."""
    with open("/proc/net/nf_conntrack") as f:
        return [line for line in f if line.split("src=")[1].split()[0] == address]


@netns_only
def test_a_guest_at_its_limit_is_refused_at_once_and_nothing_else_is(world):
    made, port, procs = world
    (slot, guest), (other, other_guest) = made
    holder, results = _hold(guest, OUTSIDE, port, 8)
    procs.append(holder)
    assert results[:5] == ["ok"] * 5, results
    refused = results[5:]
    assert all(r.startswith("111:") and float(r.split(":")[1]) < 1 for r in refused), results  # ECONNREFUSED, at once
    # the node's table holds the guest's five flows (after the slot's SNAT: from its address), no
    # more, and keeps them 2 h 4 min idle at most, not 5 days
    held = [e for e in _entries(slot.address) if "ESTABLISHED" in e]
    assert len(held) == 5 and all(int(e.split()[4]) <= 7440 for e in held), held
    # another slot's guest is not limited by this one
    other_holder, other_results = _hold(other_guest, OUTSIDE, port, 5)
    procs.append(other_holder)
    assert other_results == ["ok"] * 5
    # the node opens as many connections into the limited guest as it likes (they enter at vpeer)
    inside, guest_port = _listen(guest, "0.0.0.0")
    procs.append(inside)
    node_holder, node_results = _hold([], slot.address, guest_port, 20)
    procs.append(node_holder)
    assert node_results == ["ok"] * 20
    # once the guest lets one go, it may open one again
    holder.stdin.close()
    holder.wait(timeout=10)
    again, again_results = _hold(guest, OUTSIDE, port, 1)
    procs.append(again)
    assert again_results == ["ok"]
    # a slot that goes away takes its guest's flows out of the node's table
    assert _entries(slot.address)
    slots.destroy(slot)
    assert conntrack.forget(slot.address) > 0
    assert _entries(slot.address) == []


@netns_only
def test_a_guest_that_opens_connections_too_fast_is_refused_past_its_burst(world):
    made, port, _ = world
    slot, guest = made[0]
    slots.apply_limits(slot, GuestLimits(max_flows=1000, new_rate=5, new_burst=20))
    code = (f"import socket\nok = 0\nfor _ in range(100):\n    s = socket.socket(); s.settimeout(5)\n"
            f"    ok += s.connect_ex(({OUTSIDE!r}, {port})) == 0\n    s.close()\nprint(ok)")
    started = time.monotonic()
    ok = int(subprocess.run([*guest, sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            timeout=60).stdout)
    assert 20 <= ok < 40, ok  # the burst and a few at the rate; the rest refused
    assert time.monotonic() - started < 10  # refused at once, not timed out
