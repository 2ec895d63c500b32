"""Domain names in allowOut with a real guest (issue 25): a sandbox allowed ``good.test`` only
reaches good.test's HTTP and HTTPS servers (names served by the node's resolver, hosts in a
namespace of the test's own; HTTPS on 443 and on 8443) and fails every dodge — connecting by IP, an SNI that differs
from the Host, DNS over TCP and DNS over TLS to another resolver, a raw socket on 443 to a
denied address; the policy holds across pause / resume, in a fork child, and changes live."""
import json
from pathlib import Path

import pytest
from e2b import ALL_TRAFFIC, Sandbox

from harness.named_hosts import NamedHosts
from harness.networld import EXT_A, EXT_B, ExternalHost
from vmm.net import slots
from vmm.net.egress import EgressProxy

pytestmark = [pytest.mark.vm,
              pytest.mark.skipif(not slots.netns_supported(), reason="needs root, nft and nsenter (netns backend)"),
              pytest.mark.skipif(not EgressProxy("x", "127.0.0.1", "/tmp").available(),
                                 reason="mitmproxy is not installed in .venv-egress (scripts/setup.sh)")]

PROBE = r"""
import json, socket, ssl, sys, threading
GOOD_IP, EVIL_IP = sys.argv[1:3]

def read(sock):
    out = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            out += chunk
    except Exception:
        pass
    return out.decode(errors="replace")

def https(ip, sni, host, port=443):
    try:
        raw = socket.create_connection((ip, port), timeout=15)
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        tls = ctx.wrap_socket(raw, server_hostname=sni)
        tls.sendall(f"GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        return read(tls)
    except Exception as exc:
        return f"failed: {exc!r}"

def http(ip, host):
    try:
        s = socket.create_connection((ip, 80), timeout=15)
        s.sendall(f"GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        return read(s)
    except Exception as exc:
        return f"failed: {exc!r}"

def tcp(ip, port, send=b""):
    try:
        s = socket.create_connection((ip, port), timeout=8)
        s.settimeout(8)
        if send:
            s.sendall(send)
        return read(s) or "closed"
    except Exception as exc:
        return f"failed: {exc!r}"

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
results = {}
def run(name):
    try:
        results[name] = checks[name]()
    except Exception as exc:
        results[name] = f"failed: {exc!r}"
threads = [threading.Thread(target=run, args=(n,)) for n in checks]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps(results))
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

        sandbox.update_network({})  # open again: the same probes now reach evil.test (they can succeed)
        assert _proxy_lists(sandbox.sandbox_id) == []  # the proxy's list goes with the domains
        r = _probe(sandbox)
        assert r["dns_tcp_evil"] == "evil.test:53\n" and r["dot_evil"] == "evil.test:853\n", r
        assert "evil.test host=evil.test" in r["https_evil"], r
        assert "evil.test host=good.test" in r["http_evil_ip_good_host"], r  # no proxy: the dialled address
    finally:
        sandbox.kill()
