"""The node egress proxy (vmm.net.egress: mitmproxy with aenv's addon) against named test
hosts in a namespace of the test's own, without a VM: a client bound to a "slot address" on
the node talks to the proxy as a slot's and the node's DNATs would deliver it (the port kept
for SO_ORIGINAL_DST), and the proxy lets through only names the slot's list allows, to the
address the node's resolver gives for them, at the port asked for; TLS to a host with rules
(and only that) is intercepted with the node's CA and gets the rules' headers, secret markers
filled from a stand-in for the API's resolve route.
The slot's nftables side is in test_vmm_net_policy.py; a real guest in
tests/integration/test_egress_domains.py."""
import os
import pwd
import socket
import ssl
import stat
import time
import uuid
from pathlib import Path

import pytest

from harness.api_stand_in import StandIn, served
from harness.named_hosts import proxy_world
from harness.networld import EXT_B
from vmm.net import slots
from vmm.net.dns import service_ip
from vmm.net.egress import EgressProxy

# one worker for the module (xdist --dist loadgroup): its world (an external host on the run's
# external /24, a resolver on its pool's base + 1) exists once per run
pytestmark = [pytest.mark.xdist_group("egress_proxy"),
              pytest.mark.skipif(not slots.netns_supported(), reason="needs root, nft and nsenter (netns backend)"),
              pytest.mark.skipif(not EgressProxy("x", "127.0.0.1", Path("/tmp")).available(),
                                 reason="mitmproxy is not installed in .venv-egress (scripts/setup.sh)")]

_SECOND = os.environ.get("AENV_NET_POOL", "10.100.0.0/20").split(".")[1]
POOL = f"10.17.{_SECOND}.0/24"  # this session's own: its base + 1 (resolver, proxy) and + 3 (a client)
CLIENT = f"10.17.{_SECOND}.3"
OTHER_CLIENT = f"10.17.{_SECOND}.5"  # a "slot" without a policy file
TLS, HTTP = 443, 80  # the guest's ports: the DNAT keeps them
MAX = 6  # connections per sandbox through the proxy


SECRET = "s3cret-value"


class SecretsAPI(StandIn):
    """Stands in for the API's ``POST /nodes/secrets/resolve``: ``tok`` for good.test only,
    ``down`` fails (503), anything else is refused (403). Every ask is recorded."""

    asked: list = []

    def answer(self, body: dict) -> tuple[int, dict]:
        if body["name"] == "tok" and body["host"] == "good.test":
            return 200, {"value": SECRET, "version": 1, "ttl": 0}
        if body["name"] == "down":
            return 503, {"message": "unavailable"}
        return 403, {"message": "not for that host"}


@pytest.fixture(scope="module")
def api():
    with served(SecretsAPI) as secrets:
        yield secrets


@pytest.fixture(scope="module")
def proxy(api):
    with proxy_world(POOL, (CLIENT, OTHER_CLIENT), max_connections=MAX, secrets=api) as egress:
        egress.allow(CLIENT, "sbx-test", ("good.test", "loop.test"))
        try:
            yield egress
        finally:
            if egress.log_file.exists():
                print(egress.log_file.read_text()[-3000:])  # shown when a test failed


def _connect(port: int, source: str = CLIENT) -> socket.socket:
    sock = socket.create_connection((service_ip(POOL), port), timeout=10, source_address=(source, 0))
    sock.settimeout(10)
    return sock


def _https(sni: str | None, host: str, source: str = CLIENT, port: int = TLS, cadata: str | None = None,
           headers: str = "", issuer: list | None = None) -> str:
    """GET / over TLS with ``sni`` (None: no SNI at all) and ``host``: the body, or "" if closed.
    ``cadata``: verify the server's certificate (and its name) against that CA (PEM);
    ``issuer``: gets the certificate's issuer."""
    context = ssl.create_default_context(cadata=cadata)
    if cadata is None:
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    raw = _connect(port, source)
    try:
        with context.wrap_socket(raw, server_hostname=sni) as tls:
            if issuer is not None:
                issuer.append(dict(x[0] for x in tls.getpeercert()["issuer"]) if cadata else None)
            tls.sendall(f"GET / HTTP/1.1\r\nHost: {host}\r\n{headers}Connection: close\r\n\r\n".encode())
            return _read(tls)
    except (ssl.SSLError, ConnectionError, OSError):
        return ""
    finally:
        raw.close()


