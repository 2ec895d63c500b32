"""The node's nftables table for its slots, on real namespaces: nothing a slot starts
reaches the node or another slot, while the node still opens connections into a slot.
Each check is first made without the table, so it can fail."""
import os
import socket
import subprocess
import sys
import threading
import uuid

import pytest
from pyroute2 import IPRoute

from vmm.net import host_firewall, host_table, slots

pytestmark = pytest.mark.skipif(not slots.netns_supported(),
                                reason="needs root, nft (Debian nftables) and nsenter to make network namespaces")

# A /24 of this session's own (one per session and xdist worker, numbered like its AENV_NET_POOL,
# tests/conftest.py), not the default 10.12.0.0/16: a running node's warm slots (scripts/up.sh)
# or another worker's hold the same addresses there, and the root namespace then routes a slot's
# connection to their veth instead of this test's. Nothing else uses 10.14/16.
POOL = f"10.14.{os.environ.get('AENV_NET_POOL', '10.100.0.0/20').split('.')[1]}.0/24"


@pytest.fixture
def two_slots():
    prefix = "ht" + uuid.uuid4().hex[:4]
    a, b = slots.create(slots.Slot(prefix, 1, POOL)), slots.create(slots.Slot(prefix, 2, POOL))
    for slot in (a, b):  # no guest here: let the slot's own address answer instead of DNATing it away
        subprocess.run(slot.nsenter("nft", "flush", "chain", "inet", "aenv", "to_guest"), check=True)
        # the node routes for its slots (IPv4 forwarding is decided per incoming interface,
        # so this host's global ip_forward stays as it is)
        subprocess.run(["sysctl", "-q", "-w", f"net.ipv4.conf.{slot.host_veth}.forwarding=1"], check=True)
    host_firewall.ensure(prefix, POOL)  # past a host FORWARD drop (Docker's): the node's table alone decides
    yield prefix, a, b
    host_table.remove(prefix)
    for slot in (a, b):
        slots.destroy(slot)


def _connect_from(slot, ip: str, port: int) -> bool:
    code = (f"import socket,sys\ns=socket.socket();s.settimeout(1.5)\n"
            f"sys.exit(0 if s.connect_ex(({ip!r},{port}))==0 else 1)")
    return subprocess.run(slot.nsenter(sys.executable, "-c", code), timeout=10).returncode == 0


def _listen(ip: str):
    server = socket.socket()
    server.bind((ip, 0))
    server.listen(8)
    threading.Thread(target=lambda: [server.accept()[0].close() for _ in range(8)], daemon=True).start()
    return server, server.getsockname()[1]


def _listen_in(slot):
    """A listener inside the slot's netns on its own address (stands in for a guest port)."""
    code = (f"import socket\ns=socket.socket();s.bind(({slot.address!r},0));s.listen(8)\n"
            f"print(s.getsockname()[1],flush=True)\nwhile True: s.accept()[0].close()")
    proc = subprocess.Popen(slot.nsenter(sys.executable, "-c", code), stdout=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline())


def test_a_slot_cannot_reach_the_node(two_slots):
    prefix, a, _ = two_slots
    server, port = _listen("0.0.0.0")  # like Redis or the API on every host address
    try:
        assert _connect_from(a, a.host_ip, port)  # without the table the node is open
        host_table.install(prefix, POOL, (a.host_veth,))
        assert not _connect_from(a, a.host_ip, port)
    finally:
        server.close()


def test_slots_cannot_reach_each_other_but_the_node_reaches_them(two_slots):
    prefix, a, b = two_slots
    proc, port = _listen_in(b)
    try:
        assert _connect_from(a, b.address, port)  # without the table slot to slot works
        host_table.install(prefix, POOL, (a.host_veth,))
        host_table.add_veth(prefix, b.host_veth)
        assert not _connect_from(a, b.address, port)
        with socket.create_connection((b.address, port), timeout=2):  # the node opens, replies come back
            pass
        host_table.remove_veth(prefix, a.host_veth)
        host_table.remove_veth(prefix, b.host_veth)
        assert _connect_from(a, b.address, port)  # the set is what the rules apply to
    finally:
        proc.kill()
        proc.wait()


def test_install_is_whole_and_remove_is_clean(two_slots):
    prefix, a, b = two_slots
    host_table.install(prefix, POOL, (a.host_veth,))
    host_table.install(prefix, POOL, (b.host_veth,), dns_ip="192.0.2.1")  # rebuilt, not appended
    listed = subprocess.run(["nft", "list", "table", "inet", host_table.table_name(prefix)],
                            capture_output=True, text=True, check=True).stdout
    assert b.host_veth in listed and a.host_veth not in listed and "192.0.2.1" in listed
    assert listed.count("masquerade") == 1
    assert host_table.remove(prefix) is True and host_table.remove(prefix) is False
    with pytest.raises(host_table.HostTableError):
        host_table.add_veth(prefix, a.host_veth)
    with IPRoute() as ipr:
        assert ipr.link_lookup(ifname=a.host_veth)  # the slots themselves are untouched
