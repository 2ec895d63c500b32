"""The node's TLS-interception CA (vmm.egress_ca): made once, owner-only key, reused; leaves
issued per host that Python's ssl verifies against the CA (and not against anything else),
for that host only."""
import ssl
import stat

import pytest
from cryptography import x509

from tests.unit.tls_check import handshake
from vmm.egress_ca import BadHost, NodeCA


@pytest.fixture
def ca(tmp_path):
    return NodeCA.ensure(tmp_path / "egress-ca", "n1")


def test_made_once_owner_only_and_reused(tmp_path, ca):
    assert stat.S_IMODE(ca.key_path.stat().st_mode) == 0o600
    again = NodeCA.ensure(tmp_path / "egress-ca", "n1")
    assert again.fingerprint == ca.fingerprint
    ca.key_path.chmod(0o644)
    assert NodeCA.ensure(tmp_path / "egress-ca").fingerprint == ca.fingerprint
    assert stat.S_IMODE(ca.key_path.stat().st_mode) == 0o600
    cert = x509.load_pem_x509_certificate(ca.cert_path.read_bytes())
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert b"PRIVATE KEY" not in ca.cert_path.read_bytes()


def test_half_a_ca_is_made_again(tmp_path, ca):
    ca.key_path.unlink()
    remade = NodeCA.ensure(tmp_path / "egress-ca", "n1")
    assert remade.fingerprint != ca.fingerprint and remade.key_path.exists()


def test_leaves_are_cached_per_host(ca):
    a = ca.leaf("API.Example.com.")
    assert ca.leaf("api.example.com") is a and ca.leaf("other.example.com") is not a
    cert = x509.load_pem_x509_certificate(a.cert_pem)
    assert cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName) == ["api.example.com"]
    assert a.chain_pem.endswith(ca.cert_pem)


def test_the_mitmproxy_form_holds_the_key_then_the_certificate(ca):
    pem = ca.mitmproxy_pem()
    assert pem.startswith(b"-----BEGIN PRIVATE KEY-----") and pem.endswith(ca.cert_pem)


@pytest.mark.parametrize("host", ["", "*.example.com", "a..b", "-x.com", "x" * 64 + ".com", "a b"])
def test_no_leaf_for_bad_names(ca, host):
    with pytest.raises(BadHost):
        ca.leaf(host)


def test_a_leaf_verifies_against_the_ca_with_pythons_ssl(ca):
    assert handshake(ca.leaf("api.example.com"), ca.cert_path, "api.example.com") == b"ok"
    assert handshake(ca.leaf("10.1.2.3"), ca.cert_path, "10.1.2.3") == b"ok"


def test_the_leaf_is_for_its_host_only_and_another_ca_does_not_vouch_for_it(tmp_path, ca):
    with pytest.raises(ssl.SSLCertVerificationError, match="match|mismatch"):
        handshake(ca.leaf("api.example.com"), ca.cert_path, "evil.example.com")
    other = NodeCA.ensure(tmp_path / "other", "n2")
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(ca.leaf("api.example.com"), other.cert_path, "api.example.com")
