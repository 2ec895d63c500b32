"""network.egressProxy with a real guest and the unchanged E2B SDK: a sandbox whose egress is
chained through an upstream SOCKS5 proxy (mitmproxy's, with user and password, in a namespace
of the test's own: harness.upstream_proxies) reaches the named test hosts only through it —
by address (a server-first protocol too) and, with domain rules, by name — its password
never shown back; the upstream going away fails the guest's connections (no direct
fallback); PUT /network switches it to an HTTP upstream, to the SOCKS5 one over TLS (its
certificate verified against the test's CA given in ``tls``; with the system store instead
nothing gets through) and back to direct; pause / resume and a fork child keep it. On the
conftest's second stack: upstreams on namespace addresses need AENV_EGRESS_PROXY_ALLOW_PRIVATE,
which the session's stack must not have."""
import json
import uuid

import pytest
from e2b import ALL_TRAFFIC, Sandbox

from harness.named_hosts import NamedHosts
from harness import guest_probe
from harness.networld import EXT_A, EXT_B, ExternalHost
from harness.upstream_proxies import HTTP_PROXY, SOCKS, SOCKS_TLS, TLS_NAME, UPSTREAM, Upstreams
from vmm.net import slots
from vmm.net.egress import EgressProxy

pytestmark = [pytest.mark.vm,
              pytest.mark.skipif(not slots.netns_supported(), reason="needs root, nft and nsenter (netns backend)"),
              pytest.mark.skipif(not EgressProxy("x", "127.0.0.1", "/tmp").chains(),
                                 reason="mitmproxy / python-socks are not in .venv-egress (scripts/setup.sh)")]

SOCKS_PW, HTTP_PW = "s0cks-" + uuid.uuid4().hex[:8], "http-" + uuid.uuid4().hex[:8]

PROBE = guest_probe.LIB + r"""
GOOD_IP, EVIL_IP = sys.argv[1:3]
GET_GOOD = b"GET / HTTP/1.1\r\nHost: good.test\r\nConnection: close\r\n\r\n"

checks = {
    "hello_good": lambda: tcp(GOOD_IP, 8053, timeout=15),  # the server speaks first
    "http_good": lambda: tcp(GOOD_IP, 80, GET_GOOD, timeout=15),
    "hello_evil": lambda: tcp(EVIL_IP, 8053, timeout=15),
    "https_good": lambda: https(GOOD_IP, "good.test"),
    "https_evil": lambda: https(EVIL_IP, "evil.test"),
}
print(json.dumps(run_checks(checks, checks)))
"""


@pytest.fixture(scope="module")
def world(node_kill_stack, tmp_path_factory):
    """The conftest's second stack (its settings allow upstreams on private addresses; its node
    asks its API for the upstream's password, AENV_API_PUBLIC_URL), the named hosts and the
    two upstreams."""
    stack = node_kill_stack
    ext = ExternalHost().start()
    for proc in ext.procs:  # its plain servers make way for the named ones
        proc.kill()
        proc.wait(timeout=10)
    ext.procs = []
    hosts = ups = None
    hosts_file = stack.home / "net" / "hosts.d" / "egress-world"
    try:
        hosts = NamedHosts(ext.name, {EXT_A: "good.test", EXT_B: "evil.test"}, tmp_path_factory.mktemp("named")).start()
        ups = Upstreams(ext.name, tmp_path_factory.mktemp("upstreams"), f"alice:{SOCKS_PW}", f"bob:{HTTP_PW}").start()
        hosts_file.parent.mkdir(parents=True, exist_ok=True)
        hosts_file.write_text(hosts.hosts_file())
        stack.upstreams = ups
        yield stack
    finally:
        hosts_file.unlink(missing_ok=True)
        stack.upstreams = None
        if ups is not None:
            ups.stop()
        if hosts is not None:
            hosts.stop()
        ext.stop()


@pytest.fixture
def sdk(world, monkeypatch):
    monkeypatch.setenv("E2B_API_URL", world.api_url)
    monkeypatch.setenv("E2B_SANDBOX_URL", world.sandbox_url)
    monkeypatch.setenv("E2B_API_KEY", world.api_key)
    monkeypatch.delenv("E2B_DEBUG", raising=False)
    return world


def _probe(sandbox) -> dict:
    sandbox.files.write("/tmp/probe.py", PROBE)
    out = sandbox.commands.run(f"python3 /tmp/probe.py {EXT_A} {EXT_B}", timeout=180).stdout
    return json.loads(out.strip().splitlines()[-1])


def _tunnels(world, name: str) -> int:
    return world.upstreams.log(name).count("server connect")


