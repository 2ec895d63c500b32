"""Domain names in allowOut with a real guest (issue 25): a sandbox allowed ``good.test`` only
reaches good.test's HTTP and HTTPS servers (names served by the node's resolver, hosts in a
namespace of the test's own; HTTPS on 443 and on 8443) and fails every dodge — connecting by IP, an SNI that differs
from the Host, DNS over TCP and DNS over TLS to another resolver, a raw socket on 443 to a
denied address; the policy holds across pause / resume, in a fork child, and changes live,
``dnsServers`` included (DNS to the listed resolver only)."""
import json
from pathlib import Path

import pytest
from e2b import ALL_TRAFFIC, Sandbox

from harness.named_hosts import NamedHosts
from harness import guest_probe
from harness.networld import EXT_A, EXT_B, ExternalHost
from vmm.net import slots
from vmm.net.egress import EgressProxy

pytestmark = [pytest.mark.vm,
              pytest.mark.skipif(not slots.netns_supported(), reason="needs root, nft and nsenter (netns backend)"),
              pytest.mark.skipif(not EgressProxy("x", "127.0.0.1", "/tmp").available(),
                                 reason="mitmproxy is not installed in .venv-egress (scripts/setup.sh)")]

PROBE = guest_probe.LIB + r"""
GOOD_IP, EVIL_IP = sys.argv[1:3]

checks = {
    "resolved": lambda: socket.gethostbyname("good.test"),
    "https_good": lambda: https(GOOD_IP, "good.test", "good.test"),
    "https_good_8443": lambda: https(EVIL_IP, "good.test", "good.test", 8443),
    "http_good": lambda: http(GOOD_IP, "good.test"),
    "https_evil_ip_good_sni": lambda: https(EVIL_IP, "good.test", "evil.test"),
    "http_evil_ip_good_host": lambda: http(EVIL_IP, "good.test"),
    "https_evil": lambda: https(EVIL_IP, "evil.test", "evil.test"),
    "http_evil": lambda: http(EVIL_IP, "evil.test"),
    "raw_443_evil": lambda: tcp(EVIL_IP, 443, b"hello\r\n\r\n"),
    "dns_tcp_evil": lambda: tcp(EVIL_IP, 53),
    "dot_evil": lambda: tcp(EVIL_IP, 853),
    "other_port_evil": lambda: tcp(EVIL_IP, 8053),
}
print(json.dumps(run_checks(checks, checks)))
"""


@pytest.fixture(scope="module")
def named(stack, tmp_path_factory):
    ext = ExternalHost().start()
    for proc in ext.procs:  # its plain servers make way for the named ones
        proc.kill()
        proc.wait(timeout=10)
    ext.procs = []
    hosts = NamedHosts(ext.name, {EXT_A: "good.test", EXT_B: "evil.test"}, tmp_path_factory.mktemp("named")).start()
    hosts_dir = stack.home / "net" / "hosts.d"
    hosts_dir.mkdir(parents=True, exist_ok=True)
    (hosts_dir / "egress-world").write_text(hosts.hosts_file())
    try:
        yield hosts
    finally:
        (hosts_dir / "egress-world").unlink(missing_ok=True)
        hosts.stop()
        ext.stop()


def _proxy_lists(sandbox_id: str) -> list[list[str]]:
    """The domain lists the node gave its egress proxy for this sandbox (vmm.net.egress)."""
    found = [json.loads(f.read_text()) for f in Path("/run/aenv-egress").glob("*/slots/*.json")]
    return [f["domains"] for f in found if f["sandbox"] == sandbox_id]


def _probe(sandbox) -> dict:
    sandbox.files.write("/tmp/probe.py", PROBE)
    out = sandbox.commands.run(f"python3 /tmp/probe.py {EXT_A} {EXT_B}", timeout=180).stdout
    return json.loads(out.strip().splitlines()[-1])


def _assert_only_good_test(r: dict) -> None:
    assert r["resolved"] == EXT_A, r
    assert "good.test host=good.test" in r["https_good"] and "good.test host=good.test" in r["http_good"], r
    # by IP with an allowed name: pinned to good.test's address, never the address dialled
    assert "good.test host=evil.test" in r["https_evil_ip_good_sni"], r
    assert "good.test host=good.test" in r["http_evil_ip_good_host"], r
    assert "evil.test host" not in r["https_evil"] and "HTTP/1.1 200" not in r["https_evil"], r
    assert r["http_evil"].startswith("HTTP/1.1 403"), r
    assert "good.test host=good.test" in r["https_good_8443"], r  # any port, pinned as well
    assert "evil.test" not in r["raw_443_evil"] and "evil.test" not in r["other_port_evil"], r
    for name in ("dns_tcp_evil", "dot_evil"):
        assert r[name].startswith("failed"), (name, r)


def test_a_guest_allowed_one_domain_reaches_it_and_fails_every_dodge(sdk_env, named):
    sandbox = Sandbox.create(timeout=600, network={"allow_out": ["good.test"], "deny_out": [ALL_TRAFFIC]})
    try:
        _assert_only_good_test(_probe(sandbox))
        assert _proxy_lists(sandbox.sandbox_id) == [["good.test"]]

        sandbox.pause()  # to disk: a new slot on resume, the stored policy with it
        sandbox = Sandbox.connect(sandbox.sandbox_id, timeout=600)
        _assert_only_good_test(_probe(sandbox))

        child = sandbox.fork(count=1, timeout=300)[0]  # a slot of its own, the parent's policy
        assert not isinstance(child, Exception), child
        try:
            _assert_only_good_test(_probe(child))
            assert _proxy_lists(child.sandbox_id) == [["good.test"]]
        finally:
            child.kill()
        assert _proxy_lists(child.sandbox_id) == []  # gone with its slot

        # live: evil.test's address allowed by CIDR goes straight out, DNS elsewhere stays shut
        sandbox.update_network({"allow_out": ["good.test", EXT_B], "deny_out": [ALL_TRAFFIC]})
        r = _probe(sandbox)
        assert "good.test host=good.test" in r["https_good"], r
        assert r["other_port_evil"] == "evil.test:8053\n" and "evil.test host=evil.test" in r["http_evil"], r
        assert r["dns_tcp_evil"].startswith("failed") and r["dot_evil"].startswith("failed"), r

        # dnsServers: DNS (53, 853) to evil.test's address goes straight to it (not to the proxy),
        # its other ports stay with the policy, and 8.8.8.8 (the node's resolver) is shut: not listed
        sandbox.update_network({"allow_out": ["good.test"], "deny_out": [ALL_TRAFFIC], "dns_servers": [EXT_B]})
        r = _probe(sandbox)
        assert r["dns_tcp_evil"] == "evil.test:53\n" and r["dot_evil"] == "evil.test:853\n", r
        assert "evil.test" not in r["other_port_evil"] and r["resolved"].startswith("failed"), r
        assert "good.test host=good.test" in r["https_good"], r

        sandbox.update_network({})  # open again: the same probes now reach evil.test (they can succeed)
        assert _proxy_lists(sandbox.sandbox_id) == []  # the proxy's list goes with the domains
        r = _probe(sandbox)
        assert r["dns_tcp_evil"] == "evil.test:53\n" and r["dot_evil"] == "evil.test:853\n", r
        assert "evil.test host=evil.test" in r["https_evil"], r
        assert "evil.test host=good.test" in r["http_evil_ip_good_host"], r  # no proxy: the dialled address
    finally:
        sandbox.kill()
