"""vmm.net.policy (E2B's egress semantics, one parse for the API and the slot table) and how
a policy lands in a slot's nftables sets: pure checks everywhere, real namespaces as root."""
import json
import subprocess

import pytest

from vmm.net import policy, slots
from vmm.net.netns import egress_of
from vmm.net.spec import NetworkSpec


def test_allow_internet_access_false_replaces_deny_out_with_everything_and_keeps_allow_out():
    p = policy.parse(["1.1.1.1"], ["8.8.8.0/24"], allow_internet_access=False)
    assert p == policy.EgressPolicy(allow=("1.1.1.1/32",), deny=("0.0.0.0/0",))
    assert policy.parse().open and not p.open


def test_bare_ips_become_networks_and_duplicates_collapse():
    p = policy.parse(["203.0.113.7", "203.0.113.7/32", "198.51.100.9/24"], [" 192.0.2.1 "])
    assert p.allow == ("203.0.113.7/32", "198.51.100.0/24") and p.deny == ("192.0.2.1/32",)


@pytest.mark.parametrize("allow, deny, message", [
    ([], ["not-an-ip"], "invalid denied CIDR not-an-ip"),
    ([], ["0.0.0.0"], "invalid denied CIDR 0.0.0.0"),
    (["0.0.0.0"], [], "invalid allowed address 0.0.0.0"),
    (["example.com"], [], "you must include 'ALL_TRAFFIC' in deny out"),
    (["exa mple.com"], ["0.0.0.0/0"], "invalid allowed address exa mple.com"),
    (["*.*.example.com"], ["0.0.0.0/0"], "invalid allowed address *.*.example.com"),
    ([], ["2001:db8::/32"], "IPv4 only"),
    ("1.1.1.1", [], "allowOut must be a list of strings"),
])
def test_e2b_errors(allow, deny, message):
    with pytest.raises(policy.PolicyError) as err:
        policy.parse(allow, deny)
    assert message in str(err.value)


def test_the_slot_table_checks_node_then_always_denied_then_allow_then_deny():
    slot = slots.Slot("aenvq", 1, "10.12.0.0/16")
    text = slots.ruleset(slot, deny_extra=("192.0.2.2/32",), policy=policy.EgressPolicy(("1.1.1.1/32",),
                         ("0.0.0.0/0",)), dns_ip="10.12.0.1", allow_extra=("10.99.0.0/16",))
    order = [text.index(r) for r in ("ip daddr @node_deny drop", "ip daddr @always_deny ip daddr != @site_allow drop",
                                     "ip daddr @user_allow accept", "ip daddr @user_deny drop")]
    assert order == sorted(order)
    assert "elements = { 192.0.2.2/32, 10.12.0.1/32 }" in text  # the node and its resolver
    assert "elements = { 10.99.0.0/16 }" in text and "elements = { 1.1.1.1/32 }" in text
    assert "ip daddr 8.8.8.8 udp dport 53 dnat ip to 10.12.0.1" in text
    script = slots.policy_script(policy.EgressPolicy((), ("203.0.113.0/24",)))
    assert [line for line in script.splitlines() if "user_" in line] == [
        "flush set inet aenv user_allow", "flush set inet aenv user_deny",
        "add element inet aenv user_deny { 203.0.113.0/24 }"]


def _set(slot, name) -> list:
    out = subprocess.run(slot.nsenter("nft", "-j", "list", "set", "inet", "aenv", name), capture_output=True,
                         text=True, check=True).stdout
    elems = [i["set"].get("elem", []) for i in json.loads(out)["nftables"] if "set" in i][0]
    return [e if isinstance(e, (str, int)) else f"{e['range'][0]}-{e['range'][1]}" if "range" in e
            else f"{e['prefix']['addr']}/{e['prefix']['len']}" for e in elems]


@pytest.mark.skipif(not slots.netns_supported(), reason="needs root, nft and nsenter")
def test_a_policy_is_applied_to_a_real_slot_and_replaced_whole(slot_prefix):
    slot = slots.create(slots.Slot(slot_prefix, 7), allow_extra=("10.99.0.0/16",))
    try:
        assert _set(slot, "site_allow") == ["10.99.0.0/16"]
        slots.apply_policy(slot, egress_of(NetworkSpec(allow_out=("198.51.100.10",), deny_out=("0.0.0.0/0",))))
        assert _set(slot, "user_allow") == ["198.51.100.10"] and _set(slot, "user_deny") == ["0.0.0.0/0"]
        slots.apply_policy(slot, egress_of(NetworkSpec()))  # {} opens it again
        assert _set(slot, "user_allow") == [] and _set(slot, "user_deny") == []
    finally:
        slots.destroy(slot)


