"""The node's certificate authority for TLS interception (E2B's ``network.rules`` on HTTPS):
the egress proxy ends a guest's TLS connection to a host that has rules with a certificate
for that host issued here, so it can add the rule's headers, and the guest accepts it
because the node installs this CA's certificate in its trust stores at create (envd's
``/aenv/trust``).

One CA per node, made at the node's start if missing (``ensure``): ``ca.key`` (owner-only)
never leaves the node; ``ca.crt`` is what guests get. Leaf certificates are issued per host
name or address on demand and kept in memory until a day before they end (``leaf``).

ECDSA P-256 throughout: a key costs well under a millisecond to make, and every TLS client a
template is likely to carry (OpenSSL, Python's ``ssl``, Node, Go, Java) accepts it. No Django:
the proxy may run where only ``vmm`` is importable."""
from __future__ import annotations

import fcntl
import hashlib
import ipaddress
import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

KEY_FILE, CERT_FILE, LOCK_FILE = "ca.key", "ca.crt", ".lock"
CA_DAYS = 3650
LEAF_DAYS = 30
RENEW_BEFORE = timedelta(days=1)
BACKDATE = timedelta(hours=1)  # a guest clock a little behind still accepts a fresh leaf
LEAF_CACHE = 4096
_LABEL = re.compile(r"(?!-)[a-z0-9-]{1,63}(?<!-)")


class BadHost(ValueError):
    """No certificate is issued for this name (empty, malformed, a wildcard)."""


@dataclass(frozen=True)
class Leaf:
    """A host's certificate and key (PEM), and the chain to send (the leaf, then the CA)."""

    host: str
    cert_pem: bytes
    key_pem: bytes
    chain_pem: bytes
    not_after: datetime


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _san(host: str) -> x509.GeneralName:
    """The subjectAltName entry for ``host`` (an address, or a DNS name checked label by label)."""
    host = (host or "").strip().lower().rstrip(".")
    try:
        return x509.IPAddress(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        pass
    labels = host.split(".")
    if not host or len(host) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        raise BadHost(f"no certificate for {host!r}: not a host name or address")
    return x509.DNSName(host)


class NodeCA:
    """A loaded CA (``ensure`` makes or loads one); ``leaf`` is thread-safe."""

    def __init__(self, directory: Path, key, cert: x509.Certificate):
        self.directory = Path(directory)
        self._key = key
        self.cert = cert
        self.cert_pem = cert.public_bytes(serialization.Encoding.PEM)
        self._leaves: OrderedDict[str, Leaf] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def cert_path(self) -> Path:
        return self.directory / CERT_FILE

    @property
    def key_path(self) -> Path:
        return self.directory / KEY_FILE

    @property
    def fingerprint(self) -> str:
        """SHA-256 of the CA certificate (DER), hex: how a guest's copy is recognised."""
        return hashlib.sha256(self.cert.public_bytes(serialization.Encoding.DER)).hexdigest()

    def mitmproxy_pem(self) -> bytes:
        """The key and certificate in one PEM, the form mitmproxy reads as ``mitmproxy-ca.pem``
        from its confdir (so the proxy signs with this CA instead of making its own). It holds
        the key: write it owner-only, readable by the proxy's user alone."""
        return _pem_key(self._key) + self.cert_pem

    @classmethod
    def ensure(cls, directory: Path, node_id: str = "node") -> "NodeCA":
        """This node's CA from ``directory``, made there first if it has none (or only half
        of one); a key file others could read is made owner-only. Safe against another
        process of the node doing the same at once (a lock file)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(directory / LOCK_FILE, "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            key_path, cert_path = directory / KEY_FILE, directory / CERT_FILE
            if key_path.exists() and cert_path.exists():
                if key_path.stat().st_mode & 0o077:
                    os.chmod(key_path, 0o600)
                key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
                cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
                if cert.public_key().public_numbers() == key.public_key().public_numbers() \
                        and cert.not_valid_after_utc - RENEW_BEFORE > _now():
                    return cls(directory, key, cert)
            key, cert = cls._make(node_id)
            _write(key_path, _pem_key(key), 0o600)
            _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
            return cls(directory, key, cert)

    @staticmethod
    def _make(node_id: str):
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "aenv"),
                          x509.NameAttribute(NameOID.COMMON_NAME, f"aenv egress CA {node_id}"[:64])])
        now = _now()
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - BACKDATE).not_valid_after(now + timedelta(days=CA_DAYS))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                             content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False, encipher_only=False,
                                             decipher_only=False), critical=True)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                .sign(key, hashes.SHA256()))
        return key, cert

    def leaf(self, host: str) -> Leaf:
        """A certificate for ``host`` signed by this CA (kept until a day before it ends)."""
        san = _san(host)
        cache_key = str(san.value)
        with self._lock:
            found = self._leaves.get(cache_key)
            if found is not None and found.not_after - RENEW_BEFORE > _now():
                self._leaves.move_to_end(cache_key)
                return found
        made = self._issue(cache_key, san)
        with self._lock:
            self._leaves[cache_key] = made
            while len(self._leaves) > LEAF_CACHE:
                self._leaves.popitem(last=False)
        return made

    def _issue(self, host: str, san: x509.GeneralName) -> Leaf:
        key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        not_after = min(now + timedelta(days=LEAF_DAYS), self.cert.not_valid_after_utc)
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host[:64])]))
                .issuer_name(self.cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - BACKDATE).not_valid_after(not_after)
                .add_extension(x509.SubjectAlternativeName([san]), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=False, crl_sign=False,
                                             content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False, encipher_only=False,
                                             decipher_only=False), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                               critical=False)
                .sign(self._key, hashes.SHA256()))
        cert_pem = cert.public_bytes(serialization.Encoding.PEM)
        return Leaf(host, cert_pem, _pem_key(key), cert_pem + self.cert_pem, not_after)
