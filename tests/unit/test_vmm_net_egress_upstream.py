"""network.egressProxy without a VM: the node egress proxy (vmm.net.egress) chains a slot's
connections to an upstream proxy, a real SOCKS5 one and a real HTTP one (mitmproxy's own
``socks5`` and ``regular`` modes, with user / password) run in the external host's namespace
on an address of their own, with their own name table (the upstream resolves names).

A client bound to a "slot address" on the node stands in for a guest: its TCP to the
resolver's address reaches the proxy as a slot's DNAT delivers a domain sandbox's, and its
TCP to any other address as the node's ``chained`` DNAT delivers a chained slot's (the
destination kept for ``SO_ORIGINAL_DST``). Shown: address-allowed TCP (a server-first
protocol too) and domain-judged HTTP / TLS / intercepted TLS with rules all leave through the
upstream (its log has every tunnel), the password comes from the API stand-in and is in no
file the proxy reads, a wrong password or a dead upstream fails the connection (never a
direct fallback), and the domain rules still hold in front of the upstream. Over TLS
(``egressProxy.tls``: the same proxies behind harness/tls_front.py, a certificate for
proxy.test from a CA of the test's own): chained when the certificate verifies against the
given CA and name; refused, before anything reaches the proxy, with the system's trust
store, another CA, another name or the address as the name."""
import json
import os
import socket
import ssl
import subprocess
import uuid
from pathlib import Path

import pytest

from harness.api_stand_in import StandIn, served
from harness.named_hosts import proxy_world
from harness.upstream_proxies import (HTTP_PROXY, HTTP_PROXY_TLS, SOCKS, SOCKS_TLS, TLS_NAME, UPSTREAM, Upstreams,
                                      chained_dnat)
from harness.networld import EXT_A, EXT_B
from tests.unit.test_vmm_net_egress import _read
from vmm.net import slots
from vmm.net.dns import service_ip
from vmm.net.egress import EgressProxy
from vmm.net.slots import CHAIN_PORT

pytestmark = [pytest.mark.xdist_group("egress_proxy"),
              pytest.mark.skipif(not slots.netns_supported(), reason="needs root, nft and nsenter (netns backend)"),
              pytest.mark.skipif(not EgressProxy("x", "127.0.0.1", Path("/tmp")).chains(),
                                 reason="mitmproxy / python-socks are not in .venv-egress (scripts/setup.sh)")]

_SECOND = os.environ.get("AENV_NET_POOL", "10.100.0.0/20").split(".")[1]
POOL = f"10.18.{_SECOND}.0/24"
OPEN = f"10.18.{_SECOND}.3"  # an open policy through the SOCKS5 upstream
VIA_HTTP = f"10.18.{_SECOND}.5"  # an open policy through the HTTP upstream
DOMAINS = f"10.18.{_SECOND}.7"  # good.test only (0.0.0.0/0 denied), through the SOCKS5 upstream
VIA_TLS = f"10.18.{_SECOND}.9"  # through an upstream over TLS (each test sets which)
PASSWORDS = {"c-socks": "s0cks-pa55", "c-http": "http-pa55"}
SOCKS_UP = {"scheme": "socks5", "host": UPSTREAM, "port": SOCKS, "username": "alice", "credential": "c-socks"}
HTTP_UP = {"scheme": "http", "host": UPSTREAM, "port": HTTP_PROXY, "username": "bob", "credential": "c-http"}


