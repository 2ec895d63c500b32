"""vmm.net: the network seam. NetworkSpec, the slirp backend (ports claimed in the state dir,
refusal of an egress policy it cannot enforce) and the guest side agreeing with it."""
from pathlib import Path

import pytest

from envd import ENVD_PORT
from vmm.net import slots
from vmm.net import DNS, GATEWAY, GUEST_IP, GUEST_PREFIX, NetworkSpec, SlirpBackend, UnsupportedNetworkPolicy, ports

ROOT = Path(__file__).resolve().parents[2]


def test_spec_defaults_round_trip_and_restrictions():
    default = NetworkSpec()
    assert default.allow_internet_access and default.forward_ports == (ENVD_PORT,) and default.restrictions() == []
    spec = NetworkSpec(allow_internet_access=False, allow_out=("10.0.0.0/8",), deny_out=("1.1.1.1",),
                       forward_ports=(ENVD_PORT, 8080))
    assert NetworkSpec.from_json(spec.to_json()) == spec and NetworkSpec.from_json(None) == default
    assert len(spec.restrictions()) == 3 and "allowOut" in spec.restrictions()[1]


def test_slirp_forwards_envd_and_more_ports_claimed_in_the_state_dir(tmp_path):
    sandboxes = tmp_path / "sandboxes"
    net = SlirpBackend("127.0.0.1", sandboxes, port_range=(45200, 45260))
    att = net.attach("sb1", sandboxes / "sb1", NetworkSpec(forward_ports=(8080,)))
    assert set(att.forwards) == {ENVD_PORT, 8080} and att.backend == "slirp"
    assert (att.guest_ip, att.gateway, att.dns) == (GUEST_IP, GATEWAY, DNS)
    assert int((sandboxes / "sb1" / "port").read_text()) == att.host_port(ENVD_PORT)
    assert int((sandboxes / "sb1" / "port-8080").read_text()) == att.host_port(8080)
    assert ports.claimed_ports(sandboxes) == set(att.forwards.values())
    other = net.attach("sb2", sandboxes / "sb2", NetworkSpec())
    assert set(other.forwards) == {ENVD_PORT} and not set(other.forwards.values()) & set(att.forwards.values())
    assert net.forward(att, sandboxes / "sb1", 8080) == att.host_port(8080)  # already forwarded
    net.detach(att, sandboxes / "sb1")
    assert ports.claimed_ports(sandboxes) == set(other.forwards.values())


@pytest.mark.parametrize("spec", [NetworkSpec(allow_internet_access=False), NetworkSpec(allow_out=("10.0.0.0/8",)),
                                  NetworkSpec(deny_out=("169.254.169.254",))])
def test_slirp_refuses_an_egress_policy_it_cannot_enforce(tmp_path, spec):
    net = SlirpBackend("127.0.0.1", tmp_path / "sandboxes")
    with pytest.raises(UnsupportedNetworkPolicy, match="slirp network backend cannot restrict egress"):
        net.attach("sb1", tmp_path / "sandboxes" / "sb1", spec)
    assert not (tmp_path / "sandboxes" / "sb1").exists()  # refused before any claim


def test_the_guest_init_uses_the_same_addresses_and_envd_port():
    """vmm/guest/init.sh configures the guest side from aenv.net=; it must match vmm.net for
    both backends (a snapshot's guest keeps these addresses)."""
    init = (ROOT / "vmm" / "guest" / "init.sh").read_text()
    assert f"*) NET_ADDR={GUEST_IP}/{GUEST_PREFIX} NET_GW={GATEWAY} NET_DNS={DNS} ;;" in init
    netns = (f'*" aenv.net=netns "*) NET_ADDR={slots.GUEST_IP}/{slots.GUEST_PREFIX} NET_GW={slots.GATEWAY_IP} '
             f"NET_DNS={slots.GUEST_DNS} ;;")
    assert netns in init
    assert 'ip addr add "$NET_ADDR" dev eth0' in init and 'ip route add default via "$NET_GW"' in init
    assert 'echo "nameserver $NET_DNS"' in init
    assert f"--port {ENVD_PORT}" in init


def test_envd_port_is_the_one_e2b_sdks_assume():
    assert ENVD_PORT == 49983  # e2b ConnectionConfig.envdPort


def test_ingress_sources_on_a_slirp_node_are_refused(tmp_path):
    """AENV_NET_INGRESS_FROM limits who may connect into sandboxes; slirp cannot keep that
    limit, so a node asked for it (or falling back to it) refuses to start rather than
    ignoring it. Without the setting slirp is chosen as before."""
    from vmm.net import choose_backend  # noqa: PLC0415

    kw = dict(home=tmp_path, host_address="127.0.0.1", sandboxes_dir=tmp_path / "sandboxes")
    with pytest.raises(UnsupportedNetworkPolicy, match="AENV_NET_INGRESS_FROM .*10.0.0.2.* needs the netns"):
        choose_backend("slirp", ingress_from=("10.0.0.2",), **kw)
    assert isinstance(choose_backend("slirp", **kw), SlirpBackend)
