"""The node's side of the guest trust store (agent.egress_trust): the CA made at the node's
start, installed through envd's /aenv/trust (over real HTTP) only for a sandbox with rules, and a
start undone when the install fails."""
import socket
import threading
import time
from types import SimpleNamespace

import pytest
import uvicorn

from agent import egress_trust, tasks
from envd import trust
from envd.app import EnvdApp
from envd.state import Settings
from vmm.net.spec import NetworkSpec


@pytest.fixture
def node_ca_dir(settings, tmp_path):
    settings.AENV_EGRESS_CA_DIR = tmp_path / "egress-ca"
    egress_trust._ca.cache_clear()
    yield settings.AENV_EGRESS_CA_DIR
    egress_trust._ca.cache_clear()


@pytest.fixture
def envd_server(tmp_path):
    """A real envd on loopback, its trust root a directory of the test's own."""
    root = tmp_path / "guest"
    (root / "etc/ssl/certs").mkdir(parents=True)
    (root / "etc/ssl/certs/ca-certificates.crt").write_text("")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = Settings(template_file=str(root / "none.json"), access_token="tok", trust_root=str(root))
    server = uvicorn.Server(uvicorn.Config(EnvdApp(settings), host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield SimpleNamespace(port=port, root=root, settings=settings)
    server.should_exit = True
    thread.join(5)


def test_the_ca_is_made_once_per_node(node_ca_dir):
    first = egress_trust.node_ca()
    assert (node_ca_dir / "ca.key").stat().st_mode & 0o777 == 0o600
    egress_trust._ca.cache_clear()
    assert egress_trust.node_ca().fingerprint == first.fingerprint


@pytest.mark.parametrize("network, needed", [
    (None, False), ({}, False), ({"rules": {}}, False), (NetworkSpec(), False),
    ({"rules": {"h": [{"transform": {"headers": {"A": "b"}}}]}}, True),
    (SimpleNamespace(rules={"h": []}), True),
])
def test_only_a_sandbox_with_rules_needs_it(network, needed):
    assert egress_trust.needs_ca(network) is needed


def test_installed_in_a_real_envd_over_http(node_ca_dir, envd_server):
    done = egress_trust.install_in_guest("127.0.0.1", envd_server.port, "tok")
    ca = egress_trust.node_ca()
    assert done["fingerprint"] == ca.fingerprint
    assert ca.fingerprint in (envd_server.root / "etc/ssl/certs/ca-certificates.crt").read_text()
    assert envd_server.settings.env()["NODE_EXTRA_CA_CERTS"] == trust.CA_FILE
    with pytest.raises(egress_trust.TrustFailed):
        egress_trust.install_in_guest("127.0.0.1", envd_server.port, "wrong-token")


def _info():
    return SimpleNamespace(sandbox_id="i1", envd_host="127.0.0.1", envd_port=1)


def test_init_installs_only_with_rules_and_undoes_the_start_when_it_fails(monkeypatch):
    calls, undone = [], []
    monkeypatch.setattr(tasks, "init_envd", lambda *a: calls.append("init"))
    monkeypatch.setattr(egress_trust, "install_in_guest", lambda *a: calls.append("trust"))
    tasks._init_envd_or_undo(_info(), {}, "tok", undo=undone.append, what="killing its VM")
    tasks._init_envd_or_undo(_info(), {}, "tok", undo=undone.append, what="killing its VM",
                             network={"rules": {"h": [{}]}})
    assert calls == ["init", "init", "trust"] and undone == []

    def refuse(*a):
        raise egress_trust.TrustFailed("envd said no")

    monkeypatch.setattr(egress_trust, "install_in_guest", refuse)
    with pytest.raises(egress_trust.TrustFailed):
        tasks._init_envd_or_undo(_info(), {}, "tok", undo=undone.append, what="killing its VM",
                                 network={"rules": {"h": [{}]}})
    assert undone == ["i1"]


class _Driver:
    """Just what update_network uses: a VM's info and its policy."""

    def __init__(self, status):
        from vmm.driver import VMStatus  # noqa: PLC0415

        self.status = getattr(VMStatus, status)
        self.policy = None

    def info(self, sandbox_id):
        return SimpleNamespace(sandbox_id=sandbox_id, envd_host="127.0.0.1", envd_port=1, status=self.status)

    def update_network(self, sandbox_id, spec):
        self.policy = spec


RULES = {"rules": {"api.example.com": [{"transform": {"headers": {"X": "${e2b.secrets.k}"}}}]}}


@pytest.mark.parametrize("status, network, installs", [
    ("RUNNING", RULES, True), ("RUNNING", {"allow_out": ["10.0.0.0/8"]}, False), ("SAVED", RULES, False),
])
def test_a_network_update_with_rules_installs_the_ca_first(monkeypatch, status, network, installs):
    driver, calls = _Driver(status), []
    monkeypatch.setattr(tasks, "get_driver", lambda: driver)
    monkeypatch.setattr(egress_trust, "install_in_guest", lambda host, port, token: calls.append((port, token)))
    tasks.update_network(sandbox_id="i1", network=network, access_token="tok")
    assert calls == ([(1, "tok")] if installs else []) and driver.policy is not None


def test_a_guest_that_cannot_trust_it_keeps_its_old_policy(monkeypatch):
    driver = _Driver("RUNNING")
    monkeypatch.setattr(tasks, "get_driver", lambda: driver)

    def refuse(*a):
        raise egress_trust.TrustFailed("envd said no")

    monkeypatch.setattr(egress_trust, "install_in_guest", refuse)
    with pytest.raises(egress_trust.TrustFailed):
        tasks.update_network(sandbox_id="i1", network=RULES, access_token="tok")
    assert driver.policy is None


async def test_the_control_plane_sends_the_token_only_when_given(monkeypatch):
    from nodes import client  # noqa: PLC0415

    sent = []

    async def fake_call(node, name, kwargs, deadline, what):
        sent.append(kwargs)
        return {"timings": {}}

    monkeypatch.setattr(client, "_call", fake_call)
    await client.update_network(None, sandbox_id="i1", network=RULES, access_token="tok")
    await client.update_network(None, sandbox_id="i1", network={})
    assert sent == [{"sandbox_id": "i1", "network": RULES, "access_token": "tok"}, {"sandbox_id": "i1", "network": {}}]


def test_the_driver_hands_the_proxy_the_node_ca_the_secrets_client_and_the_upstream_ca(node_ca_dir, settings):
    from agent import driver  # noqa: PLC0415

    settings.AENV_EGRESS_UPSTREAM_CA = "/etc/aenv/upstream.pem"
    settings.AENV_CONTROL_PLANE_URL = "https://cp.example"
    options = driver._egress_options()
    ca = egress_trust.node_ca()
    assert options["ca_pem"] == ca.mitmproxy_pem() and b"PRIVATE KEY" in options["ca_pem"]
    assert options["secrets"]["url"] == "https://cp.example" and options["secrets"]["headers"]["Authorization"]
    assert options["upstream_ca"] == "/etc/aenv/upstream.pem"