def test_domains_are_kept_apart_from_cidrs_and_need_everything_else_denied():
    p = policy.parse(["Example.COM.", "*.example.org", "1.1.1.1"], ["0.0.0.0/0"])
    assert p == policy.EgressPolicy(("1.1.1.1/32",), ("0.0.0.0/0",), ("example.com", "*.example.org"))
    # E2B checks the request's denyOut, even where allow_internet_access: false denies everything
    with pytest.raises(policy.PolicyError, match="ALL_TRAFFIC"):
        policy.parse(["example.com"], [], allow_internet_access=False)


def test_a_domain_policy_sends_tcp_to_the_proxy_port_kept_and_dns_to_the_node_only():
    slot = slots.Slot("aenvq", 1, "10.12.0.0/16")
    text = slots.ruleset(slot, dns_ip="10.12.0.1")
    order = [text.index(r) for r in (
        "ip daddr @always_deny ip daddr != @site_allow drop",
        "meta l4proto { tcp, udp } ip daddr . th dport @dns_servers accept",
        "meta l4proto { tcp, udp } th dport @dns_only drop",
        "ip daddr @user_allow accept", "tcp dport @proxied accept", "ip daddr @user_deny drop")]
    assert order == sorted(order)  # DNS elsewhere is dropped even where a CIDR allows it
    assert 'iifname "tap0" ip daddr != @user_allow tcp dport @proxied dnat ip to 10.12.0.1\n' in text  # port kept
    dns_dnat = text.index('iifname "tap0" ip daddr 8.8.8.8 tcp dport 53 dnat ip to 10.12.0.1')
    assert dns_dnat < text.index("tcp dport @proxied dnat")  # the guest's DNS still goes to the resolver
    plain = slots.policy_script(policy.parse(["1.1.1.1"], ["0.0.0.0/0"]))  # no domains: the proxy's sets stay empty
    assert [line for line in plain.splitlines() if line.startswith("add element")] == [
        "add element inet aenv user_allow { 1.1.1.1/32 }", "add element inet aenv user_deny { 0.0.0.0/0 }"]
    assert "flush set inet aenv proxied" in plain and "flush set inet aenv dns_only" in plain
    domains = slots.policy_script(policy.parse(["good.test"], ["0.0.0.0/0"]))
    assert "add element inet aenv proxied { 1-65535 }" in domains
    assert "add element inet aenv dns_only { 53, 853 }" in domains
    assert "add element inet aenv dns_servers { 8.8.8.8 . 53 }" in domains  # E2B's default: the node's resolver


def test_the_node_table_hands_a_slots_tcp_to_the_proxy_but_not_its_dns():
    from vmm.net import host_table  # noqa: PLC0415

    text = host_table.ruleset("aenvq", "10.12.0.0/16", ("aenvqv1",), "10.12.0.1")
    assert "iifname @veths ip daddr 10.12.0.1 tcp dport != 53 dnat ip to 10.12.0.1:15000" in text
    assert text.index("tcp dport { 15000, 15001 } accept") < text.index("iifname @veths drop")  # the proxy, its relay
    assert "to_proxy" not in host_table.ruleset("aenvq", "10.12.0.0/16", (), None)  # no resolver, no proxy


@pytest.mark.skipif(not slots.netns_supported(), reason="needs root, nft and nsenter")
def test_a_domain_policy_is_applied_to_a_real_slot_and_taken_back(slot_prefix):
    slot = slots.create(slots.Slot(slot_prefix, 8))
    try:
        assert slots.has_proxy_rules(slot)
        slots.apply_policy(slot, egress_of(NetworkSpec(allow_out=("good.test",), deny_out=("0.0.0.0/0",))))
        assert _set(slot, "proxied") == ["1-65535"] and sorted(_set(slot, "dns_only")) == [53, 853]
        slots.apply_policy(slot, egress_of(NetworkSpec()))
        assert _set(slot, "proxied") == [] and _set(slot, "dns_only") == []
    finally:
        slots.destroy(slot)


