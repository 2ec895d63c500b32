"""envd's POST /aenv/trust (envd.trust): the node's CA lands in the system bundle, every
certifi copy (links followed, each file once) and Node's NODE_EXTRA_CA_CERTS; again is a no-op,
another CA replaces the old one; the token is required; and Python's ssl, given the patched
bundle, then trusts a leaf of the node's CA. All under a root directory of the test's own."""
import json
import os
import ssl

import httpx
import pytest

from envd import trust
from envd.app import EnvdApp
from envd.state import Settings
from tests.unit.tls_check import handshake
from vmm.egress_ca import NodeCA

SYSTEM = "etc/ssl/certs/ca-certificates.crt"
CERTIFI = "usr/local/lib/python3.11/site-packages/certifi/cacert.pem"
DEBIAN_CERTIFI = "usr/lib/python3/dist-packages/certifi/cacert.pem"  # a link to the system bundle
VENV_CERTIFI = "home/user/.venv/lib/python3.12/site-packages/certifi/cacert.pem"


def _real_bundle() -> str:
    path = ssl.get_default_verify_paths().cafile or "/etc/ssl/certs/ca-certificates.crt"
    return open(path).read() if os.path.exists(path) else ""


@pytest.fixture
def root(tmp_path):
    r = tmp_path / "guest"
    for rel, text in ((SYSTEM, _real_bundle()), (CERTIFI, "# certifi\n" + _real_bundle()),
                      (VENV_CERTIFI, "# venv certifi\n")):
        (r / rel).parent.mkdir(parents=True, exist_ok=True)
        (r / rel).write_text(text)
    (r / VENV_CERTIFI).chmod(0o640)
    (r / DEBIAN_CERTIFI).parent.mkdir(parents=True)
    (r / DEBIAN_CERTIFI).symlink_to(r / SYSTEM)
    (r / "usr/local/share/ca-certificates").mkdir(parents=True)
    return r


@pytest.fixture
def ca(tmp_path):
    return NodeCA.ensure(tmp_path / "node-ca", "n1")


def test_every_store_gets_the_ca_once(root, ca):
    done = trust.install(ca.cert_pem.decode(), str(root))
    assert done["fingerprint"] == ca.fingerprint
    assert sorted(done["bundles"]) == sorted(str(root / p) for p in (SYSTEM, CERTIFI, VENV_CERTIFI))
    for rel in (SYSTEM, CERTIFI, VENV_CERTIFI, DEBIAN_CERTIFI):
        text = (root / rel).read_text()
        assert text.count(ca.fingerprint) == 1 and ca.cert_pem.decode() in text, rel
    assert (root / "home/user/.venv/lib/python3.12/site-packages/certifi/cacert.pem").stat().st_mode & 0o777 == 0o640
    assert (root / trust.CA_FILE.lstrip("/")).read_bytes() == ca.cert_pem
    assert (root / trust.ANCHOR.lstrip("/")).read_bytes() == ca.cert_pem
    assert done["env"] == {"NODE_EXTRA_CA_CERTS": trust.CA_FILE, "SSL_CERT_FILE": "/" + SYSTEM,
                           "REQUESTS_CA_BUNDLE": "/" + SYSTEM}
    assert trust.installed_env(str(root)) == done["env"]
    assert trust.install(ca.cert_pem.decode(), str(root))["bundles"] == []  # again: nothing changes


def test_another_nodes_ca_replaces_the_old_one(root, ca, tmp_path):
    trust.install(ca.cert_pem.decode(), str(root))
    other = NodeCA.ensure(tmp_path / "other-ca", "n2")
    trust.install(other.cert_pem.decode(), str(root))
    for rel in (SYSTEM, CERTIFI, VENV_CERTIFI):
        text = (root / rel).read_text()
        assert other.fingerprint in text and ca.fingerprint not in text and text.count(trust.MARK) == 1


def test_pythons_ssl_with_the_patched_bundle_trusts_a_leaf_of_the_node_ca(root, ca):
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(ca.leaf("api.example.com"), root / SYSTEM, "api.example.com")
    trust.install(ca.cert_pem.decode(), str(root))
    assert handshake(ca.leaf("api.example.com"), root / SYSTEM, "api.example.com") == b"ok"
    assert handshake(ca.leaf("api.example.com"), root / CERTIFI, "api.example.com") == b"ok"
    if _real_bundle():  # the real CAs still there: the patch appended, it did not replace
        assert ssl.create_default_context(cafile=str(root / SYSTEM)).cert_store_stats()["x509_ca"] > 1


@pytest.mark.parametrize("pem", [None, "", "not a certificate", "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"])
def test_anything_but_one_certificate_is_refused(root, pem):
    with pytest.raises(trust.BadCertificate):
        trust.install(pem, str(root))


def test_a_certificate_that_is_no_ca_is_refused(root, ca):
    with pytest.raises(trust.BadCertificate, match="not a CA"):
        trust.install(ca.leaf("api.example.com").cert_pem.decode(), str(root))


def test_two_certificates_are_refused(root, ca, tmp_path):
    other = NodeCA.ensure(tmp_path / "o", "n2")
    with pytest.raises(trust.BadCertificate, match="exactly one"):
        trust.install((ca.cert_pem + other.cert_pem).decode(), str(root))


async def test_the_route_needs_the_token_and_processes_get_the_env(root, ca):
    settings = Settings(template_file=str(root / "none.json"), access_token="tok", trust_root=str(root))
    app = EnvdApp(settings)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://envd") as client:
        body = {"pem": ca.cert_pem.decode()}
        assert (await client.post("/aenv/trust", json=body)).status_code == 401
        bad = await client.post("/aenv/trust", json={"pem": "x"}, headers={"X-Access-Token": "tok"})
        assert bad.status_code == 400
        ok = await client.post("/aenv/trust", json=body, headers={"X-Access-Token": "tok"})
        assert ok.status_code == 200 and ok.json()["fingerprint"] == ca.fingerprint
        envs = (await client.get("/envs", headers={"X-Access-Token": "tok"})).json()
        assert envs["NODE_EXTRA_CA_CERTS"] == trust.CA_FILE
        # the sandbox's own env vars still win
        await client.post("/init", json={"envVars": {"NODE_EXTRA_CA_CERTS": "/mine.pem"}},
                          headers={"X-Access-Token": "tok"})
        assert (await client.get("/envs", headers={"X-Access-Token": "tok"})).json()["NODE_EXTRA_CA_CERTS"] == "/mine.pem"
    restarted = Settings(template_file=str(root / "none.json"), trust_root=str(root))
    restarted.load_trust()  # a restarted envd, a cold-booted disk
    assert restarted.env()["NODE_EXTRA_CA_CERTS"] == trust.CA_FILE
    assert json.loads((root / trust.ENV_FILE.lstrip("/")).read_text())["fingerprint"] == ca.fingerprint


def test_a_guest_without_bundles_still_gets_the_file_and_node_env(tmp_path, ca):
    done = trust.install(ca.cert_pem.decode(), str(tmp_path))
    assert done["bundles"] == [] and done["env"] == {"NODE_EXTRA_CA_CERTS": trust.CA_FILE}
    assert (tmp_path / trust.CA_FILE.lstrip("/")).exists()
