"""vmm.net.domains: which allowOut domain entries aenv accepts and which names they match
(E2B's semantics; the egress proxy loads the same file)."""
import pytest

from vmm.net import domains


@pytest.mark.parametrize("entry, stored", [
    ("example.com", "example.com"), ("EXAMPLE.com.", "example.com"), ("*.example.com", "*.example.com"),
    ("*", "*"), ("xn--bcher-kva.example", "xn--bcher-kva.example"), ("_srv.example.com", "_srv.example.com"),
    ("exa mple.com", None), ("*.*.example.com", None), ("ex*ample.com", None), ("-bad.example", None),
    ("", None), ("a" * 64 + ".com", None), ("1.2.3.4", None), ("example..com", None), ("*.", "*"),
])
def test_entries(entry, stored):
    assert domains.normalise(entry) == stored


@pytest.mark.parametrize("value, host", [
    ("good.test", "good.test"), ("Good.Test:8080", "good.test"), ("good.test.", "good.test"),
    ("[::1]:80", "::1"), ("", None), (None, None),
])
def test_host_of(value, host):
    assert domains.host_of(value) == host


@pytest.mark.parametrize("host, patterns, allowed", [
    ("example.com", ["example.com"], True),
    ("www.example.com", ["example.com"], False),  # an exact entry is that name only
    ("www.example.com", ["*.example.com"], True),
    ("a.b.example.com", ["*.example.com"], True),
    ("example.com", ["*.example.com"], False),  # not the apex
    ("badexample.com", ["*.example.com"], False),
    ("example.com.evil.test", ["example.com"], False),
    ("anything.test", ["*"], True),
    ("1.2.3.4", ["*"], False),  # a bare address is never a domain
    ("::1", ["*"], False),
    (None, ["*"], False),
    ("bad name", ["*"], False),
    ("x.test", [], False),
])
def test_matches(host, patterns, allowed):
    assert domains.matches(host, patterns) is allowed