def test_a_node_whose_egress_proxy_is_not_running_refuses_domains_but_not_cidrs(tmp_path):
    from vmm.errors import UnsupportedNetworkPolicy  # noqa: PLC0415
    from vmm.net.egress import EgressProxy  # noqa: PLC0415
    from vmm.net.netns import NetnsBackend  # noqa: PLC0415

    backend = NetnsBackend.__new__(NetnsBackend)  # no slots: only the check is under test
    backend.egress, backend.egress_error = None, "mitmdump not found at /x"
    domains = NetworkSpec(allow_out=("good.test",), deny_out=("0.0.0.0/0",))
    backend.check(NetworkSpec(allow_out=("1.1.1.1",), deny_out=("0.0.0.0/0",)))
    with pytest.raises(UnsupportedNetworkPolicy, match="need the node's egress proxy.*mitmdump not found"):
        backend.check(domains)
    backend.egress, backend.egress_error = EgressProxy("nope" + tmp_path.name[-6:], "127.0.0.1", tmp_path), ""
    with pytest.raises(UnsupportedNetworkPolicy, match="not running here: it stopped"):
        backend.check(domains)  # installed perhaps, but no process answers


def test_dns_servers_default_to_e2bs_nameserver_only_with_domains():
    domains = (["good.test"], ["0.0.0.0/0"])
    assert policy.parse(*domains).resolvers == ("8.8.8.8",)  # omitted: E2B's default
    assert policy.parse(*domains, dns_servers=[]).resolvers == ()  # []: none
    assert policy.parse(*domains, dns_servers=[" 1.1.1.1", "1.1.1.1", "9.9.9.9"]).resolvers == ("1.1.1.1", "9.9.9.9")
    assert policy.parse([], [], False).resolvers == ()  # no domains, none given: nothing opened
    assert policy.parse([], [], False, ["1.1.1.1"]).resolvers == ("1.1.1.1",)
    assert slots.resolver_elements(policy.parse(*domains, dns_servers=["8.8.8.8", "1.1.1.1"])) == [
        "8.8.8.8 . 53", "1.1.1.1 . 53", "1.1.1.1 . 853"]  # the node's resolver serves 53 only
    for bad, words in ((["dns.example"], "invalid DNS server dns.example"), (["::1"], "must be an IPv4"),
                       (["1.1.1.1"] * 11, "at most 10"), ("1.1.1.1", "must be a list")):
        with pytest.raises(policy.PolicyError, match=words):
            policy.parse(dns_servers=bad)
    assert policy.never_reachable("169.254.169.254") == "169.254.0.0/16" and policy.never_reachable("1.1.1.1") is None
    assert policy.never_reachable("10.0.0.2") is None  # private: shut by the slot unless the operator reopened it


def test_a_spec_keeps_omitted_and_empty_dns_servers_apart():
    for given in (None, (), ("1.1.1.1",)):
        spec = NetworkSpec(deny_out=("0.0.0.0/0",), dns_servers=given)
        assert NetworkSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
        assert egress_of(spec).dns_servers == given
    assert "dns_servers" not in NetworkSpec().to_json()


@pytest.mark.skipif(not slots.netns_supported(), reason="needs root, nft and nsenter")
def test_a_slot_table_from_before_dns_servers_refuses_other_resolvers_but_not_the_default(slot_prefix):
    slot = slots.create(slots.Slot(slot_prefix, 9))
    try:
        subprocess.run(slot.nsenter("nft", "flush", "chain", "inet", "aenv", "guard"), check=True)
        subprocess.run(slot.nsenter("nft", "add", "rule", "inet", "aenv", "guard", "tcp", "dport", "@proxied",
                                    "accept"), check=True)  # what an older table's guard knew of
        slots.apply_policy(slot, egress_of(NetworkSpec(allow_out=("good.test",), deny_out=("0.0.0.0/0",))))
        with pytest.raises(slots.SlotError, match="before dnsServers"):
            slots.apply_policy(slot, egress_of(NetworkSpec(deny_out=("0.0.0.0/0",), dns_servers=("1.1.1.1",))))
        assert _set(slot, "proxied") == ["1-65535"]  # the refused policy changed nothing
    finally:
        slots.destroy(slot)