def _read(sock) -> str:
    out = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except (ssl.SSLError, ConnectionError, OSError):
            break
        if not chunk:
            break
        out += chunk
    return out.decode(errors="replace")


def _http(*hosts: str, source: str = CLIENT, headers: str = "") -> list[str]:
    """One keep-alive connection, a GET per Host in ``hosts``: each answer's status line and body."""
    sock = _connect(HTTP, source)
    answers = []
    with sock:
        stream = sock.makefile("rb")
        for host in hosts:
            sock.sendall(f"GET / HTTP/1.1\r\nHost: {host}\r\n{headers}\r\n".encode())
            status = stream.readline().decode().strip()
            if not status:
                answers.append("closed")
                break
            length = 0
            while (line := stream.readline().decode().strip()):
                if line.lower().startswith("content-length:"):
                    length = int(line.split(":")[1])
            answers.append(f"{status} {stream.read(length).decode().strip()}")
    return answers


def test_https_is_judged_by_sni_and_pinned_to_the_names_address(proxy):
    assert "good.test host=good.test" in _https("good.test", "good.test")
    # SNI allowed, Host not: the connection still goes to good.test's address, never evil's
    assert "good.test host=evil.test" in _https("good.test", "evil.test")
    assert _https("evil.test", "good.test") == ""  # SNI not allowed
    assert _https(None, "good.test") == ""  # no SNI at all
    assert _https("GOOD.test.", "good.test").startswith("HTTP/1.1 200")  # case and a trailing dot


def test_tls_on_another_port_is_judged_too_and_goes_to_that_port(proxy):
    assert "good.test host=good.test" in _https("good.test", "good.test", port=8443)
    assert _https("evil.test", "evil.test", port=8443) == ""
    with _connect(8053) as sock:  # neither TLS nor HTTP: nothing to judge by, closed
        sock.sendall(b"hello\r\n\r\n")
        answer = _read(sock)
        assert "evil.test" not in answer and "good.test" not in answer


def test_http_is_judged_per_request_by_host(proxy):
    assert _http("good.test")[0].startswith("HTTP/1.1 200") and "good.test host=good.test" in _http("good.test")[0]
    first, second = _http("good.test", "evil.test")
    assert "good.test" in first and second.startswith("HTTP/1.1 403")  # the next request on the connection
    assert _http("evil.test")[0].startswith("HTTP/1.1 403")
    assert _http(EXT_B)[0].startswith("HTTP/1.1 403")  # a bare address is never a domain


def test_a_name_resolving_to_a_denied_range_is_refused(proxy):
    assert _http("loop.test")[0].startswith("HTTP/1.1 403")  # allowed by name, but 127.0.0.1


def test_a_slot_without_a_list_and_the_wrong_protocol_get_nothing(proxy):
    assert _https("good.test", "good.test", source=OTHER_CLIENT) == ""
    assert _http("good.test", source=OTHER_CLIENT)[0].startswith("HTTP/1.1 403")
    with _connect(TLS) as sock:  # plain HTTP where TLS is due
        sock.sendall(b"GET / HTTP/1.1\r\nHost: good.test\r\n\r\n")
        assert "good.test host" not in _read(sock)
    with _connect(TLS) as sock:  # not TLS, not HTTP
        sock.sendall(b"\x00\x01hello there\r\n\r\n")
        assert "good.test" not in _read(sock)


def test_a_list_change_applies_to_the_next_connection(proxy):
    proxy.allow(CLIENT, "sbx-test", ("*.test",))
    try:
        assert "evil.test host=evil.test" in _https("evil.test", "evil.test")
    finally:
        proxy.allow(CLIENT, "sbx-test", ("good.test", "loop.test"))
    assert _https("evil.test", "evil.test") == ""


def _closed_at_once() -> bool:
    """Whether a new connection is closed (or reset) within a second of sending a byte."""
    with _connect(TLS) as extra:
        extra.settimeout(1)
        extra.sendall(b"x")
        try:
            return extra.recv(100) == b""
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False  # still open: the proxy waits for more of a ClientHello


def _within(seconds: float, check) -> bool:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            return False
    return True