class PasswordsAPI(StandIn):
    """Stands in for the API's ``POST /nodes/egress-proxy/resolve`` (``wrong``: a password the
    upstream refuses). Every ask is recorded."""

    asked: list = []

    def answer(self, body: dict) -> tuple[int, dict]:
        password = PASSWORDS.get(body.get("credential")) or ("nope" if body.get("credential") == "wrong" else None)
        status, answer = (200, {"password": password, "ttl": 60}) if password else (404, {"message": "no"})
        if self.path != "/nodes/egress-proxy/resolve":
            status, answer = 404, {"message": "not this route"}
        return status, answer


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    work = tmp_path_factory.mktemp("upstreams")
    table = f"aenvupt{uuid.uuid4().hex[:6]}"
    ups = None
    with served(PasswordsAPI) as config:
        try:
            with proxy_world(POOL, (OPEN, VIA_HTTP, DOMAINS, VIA_TLS), secrets=config,
                             allow_private_upstream=True) as egress, \
                    chained_dnat(POOL, (OPEN, VIA_HTTP, DOMAINS, VIA_TLS), table):
                ups = Upstreams(egress.ext_netns, work, f"alice:{PASSWORDS['c-socks']}",
                                f"bob:{PASSWORDS['c-http']}").start()
                egress.allow(OPEN, "sbx-open", (), upstream=SOCKS_UP)
                egress.allow(VIA_HTTP, "sbx-http", (), upstream=HTTP_UP)
                egress.allow(DOMAINS, "sbx-dom", ("good.test",), rules={"good.test": [{"X-Aenv-Rule": "ruled"}]},
                             upstream=SOCKS_UP, allow=(f"{EXT_B}/32",), deny=("0.0.0.0/0",))
                egress.upstreams, egress.api = ups, PasswordsAPI
                try:
                    yield egress
                finally:
                    if egress.log_file.exists():
                        print(egress.log_file.read_text()[-3000:])  # shown when a test failed
        finally:
            if ups is not None:
                ups.stop()


def _connect(address: str, port: int, source: str) -> socket.socket:
    sock = socket.create_connection((address, port), timeout=15, source_address=(source, 0))
    sock.settimeout(15)
    return sock


