"""Network slots on real network namespaces (root, nft): one netns per sandbox with tap0,
the veth pair, the guest's fixed view, the slot's nftables table; the name is the claim;
a failed or crashed setup leaves nothing behind."""
import os
import shutil
import subprocess

import pytest
from pyroute2 import IPRoute, NetNS, netns

from vmm.net import slots

pytestmark = pytest.mark.skipif(not slots.netns_supported(),
                                reason="needs root, nft (Debian nftables) and nsenter to make network namespaces")


@pytest.fixture
def prefix(slot_prefix):
    return slot_prefix


def _in(slot, *argv) -> str:
    return subprocess.run(slot.nsenter(*argv), capture_output=True, text=True, check=True).stdout


def test_a_slot_gives_the_guest_the_fixed_view_and_the_node_its_own_address(prefix):
    slot = slots.create(slots.Slot(prefix, 3))
    assert (slot.host_ip, slot.address) == ("10.12.0.6", "10.12.0.7")
    with NetNS(slot.netns) as ns:
        tap = ns.get_links(ns.link_lookup(ifname="tap0")[0])[0]
        assert tap.get_attr("IFLA_ADDRESS") == slots.GATEWAY_MAC
        addrs = {(a.get_attr("IFA_LABEL"), a.get_attr("IFA_ADDRESS")) for a in ns.get_addr(family=2)}
        assert {("tap0", slots.GATEWAY_IP), ("vpeer", slot.address)} <= addrs
        neigh = [n for n in ns.get_neighbours(dst=slots.GUEST_IP)]
        assert neigh and neigh[0].get_attr("NDA_LLADDR") == slots.GUEST_MAC
    assert "default via 10.12.0.6 dev vpeer" in _in(slot, "ip", "route")
    assert _in(slot, "sysctl", "-n", "net.ipv4.ip_forward").strip() == "1"
    table = _in(slot, "nft", "list", "table", "inet", "aenv")
    for rule in ('ip saddr != 169.254.0.21 drop', "ip daddr @always_deny ip daddr != @site_allow drop",
                 "ip daddr @node_deny drop", "ip daddr @user_allow accept", "ip daddr @user_deny drop",
                 'ip daddr 8.8.8.8 udp dport 53 dnat ip to 192.0.2.1',
                 f"ip daddr {slot.address} dnat ip to 169.254.0.21", f"snat ip to {slot.address}",
                 'iifname "tap0" drop', "127.0.0.0/8", "10.0.0.0/8", "169.254.0.0/16"):
        assert rule in table, rule
    with IPRoute() as ipr:
        host = ipr.get_links(ipr.link_lookup(ifname=slot.host_veth)[0])[0]
        assert host["flags"] & 1  # IFF_UP (operstate follows a moment later, asynchronously)
    assert slots.destroy(slot) is True
    assert slots.list_slots(prefix) == [] and slots.stray_veths(prefix) == []
    assert slots.destroy(slot) is False


def zombie_children() -> list[str]:
    """This process's children that exited and were never reaped."""
    out = subprocess.run(["ps", "--ppid", str(os.getpid()), "-o", "pid=,stat="], capture_output=True,
                         text=True).stdout
    return [line for line in out.splitlines() if line.split()[1].startswith("Z")]


def test_the_name_is_the_claim(prefix):
    first = slots.create(slots.Slot(prefix, 1))
    before = zombie_children()
    with pytest.raises(slots.SlotError, match="taken"):
        slots.create(slots.Slot(prefix, 1))
    assert slots.list_slots(prefix) == [first]  # the first one is untouched
    assert "tap0" in _in(first, "ip", "-br", "link")
    # pyroute2 leaves the child it forks unreaped when the name exists: never tried then
    assert zombie_children() == before


def test_a_failed_setup_leaves_nothing(prefix):
    with pytest.raises(slots.SlotError, match="nft"):
        slots.create(slots.Slot(prefix, 2), deny_extra=("not-a-cidr",))
    assert slots.list_slots(prefix) == [] and slots.stray_veths(prefix) == []


def test_a_restarted_node_finds_its_slots_and_stray_veths(prefix):
    kept = slots.create(slots.Slot(prefix, 4))
    crashed = slots.create(slots.Slot(prefix, 5))
    netns.remove(crashed.netns)  # as if the node died between removing the netns and the veth
    assert slots.list_slots(prefix) == [kept]
    assert set(slots.stray_veths(prefix)) <= {crashed.host_veth}  # until the kernel frees the netns
    slots.destroy(crashed)
    assert slots.stray_veths(prefix) == [] and slots.list_slots(prefix) == [kept]
    with IPRoute() as ipr:  # a veth whose netns end was never made
        ipr.link("add", ifname=f"{prefix}v9", kind="veth", peer={"ifname": f"{prefix}p9"})
    assert slots.stray_veths(prefix) == [f"{prefix}v9"]
    assert slots.destroy(slots.Slot(prefix, 9)) is True and slots.stray_veths(prefix) == []


def test_pool_arithmetic():
    assert slots.max_slots("10.12.0.0/16") == 32767
    slot = slots.Slot("aenv", 32767)
    assert slot.address == "10.12.255.255" and len(slot.host_veth) <= 15
    assert slot.nsenter("qemu") == ["nsenter", "--net=/run/netns/aenv-32767", "--", "qemu"]
    assert os.path.basename(shutil.which("nsenter") or "nsenter") == "nsenter"
