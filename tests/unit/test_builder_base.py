"""Which registries a build may pull from, and how (``agent.builder.base``): the node pulls
on the user's behalf, so a registry on a private or local address is refused unless the
operator lists it; loopback and listed registries may be plain HTTP; only username and
password credentials are taken."""
import socket

import pytest

from agent.builder.base import check_registry_address, credentials_of, insecure_registry
from agent.builder.guest import StepFailed


def resolver(*addresses):
    def resolve(host, port, proto=0):
        if not addresses:
            raise socket.gaierror("no such host")
        return [(socket.AF_INET, socket.SOCK_STREAM, proto, "", (a, port)) for a in addresses]
    return resolve


@pytest.mark.parametrize("address", ["127.0.0.1", "10.1.2.3", "192.168.0.10", "172.16.5.5", "169.254.169.254",
                                     "100.64.0.1", "::1", "fd00::1", "0.0.0.0"])
def test_a_registry_on_an_inner_address_is_refused(address):
    with pytest.raises(StepFailed, match="AENV_PRIVATE_REGISTRIES") as refused:
        check_registry_address("registry.internal:5000", [], resolve=resolver("203.0.113.9", address))
    assert address in str(refused.value)


def test_public_listed_and_unresolvable_registries_pass():
    check_registry_address("ghcr.io", [], resolve=resolver("140.82.112.34"))
    check_registry_address("127.0.0.1:5000", ["127.0.0.1"], resolve=resolver("127.0.0.1"))
    check_registry_address("mirror.lan:5000", ["mirror.lan:5000"], resolve=resolver("10.0.0.5"))
    check_registry_address("nowhere.invalid", [], resolve=resolver())  # the pull then says it is unreachable
    with pytest.raises(StepFailed):
        check_registry_address("mirror.lan:5001", ["mirror.lan:5000"], resolve=resolver("10.0.0.5"))


def test_plain_http_is_for_loopback_and_listed_registries():
    assert insecure_registry("127.0.0.1:5000", []) and insecure_registry("localhost:5000", [])
    assert insecure_registry("[::1]:5000", [])
    assert insecure_registry("mirror.lan:5000", ["mirror.lan"]) and not insecure_registry("ghcr.io", [])


def test_credentials():
    assert credentials_of(None) is None
    assert credentials_of({"type": "registry", "username": "u", "password": "p"}) == ("u", "p")
    for kind in ("aws", "gcp"):
        with pytest.raises(StepFailed, match="not supported"):
            credentials_of({"type": kind})