def _http(address: str, host: str, source: str, port: int = 80) -> str:
    try:
        with _connect(address, port, source) as sock:
            sock.sendall(f"GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
            return _read(sock)
    except OSError:
        return ""


def _https(address: str, sni: str, source: str, cadata: str | None = None) -> str:
    context = ssl.create_default_context(cadata=cadata)
    if cadata is None:
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    try:
        with _connect(address, 443, source) as raw, context.wrap_socket(raw, server_hostname=sni) as tls:
            tls.sendall(f"GET / HTTP/1.1\r\nHost: {sni}\r\nConnection: close\r\n\r\n".encode())
            return _read(tls)
    except (ssl.SSLError, OSError):
        return ""


def _hello(address: str, source: str) -> str:
    """The named hosts' server-first service on 8053: it speaks before the client does."""
    try:
        with _connect(address, 8053, source) as sock:
            return _read(sock)
    except OSError:
        return ""


def test_address_allowed_tcp_leaves_through_the_socks5_upstream(world):
    before = world.upstreams.log("socks").count("client connect")
    assert _hello(EXT_A, OPEN) == "good.test:8053\n"  # server-first: decided before any data
    assert "good.test host=good.test" in _http(EXT_A, "good.test", OPEN)
    assert "evil.test host=whatever" in _http(EXT_B, "whatever", OPEN)  # no names: the address decides
    assert "good.test host=good.test" in _https(EXT_A, "good.test", OPEN)  # TLS passed through, not parsed
    assert world.upstreams.seen("socks", lambda log: log.count("client connect") >= before + 4)
    assert {"sandboxID": "sbx-open", "credential": "c-socks", "auth": "Bearer node-cred"} in world.api.asked


def test_address_allowed_tcp_leaves_through_the_http_upstream(world):
    before = world.upstreams.log("http").count("client connect")
    assert _hello(EXT_B, VIA_HTTP) == "evil.test:8053\n"
    assert "good.test host=good.test" in _http(EXT_A, "good.test", VIA_HTTP)
    assert world.upstreams.seen("http", lambda log: log.count("client connect") >= before + 2)


def test_domain_rules_hold_in_front_of_the_upstream_and_names_go_to_it(world):
    ip = service_ip(POOL)
    before = world.upstreams.log("socks").count("client connect")
    # a domain sandbox's TLS / HTTP to the resolver address (the slot's DNAT), judged by name
    assert "good.test host=good.test" in _https(ip, "good.test", DOMAINS)
    assert _https(ip, "evil.test", DOMAINS) == ""
    assert "good.test host=good.test" in _http(ip, "good.test", DOMAINS)
    assert "403" in _http(ip, "evil.test", DOMAINS).split("\r\n")[0]
    # by address: what allowOut names as a CIDR passes (unparsed), what 0.0.0.0/0 denies does not
    assert _hello(EXT_B, DOMAINS) == "evil.test:8053\n"
    assert _hello(EXT_A, DOMAINS) == "" and _http(EXT_A, "good.test", DOMAINS) == ""
    assert world.upstreams.seen("socks", lambda log: log.count("client connect") >= before + 3
                                and "server connect good.test:443" in log  # named to it, not resolved here
                                and "server connect good.test:80" in log)


def test_intercepted_tls_with_rules_goes_through_the_upstream(world):
    answer = _https(service_ip(POOL), "good.test", DOMAINS, cadata=world.ca.cert_pem.decode())  # the node CA's leaf
    assert "good.test host=good.test" in answer and "x-aenv-rule: ruled" in answer


def test_the_password_is_in_no_file_the_proxy_reads_nor_its_log(world):
    assert "good.test" in _hello(EXT_A, OPEN)
    files = [p for p in Path(world.dir).rglob("*") if p.is_file() and p.name != "mitmproxy-ca.pem"]
    assert any(p.name == f"{OPEN}.json" for p in files)
    for path in [*files, world.log_file]:
        text = path.read_text(errors="replace")
        assert not any(password in text for password in PASSWORDS.values()), path


def test_a_refused_password_or_a_dead_upstream_fails_the_connection_never_goes_direct(world):
    world.allow(OPEN, "sbx-open", (), upstream={**SOCKS_UP, "credential": "wrong"})
    try:
        assert _hello(EXT_A, OPEN) == "" and _http(EXT_A, "good.test", OPEN) == ""
        world.allow(OPEN, "sbx-open", (), upstream={**SOCKS_UP, "credential": "unknown"})  # the API refuses
        assert _hello(EXT_A, OPEN) == ""
    finally:
        world.allow(OPEN, "sbx-open", (), upstream=SOCKS_UP)
    assert _hello(EXT_A, OPEN) == "good.test:8053\n"
    world.upstreams.stop("socks")
    try:
        assert _hello(EXT_A, OPEN) == "" and _https(EXT_A, "good.test", OPEN) == ""
    finally:
        world.upstreams.run("socks")
    assert _hello(EXT_A, OPEN) == "good.test:8053\n"


def test_the_slots_cidrs_are_judged_again_by_the_proxy(world):
    world.allow(OPEN, "sbx-open", (), upstream=SOCKS_UP, deny=(f"{EXT_B}/32",))
    try:
        assert _hello(EXT_B, OPEN) == "" and _hello(EXT_A, OPEN) == "good.test:8053\n"
    finally:
        world.allow(OPEN, "sbx-open", (), upstream=SOCKS_UP)


def _over_tls(world, scheme: str = "socks5", **tls) -> dict:
    """An upstream over TLS as the API tells the node (lifecycle.sandboxes.egress_proxy.spec)."""
    base = {**SOCKS_UP, "port": SOCKS_TLS} if scheme == "socks5" else {**HTTP_UP, "port": HTTP_PROXY_TLS}
    return {**base, "tls": True, "tls_server_name": TLS_NAME, "tls_ca": world.upstreams.tls_ca, **tls}


def _tunnels(world, name: str) -> int:
    return world.upstreams.log(name).count("tunnel ")


def test_an_upstream_over_tls_verified_against_the_given_ca_chains_everything(world):
    ip = service_ip(POOL)
    socks_before, fronted = world.upstreams.log("socks").count("client connect"), _tunnels(world, "socks-tls")
    world.allow(VIA_TLS, "sbx-tls", (), upstream=_over_tls(world))
    try:
        assert _hello(EXT_A, VIA_TLS) == "good.test:8053\n"  # server-first, through SOCKS5 in TLS
        assert "evil.test host=whatever" in _http(EXT_B, "whatever", VIA_TLS)
        assert "good.test host=good.test" in _https(EXT_A, "good.test", VIA_TLS)
        with _connect(EXT_A, 80, VIA_TLS) as sock:  # a half-close: TLS cannot pass it on, the reply still comes
            sock.sendall(b"GET / HTTP/1.1\r\nHost: good.test\r\nConnection: close\r\n\r\n")
            sock.shutdown(socket.SHUT_WR)
            assert "good.test host=good.test" in _read(sock)
        # judged by name (mitmproxy's connection, the relay) with the same upstream
        world.allow(VIA_TLS, "sbx-tls", ("good.test",), upstream=_over_tls(world), deny=("0.0.0.0/0",))
        assert "good.test host=good.test" in _https(ip, "good.test", VIA_TLS)
        assert "403" in _http(ip, "evil.test", VIA_TLS).split("\r\n")[0]
        assert world.upstreams.seen("socks-tls", lambda log: log.count("tunnel ") >= fronted + 5)
        assert world.upstreams.seen("socks", lambda log: log.count("client connect") >= socks_before + 5
                                    and "server connect good.test:443" in log)
        # an HTTP proxy behind TLS (an HTTPS proxy), CONNECT inside the TLS
        fronted = _tunnels(world, "http-tls")
        world.allow(VIA_TLS, "sbx-tls", (), upstream=_over_tls(world, "http"))
        assert _hello(EXT_B, VIA_TLS) == "evil.test:8053\n"
        assert world.upstreams.seen("http-tls", lambda log: log.count("tunnel ") >= fronted + 1)
    finally:
        world.allow(VIA_TLS, "sbx-tls", (), upstream=_over_tls(world))


@pytest.mark.parametrize("tls, why", [
    ({"tls_ca": ""}, "not trusted for proxy.test: unable to get local issuer certificate"),  # the system's store
    ("named-hosts-ca", "not trusted for proxy.test: unable to get local issuer certificate"),  # another CA
    ({"tls_server_name": "other.test"}, "not trusted for other.test: Hostname mismatch"),
    ({"tls_server_name": ""}, f"not trusted for {UPSTREAM}: IP address mismatch"),  # the address's host
], ids=["system-store", "another-ca", "another-name", "address-as-name"])
def test_an_upstream_whose_certificate_does_not_verify_is_never_used(world, tls, why):
    if tls == "named-hosts-ca":
        tls = {"tls_ca": Path(world.upstream_ca).read_text()}
    fronted, socks_before = _tunnels(world, "socks-tls"), world.upstreams.log("socks").count("client connect")
    log_before = world.log_file.read_text(errors="replace") if world.log_file.exists() else ""
    world.allow(VIA_TLS, "sbx-tls", (), upstream=_over_tls(world, **tls))
    try:
        assert _hello(EXT_A, VIA_TLS) == "" and _http(EXT_B, "whatever", VIA_TLS) == ""
        world.allow(VIA_TLS, "sbx-tls", ("good.test",), upstream=_over_tls(world, **tls), deny=("0.0.0.0/0",))
        assert _https(service_ip(POOL), "good.test", VIA_TLS) == ""
    finally:
        world.allow(VIA_TLS, "sbx-tls", (), upstream=_over_tls(world))
    assert _hello(EXT_A, VIA_TLS) == "good.test:8053\n"  # the trusted one again: the world was fine
    log = world.log_file.read_text(errors="replace")[len(log_before):]
    assert log.count(why) >= 3, log
    assert _tunnels(world, "socks-tls") == fronted + 1  # no handshake finished but the trusted one's
    assert world.upstreams.log("socks").count("client connect") <= socks_before + 1
    assert not any(password in log for password in PASSWORDS.values())


def test_over_tls_a_refused_password_fails_the_connection(world):
    world.allow(VIA_TLS, "sbx-tls", (), upstream=_over_tls(world, credential="wrong"))
    try:
        assert _hello(EXT_A, VIA_TLS) == ""
    finally:
        world.allow(VIA_TLS, "sbx-tls", (), upstream=_over_tls(world))
    log = world.log_file.read_text(errors="replace")
    assert "the upstream proxy refused the user and password" in log
    assert "nope" not in log and not any(password in log for password in PASSWORDS.values())


def test_the_node_tables_chained_set_follows_the_slots():
    """vmm.net.host_table: a chained slot's TCP to any address but the resolver's goes to the
    relay port; a slot's veth leaves ``chained`` with ``veths`` (a later slot of that name is
    not chained); a rebuild keeps what it is given."""
    from vmm.net import host_table  # noqa: PLC0415

    prefix = "ut" + uuid.uuid4().hex[:5]
    try:
        host_table.install(prefix, "10.23.200.0/24", ("utv1", "utv2"), dns_ip="10.23.200.1", chained=("utv1",))
        assert host_table.has_chained(prefix)
        listed = subprocess.run(["nft", "list", "table", "inet", host_table.table_name(prefix)], capture_output=True,
                                text=True, check=True).stdout
        rule = f"iifname @chained ip daddr != 10.23.200.1 meta l4proto tcp dnat ip to 10.23.200.1:{CHAIN_PORT}"
        assert rule in listed

        def chained() -> str:
            return subprocess.run(["nft", "list", "set", "inet", host_table.table_name(prefix), "chained"],
                                  capture_output=True, text=True, check=True).stdout

        assert '"utv1"' in chained() and '"utv2"' not in chained()
        host_table.set_chained(prefix, "utv2", True)
        host_table.set_chained(prefix, "utv2", True)  # twice: still once
        assert '"utv2"' in chained()
        host_table.set_chained(prefix, "utv2", False)
        host_table.set_chained(prefix, "utv2", False)  # absent already: nothing to do
        assert '"utv2"' not in chained()
        host_table.remove_veth(prefix, "utv1")
        assert '"utv1"' not in chained()
        host_table.remove_veth(prefix, "utv2")  # never chained: removed all the same
    finally:
        host_table.remove(prefix)
    assert not host_table.has_chained(prefix)


def test_a_node_that_cannot_chain_refuses_egress_proxy_and_slirp_refuses_it(tmp_path):
    from vmm.errors import UnsupportedNetworkPolicy  # noqa: PLC0415
    from vmm.net.netns import NetnsBackend  # noqa: PLC0415
    from vmm.net.slirp import SlirpBackend  # noqa: PLC0415
    from vmm.net.spec import NetworkSpec  # noqa: PLC0415

    spec = NetworkSpec.from_json({"egress_proxy": SOCKS_UP})
    assert spec.upstream() == SOCKS_UP and NetworkSpec.from_json(spec.to_json()) == spec
    assert f"egress through the proxy {UPSTREAM}:{SOCKS} (egressProxy)" in spec.restrictions()
    backend = NetnsBackend.__new__(NetnsBackend)  # no slots: only the check is under test
    backend.egress, backend.egress_error = None, "mitmdump not found at /x"
    backend.check(NetworkSpec())
    with pytest.raises(UnsupportedNetworkPolicy, match="egressProxy needs the node's egress proxy.*mitmdump not found"):
        backend.check(spec)
    with pytest.raises(UnsupportedNetworkPolicy, match="cannot restrict egress.*egressProxy"):
        SlirpBackend("127.0.0.1", tmp_path).check(spec)


UNITS = r"""
import ipaddress, json, sys
sys.path.insert(0, sys.argv[1])
import upstream_chain as u

node = [ipaddress.ip_network("203.0.114.7/32")]
out = {a: [u.refused(a, False, node), u.refused(a, True, node)]
       for a in ("8.8.8.8", "10.1.2.3", "127.0.0.1", "203.0.114.7", "169.254.169.254", "224.0.0.1", "0.0.0.0")}
asked, now = [], [0.0]
def post(url, headers, body, timeout):
    asked.append((url, body))
    return (200, {"password": "pw-" + body["credential"], "ttl": 30}) if body["credential"] != "bad" else (404, {})
p = u.Passwords({"url": "http://api/", "headers": {}}, post, clock=lambda: now[0])
got = [p.password("s1", "c1"), p.password("s1", "c1")]
now[0] = 31.0
got.append(p.password("s1", "c1"))
p.forget("s1")
got.append(p.password("s1", "c1"))
try:
    p.password("s1", "bad")
except u.UpstreamFailed as exc:
    got.append(str(exc))
print(json.dumps({"refused": out, "got": got, "asked": len(asked), "url": asked[0][0]}))
"""


def test_the_dial_time_address_check_and_the_password_cache():
    """upstream_chain in mitmproxy's environment: which upstream addresses a node dials, with
    and without AENV_EGRESS_PROXY_ALLOW_PRIVATE, and the passwords kept for their ttl only."""
    folder = Path(__file__).resolve().parents[2] / "vmm" / "net" / "egress_proxy"
    python = EgressProxy("x", "127.0.0.1", Path("/tmp")).binary.with_name("python3")
    done = subprocess.run([str(python), "-c", UNITS, str(folder)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    r = json.loads(done.stdout)
    refused = r["refused"]
    assert refused["8.8.8.8"] == [None, None]
    assert "not a public address" in refused["10.1.2.3"][0] and refused["10.1.2.3"][1] is None
    assert "not a public address" in refused["127.0.0.1"][0] and refused["127.0.0.1"][1] is None
    assert "this node's" in refused["203.0.114.7"][0] and refused["203.0.114.7"][1] is None
    for never in ("169.254.169.254", "224.0.0.1", "0.0.0.0"):
        assert refused[never][0] and refused[never][1], never  # whatever the setting
    assert r["got"][:4] == ["pw-c1"] * 4 and "(404)" in r["got"][4]
    assert r["asked"] == 4  # once, again after the ttl, again after forget, and the refused one
    assert r["url"] == "http://api/nodes/egress-proxy/resolve"


TLS_CONTEXTS = r"""
import json, ssl, sys
sys.path.insert(0, sys.argv[1])
import upstream_chain as u

out = {}
for name, pem in (("system", ""), ("given", sys.argv[2])):
    c = u.tls_context(pem)
    out[name] = {"verify": c.verify_mode == ssl.CERT_REQUIRED, "hostname": c.check_hostname,
                 "minimum": c.minimum_version.name, "roots": len(c.get_ca_certs())}
out["store"] = len(ssl.create_default_context().get_ca_certs())  # the system's
print(json.dumps(out))
"""


def test_the_upstreams_tls_always_verifies_and_a_given_ca_replaces_the_system_store(world):
    folder = Path(__file__).resolve().parents[2] / "vmm" / "net" / "egress_proxy"
    python = EgressProxy("x", "127.0.0.1", Path("/tmp")).binary.with_name("python3")
    done = subprocess.run([str(python), "-c", TLS_CONTEXTS, str(folder), world.upstreams.tls_ca],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    r = json.loads(done.stdout)
    for name in ("system", "given"):
        assert r[name]["verify"] and r[name]["hostname"] and r[name]["minimum"] == "TLSv1_2", r
    assert r["given"]["roots"] == 1 and r["system"]["roots"] == r["store"]  # the test CA alone, else the system's


RELAY = r"""
import asyncio, json, socket, sys
sys.path.insert(0, sys.argv[1])
import upstream_chain as u

async def main():
    out = {}
    for who in ("mitmproxy", "another"):
        a, b = socket.socketpair()  # a: the upstream's end handed to the relay, b: the far side
        relay = u.Relay(await asyncio.open_connection(sock=a))
        host, port = await relay.open()
        reader, writer = await asyncio.open_connection(host, port)  # the one connection it takes
        mine = writer.get_extra_info("sockname")
        task = asyncio.create_task(relay.run(mine if who == "mitmproxy" else ("127.0.0.1", 1)))
        writer.write(b"ping")
        await writer.drain()
        b.setblocking(False)
        loop = asyncio.get_running_loop()
        try:
            got = await asyncio.wait_for(loop.sock_recv(b, 10), 3)
        except asyncio.TimeoutError:
            got = b"(nothing)"
        late = None
        try:
            await asyncio.wait_for(asyncio.open_connection(host, port), 1)
            late = "accepted"
        except (OSError, asyncio.TimeoutError):
            late = "refused"
        writer.close()
        b.close()
        await asyncio.wait_for(task, 5)
        out[who] = [got.decode(), late]
    print(json.dumps(out))

asyncio.run(main())
"""


def test_the_relay_joins_only_mitmproxys_own_connection_and_takes_one():
    folder = Path(__file__).resolve().parents[2] / "vmm" / "net" / "egress_proxy"
    python = EgressProxy("x", "127.0.0.1", Path("/tmp")).binary.with_name("python3")
    done = subprocess.run([str(python), "-c", RELAY, str(folder)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    r = json.loads(done.stdout)
    assert r["mitmproxy"] == ["ping", "refused"]  # joined; the listener is gone after one connection
    assert r["another"][0] in ("", "(nothing)") and r["another"][1] == "refused"  # never joined to the tunnel