def test_a_guests_egress_leaves_through_its_upstream_proxy_only(sdk):
    world = sdk
    socks = {"address": f"{UPSTREAM}:{SOCKS}", "username": "alice", "password": SOCKS_PW}
    sandbox = Sandbox.create(timeout=900, network={"egress_proxy": socks})
    try:
        before = _tunnels(world, "socks")
        r = _probe(sandbox)
        assert r["hello_good"] == "good.test:8053\n" and r["hello_evil"] == "evil.test:8053\n", r
        assert "good.test host=good.test" in r["http_good"] and "good.test host=good.test" in r["https_good"], r
        assert world.upstreams.seen("socks", lambda log: log.count("server connect") >= before + 5), r
        info = Sandbox.get_info(sandbox.sandbox_id)
        assert info.network["egress_proxy"] == {"address": f"{UPSTREAM}:{SOCKS}", "username": "alice"}
        logs = list(world.home.rglob("*.log"))  # the API's, the node's, the egress proxy's ...
        assert any(p.name == "egress-proxy.log" for p in logs) and any(p.name == "node.log" for p in logs)
        for path in logs:
            assert SOCKS_PW not in path.read_text(errors="replace"), path

        world.upstreams.stop("socks")  # the upstream gone: nothing leaves directly instead
        try:
            r = _probe(sandbox)
            assert all("good.test" not in v and "evil.test" not in v for v in r.values()), r
        finally:
            world.upstreams.run("socks")

        # live: an HTTP upstream, and only good.test by name
        http = {"address": f"http://{UPSTREAM}:{HTTP_PROXY}", "username": "bob", "password": HTTP_PW}
        sandbox.update_network({"allow_out": ["good.test"], "deny_out": [ALL_TRAFFIC], "egress_proxy": http})
        before = _tunnels(world, "http")
        r = _probe(sandbox)
        assert "good.test host=good.test" in r["https_good"], r
        assert "evil.test" not in r["https_evil"] and "evil.test" not in r["hello_evil"], r
        assert "good.test:8053" not in r["hello_good"], r  # by address: 0.0.0.0/0 denies it
        assert world.upstreams.seen("http", lambda log: log.count("server connect") >= before + 1), r

        sandbox.pause()  # to disk: a new slot on resume, the stored proxy with it
        sandbox = Sandbox.connect(sandbox.sandbox_id, timeout=900)
        before = _tunnels(world, "http")
        assert "good.test host=good.test" in _probe(sandbox)["https_good"]
        assert world.upstreams.seen("http", lambda log: log.count("server connect") >= before + 1)

        child = sandbox.fork(count=1, timeout=600)[0]
        assert not isinstance(child, Exception), child
        try:
            before = _tunnels(world, "http")
            assert "good.test host=good.test" in _probe(child)["https_good"]
            assert world.upstreams.seen("http", lambda log: log.count("server connect") >= before + 1)
        finally:
            child.kill()

        # over TLS: the SOCKS5 upstream behind a TLS front, its certificate from the test's own CA
        over_tls = {**socks, "address": f"{UPSTREAM}:{SOCKS_TLS}",
                    "tls": {"server_name": TLS_NAME, "ca_cert": world.upstreams.tls_ca}}
        sandbox.update_network({"egress_proxy": over_tls})
        fronted = world.upstreams.log("socks-tls").count("tunnel ")
        r = _probe(sandbox)
        assert r["hello_good"] == "good.test:8053\n" and "good.test host=good.test" in r["https_good"], r
        assert world.upstreams.seen("socks-tls", lambda log: log.count("tunnel ") >= fronted + 5), r
        assert Sandbox.get_info(sandbox.sandbox_id).network["egress_proxy"] == {
            "address": f"{UPSTREAM}:{SOCKS_TLS}", "username": "alice", "tls": {"server_name": TLS_NAME}}
        sandbox.update_network({"egress_proxy": {**over_tls, "tls": True}})  # the system store: no test CA there
        fronted = world.upstreams.log("socks-tls").count("tunnel ")
        r = _probe(sandbox)
        assert all("good.test" not in v and "evil.test" not in v for v in r.values()), r
        assert world.upstreams.log("socks-tls").count("tunnel ") == fronted  # no handshake got through
        assert "certificate is not trusted for " + UPSTREAM in next(world.home.rglob("egress-proxy.log")).read_text()
        for path in world.home.rglob("*.log"):
            assert SOCKS_PW not in path.read_text(errors="replace"), path

        sandbox.update_network({})  # no upstream: out directly again
        before = (_tunnels(world, "socks"), _tunnels(world, "http"))
        r = _probe(sandbox)
        assert r["hello_evil"] == "evil.test:8053\n" and "good.test host=good.test" in r["https_good"], r
        assert (_tunnels(world, "socks"), _tunnels(world, "http")) == before
    finally:
        sandbox.kill()
