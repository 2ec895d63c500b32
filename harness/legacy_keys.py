"""Task-signing keys of the kind aenv made before Ed25519 (RSA-3072 and a self-signed
certificate), for the tests and the bench that check an old pair still works."""
from __future__ import annotations

import datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID

from nodes import signing


def rsa_pair(directory: Path, days: int = 3650) -> tuple[Path, Path]:
    """An RSA-3072 key and a self-signed certificate valid for ``days``, written as
    ``signing.write_keys`` wrote them before Ed25519; returns (key, cert) paths."""
    directory.mkdir(parents=True, exist_ok=True)
    key = rsa.generate_private_key(public_exponent=65537, key_size=3072)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "aenv control plane")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days)).sign(key, hashes.SHA256()))
    (directory / signing.KEY_FILE).write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    (directory / signing.CERT_FILE).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return directory / signing.KEY_FILE, directory / signing.CERT_FILE