def test_one_sandbox_holds_at_most_max_connections_through_the_proxy(proxy):
    held = [_connect(TLS) for _ in range(MAX)]  # open, no ClientHello yet
    proxy.allow(OTHER_CLIENT, "sbx-other", ("good.test",))
    try:
        assert _within(15, _closed_at_once)  # once the proxy has counted the MAX held ones
        assert "good.test host=good.test" in _https("good.test", "good.test", source=OTHER_CLIENT)  # others unaffected
        held.pop().close()
        assert _within(15, lambda: "good.test host=good.test" in _https("good.test", "good.test"))  # room again
    finally:
        proxy.forget(OTHER_CLIENT)
        for sock in held:
            sock.close()


def test_the_node_list_leaves_out_addresses_the_denied_ranges_cover():
    """Slot veths (in 10/8) come and go: the proxy's config, and so the running proxy, stays."""
    config = EgressProxy("p", "10.12.0.1", Path("/tmp"), node=("10.12.0.2/32", "203.0.114.7/32"),
                         reopened=(f"{EXT_B}/32",))._node_config()
    assert config["node"] == ["203.0.114.7/32"] and config["reopened"] == [f"{EXT_B}/32"]
    assert config["max_connections"] == 256 and "10.0.0.0/8" in config["denied"]


# -- network.rules: interception only for ruled hosts, header transforms, secrets ------------------

DOMAINS = ("good.test", "evil.test", "alias.test")


@pytest.fixture
def ruled(proxy):
    """CLIENT with rules for good.test (and alias.test); put back afterwards."""
    def rules(good: dict, **more):
        proxy.allow(CLIENT, "sbx-test", DOMAINS, {"good.test": [{"X-Aenv-Rule": "one"}, good], **more})
    yield rules
    proxy.allow(CLIENT, "sbx-test", ("good.test", "loop.test"))


def _hosts_ca(proxy) -> str:
    return (Path(proxy.upstream_ca)).read_text()


def test_only_tls_to_a_ruled_host_is_intercepted_with_the_node_ca(proxy, ruled):
    ruled({"X-Aenv-Second": "two"})
    node_ca = proxy.ca.cert_pem.decode()
    issuer: list = []
    body = _https("good.test", "good.test", cadata=node_ca, issuer=issuer)
    assert issuer == [{"organizationName": "aenv", "commonName": "aenv egress CA test"}]
    assert "good.test host=good.test" in body
    assert "x-aenv-rule: one" in body and "x-aenv-second: two" in body
    # evil.test has no rules: passed through untouched, the server's own certificate (the hosts' CA)
    assert _https("evil.test", "evil.test", cadata=node_ca) == ""
    passed = _https("evil.test", "evil.test", cadata=_hosts_ca(proxy), headers="X-Aenv-Guest: mine\r\n")
    assert "evil.test host=evil.test" in passed and "x-aenv-guest: mine" in passed and "x-aenv-rule" not in passed
    # the node CA's key is the proxy user's alone
    ca_file = proxy.conf / "mitmproxy-ca.pem"
    assert stat.S_IMODE(ca_file.stat().st_mode) == 0o600 and stat.S_IMODE(proxy.conf.stat().st_mode) == 0o700


def test_rules_apply_to_http_too_and_replace_the_guests_header(proxy, ruled):
    ruled({"X-Aenv-Rule-2": "two"})
    (answer,) = _http("good.test", headers="X-Aenv-Rule: forged\r\n")
    assert answer.startswith("HTTP/1.1 200") and "x-aenv-rule: one" in answer and "forged" not in answer
    first, second = _http("good.test", "evil.test", headers="X-Aenv-Guest: g\r\n")
    assert "x-aenv-rule: one" in first
    assert "evil.test host=evil.test" in second and "x-aenv-rule" not in second and "x-aenv-guest: g" in second


def test_a_secret_marker_is_filled_by_the_proxy_and_never_written_down(proxy, ruled, api):
    SecretsAPI.asked.clear()
    ruled({"Authorization": "Bearer ${e2b.secrets.tok}"})
    body = _https("good.test", "good.test", cadata=proxy.ca.cert_pem.decode())
    assert f"authorization: Bearer {SECRET}" in body
    assert SecretsAPI.asked[-1] == {"sandboxID": "sbx-test", "name": "tok", "host": "good.test",
                                    "auth": "Bearer node-cred"}
    assert f"authorization: Bearer {SECRET}" in _http("good.test")[0]
    slot_file = (proxy.slots_dir / f"{CLIENT}.json").read_text()
    assert "${e2b.secrets.tok}" in slot_file and SECRET not in slot_file


