"""Ingress sources of the node's table (``AENV_NET_INGRESS_FROM``), on real namespaces: a
gateway namespace G (standing for a data plane on another host, or the root namespace of
``scripts/cluster.sh``) is joined to the node by a veth. From a listed source of G a
connection into a slot works; from an unlisted one it does not; a slot never reaches G.
Each check is first made without the table or the listing, so it can fail. G's addresses
are in 198.18/15, outside the always-denied ranges, so only the ingress rules decide."""
import subprocess
import sys
import uuid

import pytest

from vmm.net import host_firewall, host_table, slots
from vmm.net.netns import NetnsBackend

# One xdist group: every test here puts the same addresses (POOL's slot 1, NODE_SIDE) on the
# root namespace, so two at once on two workers would answer each other's connections.
pytestmark = [pytest.mark.skipif(not slots.netns_supported(),
                                 reason="needs root, nft (Debian nftables) and nsenter to make network namespaces"),
              pytest.mark.xdist_group("net-ingress")]

POOL = "10.215.0.0/24"
NODE_SIDE, LISTED, UNLISTED = "198.18.7.2", "198.18.7.1", "198.18.7.3"


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


@pytest.fixture
def world():
    """Slot 1 of a prefix of its own (its own address answering: no guest here), and G."""
    prefix = "gi" + uuid.uuid4().hex[:4]
    gateway, veth = f"{prefix}g", f"{prefix}gw"
    slot = slots.create(slots.Slot(prefix, 1, POOL))
    subprocess.run(slot.nsenter("nft", "flush", "chain", "inet", "aenv", "to_guest"), check=True)
    try:
        _sh("sysctl", "-q", "-w", f"net.ipv4.conf.{slot.host_veth}.forwarding=1")
        _sh("ip", "netns", "add", gateway)
        _sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "gpeer", "netns", gateway)
        _sh("ip", "addr", "add", f"{NODE_SIDE}/29", "dev", veth)
        _sh("ip", "link", "set", veth, "up")
        _sh("sysctl", "-q", "-w", f"net.ipv4.conf.{veth}.forwarding=1")
        for cmd in (("ip", "link", "set", "lo", "up"), ("ip", "addr", "add", f"{LISTED}/29", "dev", "gpeer"),
                    ("ip", "addr", "add", f"{UNLISTED}/29", "dev", "gpeer"), ("ip", "link", "set", "gpeer", "up"),
                    ("ip", "route", "add", POOL, "via", NODE_SIDE)):
            _sh("ip", "netns", "exec", gateway, *cmd)
        host_firewall.ensure(prefix, POOL)  # past a host FORWARD drop (Docker's): the node's table alone decides
        yield prefix, slot, gateway
    finally:
        host_table.remove(prefix)
        slots.destroy(slot)
        subprocess.run(["ip", "link", "del", veth], capture_output=True)
        subprocess.run(["ip", "netns", "del", gateway], capture_output=True)


def _connect(argv_prefix: list[str], ip: str, port: int, source: str | None = None) -> bool:
    bind = f"s.bind(({source!r},0))\n" if source else ""
    code = (f"import socket,sys\ns=socket.socket();s.settimeout(1.5)\n{bind}"
            f"sys.exit(0 if s.connect_ex(({ip!r},{port}))==0 else 1)")
    return subprocess.run([*argv_prefix, sys.executable, "-c", code], timeout=10).returncode == 0


def _listen(argv_prefix: list[str], ip: str) -> tuple[subprocess.Popen, int]:
    code = (f"import socket\ns=socket.socket();s.bind(({ip!r},0));s.listen(8)\n"
            f"print(s.getsockname()[1],flush=True)\nwhile True: s.accept()[0].close()")
    proc = subprocess.Popen([*argv_prefix, sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline())


def test_a_listed_gateway_opens_connections_into_a_slot_an_unlisted_one_cannot(world):
    prefix, slot, gateway = world
    in_gateway = ["ip", "netns", "exec", gateway]
    proc, port = _listen(slot.nsenter(), slot.address)
    try:
        assert _connect(in_gateway, slot.address, port, LISTED)  # no table: open to anyone
        host_table.install(prefix, POOL, (slot.host_veth,))
        assert not _connect(in_gateway, slot.address, port, LISTED)  # today's rule: only the node
        host_table.install(prefix, POOL, (slot.host_veth,), ingress=(f"{LISTED}/32",))
        assert _connect(in_gateway, slot.address, port, LISTED)
        assert not _connect(in_gateway, slot.address, port, UNLISTED)
        assert _connect([], slot.address, port)  # the node itself still does
    finally:
        proc.kill()
        proc.wait()


def test_a_slot_never_reaches_a_gateway(world):
    prefix, slot, gateway = world
    proc, port = _listen(["ip", "netns", "exec", gateway], LISTED)
    try:
        host_table.install(prefix, POOL, (slot.host_veth,))
        assert _connect(slot.nsenter(), LISTED, port)  # not listed: G is just another host out there
        host_table.install(prefix, POOL, (slot.host_veth,), ingress=(f"{LISTED}/32",))
        assert not _connect(slot.nsenter(), LISTED, port)
    finally:
        proc.kill()
        proc.wait()


def test_slots_deny_the_ingress_sources_too(tmp_path):
    """A slot made by the backend has the sources in the set its guest may never reach."""
    backend = NetnsBackend(tmp_path, prefix="gi" + uuid.uuid4().hex[:4], pool=POOL, warm=0, dns=False,
                           ingress_from=(LISTED, "198.19.0.0/16"))
    assert backend.ingress_from == (f"{LISTED}/32", "198.19.0.0/16")
    assert {f"{LISTED}/32", "198.19.0.0/16"} <= set(backend.slots.deny_extra)
    assert backend.slots.ingress == backend.ingress_from


@pytest.mark.parametrize("bad, words", [
    ("0.0.0.0/0", "overlaps the slot pool"), ("10.215.0.128/25", "overlaps the slot pool"),
    ("169.254.0.22", "guests' side"), ("fd00::1", "not IPv4"), ("gateway", "not an IPv4 address"),
])
def test_a_source_that_could_be_a_guest_is_refused(bad, words):
    with pytest.raises(host_table.HostTableError, match=words):
        host_table.ruleset("gix", POOL, ingress=(bad,))


def test_the_ruleset_lists_the_sources():
    text = host_table.ruleset("gix", POOL, ingress=("198.18.7.1", "198.18.7.1/32", "192.0.2.0/24"))
    assert "elements = { 198.18.7.1/32, 192.0.2.0/24 }" in text
    assert "ingress {" in host_table.ruleset("gix", POOL) and "elements" not in host_table.ruleset("gix", POOL)