def test_a_refused_or_unavailable_secret_fails_the_request(proxy, ruled):
    ruled({"Authorization": "Bearer ${e2b.secrets.other}"})
    refused = _https("good.test", "good.test", cadata=proxy.ca.cert_pem.decode())
    assert refused.startswith("HTTP/1.1 403") and "good.test host" not in refused and "${e2b" not in refused
    assert _http("good.test")[0].startswith("HTTP/1.1 403")
    ruled({"Authorization": "Bearer ${e2b.secrets.down}"})
    down = _https("good.test", "good.test", cadata=proxy.ca.cert_pem.decode())
    assert down.startswith("HTTP/1.1 502") and "good.test host" not in down


def test_an_intercepted_upstream_must_prove_the_name(proxy, ruled):
    # alias.test resolves to good.test's server, whose certificate does not name alias.test
    ruled({}, **{"alias.test": [{"X-Aenv-Rule": "alias"}]})
    answer = _https("alias.test", "alias.test", cadata=proxy.ca.cert_pem.decode())
    assert answer.startswith("HTTP/1.1 502") and "good.test host" not in answer
    # without a rule the same connection passes through (the guest sees the real certificate)
    ruled({})
    assert "good.test host=alias.test" in _https("alias.test", "alias.test")


def test_an_intercepted_upstream_must_chain_to_the_trusted_cas(proxy, ruled):
    ruled({})
    trusted, proxy.upstream_ca = proxy.upstream_ca, None  # mitmproxy's own bundle: the test CA is not in it
    try:
        proxy.ensure()
        answer = _https("good.test", "good.test", cadata=proxy.ca.cert_pem.decode())
        assert answer.startswith("HTTP/1.1 502") and "good.test host" not in answer
    finally:
        proxy.upstream_ca = trusted
        proxy.ensure()
    assert "x-aenv-rule: one" in _https("good.test", "good.test", cadata=proxy.ca.cert_pem.decode())


def test_a_node_refuses_rules_its_proxy_cannot_apply(proxy, tmp_path):
    """Rules need domains (only then does traffic pass the proxy) and a running proxy holding
    the node's CA; anything else is UnsupportedNetworkPolicy (a 400), never accepted unapplied."""
    from vmm.errors import UnsupportedNetworkPolicy  # noqa: PLC0415
    from vmm.net.netns import NetnsBackend  # noqa: PLC0415
    from vmm.net.spec import NetworkSpec  # noqa: PLC0415

    ruled = NetworkSpec.from_json({"allow_out": ["good.test"], "deny_out": ["0.0.0.0/0"],
                                   "rules": {"good.test": [{"X-Aenv-Rule": "one"}]}})
    assert NetworkSpec.from_json(ruled.to_json()) == ruled
    assert ruled.rules_json() == {"good.test": [{"X-Aenv-Rule": "one"}]}
    backend = NetnsBackend(tmp_path, prefix="gr" + uuid.uuid4().hex[:4], pool=POOL, warm=0, dns=False)
    with pytest.raises(UnsupportedNetworkPolicy, match="egress proxy"):
        backend.check(ruled)  # no proxy at all
    backend.egress = proxy
    backend.check(ruled)  # the running proxy with the node's CA
    with pytest.raises(UnsupportedNetworkPolicy, match="allowOut must name"):
        backend.check(NetworkSpec(deny_out=("0.0.0.0/0",), rules=ruled.rules))
    without_ca = EgressProxy(proxy.prefix, proxy.ip, tmp_path)  # the same process, as a node without a CA sees it
    backend.egress = without_ca
    with pytest.raises(UnsupportedNetworkPolicy, match="node's CA"):
        backend.check(ruled)
    backend.check(NetworkSpec(allow_out=("good.test",), deny_out=("0.0.0.0/0",)))  # domains alone still fine


@pytest.mark.django_db(transaction=True)
def test_secrets_through_the_real_api_from_create_to_the_request(proxy, live_server, team, base_template, node):
    """The whole chain without a VM: a team secret, a sandbox row whose rules name it (checked
    and turned into the node's spec as the API does), the proxy asking the real resolve route
    with the node's credential: the value reaches good.test's server; the API (not the slot
    file) decides where a value may go."""
    from django.conf import settings as django_settings  # noqa: PLC0415
    from django.utils import timezone  # noqa: PLC0415

    from agent.egress_secrets import node_headers  # noqa: PLC0415
    from lifecycle.sandboxes import network as sandbox_network  # noqa: PLC0415
    from sandboxes.models import Sandbox  # noqa: PLC0415
    from team_secrets import store  # noqa: PLC0415
    from vmm.net.spec import NetworkSpec  # noqa: PLC0415

    store.create(team, "tok", "the-real-value")
    network = sandbox_network.checked_create({"allowOut": ["good.test"], "denyOut": ["0.0.0.0/0"], "rules": {
        "good.test": [{"transform": {"headers": {"Authorization": "token ${e2b.secrets.tok}"}}}]}}, None)
    sandbox = Sandbox.objects.create(team=team, template=base_template, node=node, state="running", network=network,
                                     end_at=timezone.now() + timezone.timedelta(hours=1))
    spec = NetworkSpec.from_json(sandbox_network.spec_of(sandbox))
    before = proxy.secrets
    proxy.secrets = {"url": live_server.url, "headers": node_headers(node.pk, None, django_settings.SECRET_KEY)}
    try:
        proxy.ensure()  # restarted with the new secrets configuration
        proxy.allow(CLIENT, sandbox.pk, DOMAINS, spec.rules_json())
        assert "authorization: token the-real-value" in _https("good.test", "good.test",
                                                               cadata=proxy.ca.cert_pem.decode())
        # a slot file that sends the marker elsewhere gets nothing: the row's rules do not
        elsewhere = {**spec.rules_json(), "evil.test": [{"X-Aenv-K": "${e2b.secrets.tok}"}]}
        proxy.allow(CLIENT, sandbox.pk, DOMAINS, elsewhere)
        (refused,) = _http("evil.test")
        assert refused.startswith("HTTP/1.1 403") and "secret" in refused and "evil.test host" not in refused
        assert "the-real-value" not in (proxy.slots_dir / f"{CLIENT}.json").read_text()
    finally:
        proxy.secrets = before
        proxy.allow(CLIENT, "sbx-test", ("good.test", "loop.test"))
        proxy.ensure()


def test_an_upstream_ca_bundle_in_a_folder_of_roots_alone_still_verifies(proxy, ruled, tmp_path):
    """The proxy runs as nobody: it verifies against its own copy of the bundle (the real VM
    test's CA sat in pytest's 0700 folder, and every intercepted request was a 502)."""
    ruled({})
    private = tmp_path / "root-only"
    private.mkdir(mode=0o700)
    bundle = private / "ca.pem"
    bundle.write_text(_hosts_ca(proxy))
    bundle.chmod(0o600)
    trusted, proxy.upstream_ca = proxy.upstream_ca, str(bundle)
    try:
        proxy.ensure()
        assert "x-aenv-rule: one" in _https("good.test", "good.test", cadata=proxy.ca.cert_pem.decode())
        copy = proxy.conf / "upstream-ca.pem"
        assert copy.read_text() == bundle.read_text() and stat.S_IMODE(copy.stat().st_mode) == 0o600
        assert copy.stat().st_uid == pwd.getpwnam("nobody").pw_uid
        bundle.write_text(_hosts_ca(proxy) + "\n")  # a new content: the next ensure() restarts the proxy
        pid = proxy.pid()
        proxy.ensure()
        assert proxy.pid() != pid and copy.read_text() == bundle.read_text()
    finally:
        proxy.upstream_ca = trusted
        proxy.ensure()


def test_a_missing_upstream_ca_bundle_stops_the_start(tmp_path):
    """A typo in AENV_EGRESS_UPSTREAM_CA is said at the node's start, not as 502s later."""
    from vmm.net.egress import EgressProxyError  # noqa: PLC0415

    with pytest.raises(EgressProxyError, match="AENV_EGRESS_UPSTREAM_CA"):
        EgressProxy("u" + uuid.uuid4().hex[:5], "127.0.0.1", tmp_path, upstream_ca=str(tmp_path / "nope.pem")).ensure()
