"""Sealing secret values: AES-256-GCM under a key that is not in the database.

Why outside the database: a dump or a replica of the database (backups, a read-only role, a
node's own database role) must not be enough to read a team's secrets. The key is
``AENV_SECRETS_KEY`` (32 bytes, base64 or hex) or else the file ``AENV_SECRETS_KEY_FILE``
(default ``AENV_HOME/secrets_key``), written owner-only by the first process that needs it.
Only the API processes need it: a node never decrypts, it asks the API
(``team_secrets.resolve``).

Each value is sealed with a fresh 96-bit nonce and the secret's id and version as associated
data, so a ciphertext copied onto another secret or version does not open. ``key_id`` (the
first 16 hex digits of the key's SHA-256) is stored beside it: a process given another key
fails with ``WrongKey`` instead of a vague "corrupt"."""
from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import os
import secrets
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from django.conf import settings

FORMAT = b"\x01"  # the layout below; a later one gets another first byte
NONCE_BYTES = 12
KEY_BYTES = 32


class BadKey(Exception):
    """The secrets key is missing or malformed (a configuration error, said plainly)."""


class WrongKey(Exception):
    """A value was sealed under another key than this process's."""


class Tampered(Exception):
    """The sealed value does not open under its own key: it, its id or version was altered."""


def _decode(text: str) -> bytes:
    text = text.strip()
    for decode in (bytes.fromhex, lambda t: base64.b64decode(t, validate=True),
                   lambda t: base64.urlsafe_b64decode(t + "=" * (-len(t) % 4))):
        try:
            raw = decode(text)
        except (ValueError, binascii.Error):
            continue
        if len(raw) == KEY_BYTES:
            return raw
    raise BadKey(f"the secrets key must be {KEY_BYTES} bytes, hex or base64 encoded")


def _generate(path: Path) -> None:
    """Writes a new key unless another process wrote one first (written aside, then linked
    into place: a reader never sees half a key)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(base64.b64encode(os.urandom(KEY_BYTES)).decode() + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)


def load_key(from_env: str | None, path: Path) -> bytes:
    """The key: ``from_env`` if set, else the file at ``path`` (made on first use; a file
    others could read is made owner-only)."""
    if from_env:
        return _decode(from_env)
    path = Path(path)
    if not path.exists():
        _generate(path)
    if path.stat().st_mode & 0o077:
        os.chmod(path, 0o600)
    return _decode(path.read_text())


@functools.lru_cache(maxsize=4)
def _cached(from_env: str, path: str) -> bytes:
    return load_key(from_env or None, Path(path))


def current_key() -> bytes:
    return _cached(settings.AENV_SECRETS_KEY, str(settings.AENV_SECRETS_KEY_FILE))


def key_id(key: bytes) -> str:
    return hashlib.sha256(key).hexdigest()[:16]


def _associated(secret_id: str, version: int) -> bytes:
    return f"aenv secret {secret_id} v{version}".encode()


def seal(value: str, secret_id: str, version: int, key: bytes | None = None) -> tuple[bytes, str]:
    """``(sealed bytes, key id)`` of ``value`` for that secret's version."""
    key = key if key is not None else current_key()
    nonce = os.urandom(NONCE_BYTES)
    sealed = AESGCM(key).encrypt(nonce, value.encode(), _associated(secret_id, version))
    return FORMAT + nonce + sealed, key_id(key)


def open_sealed(sealed: bytes, sealed_key_id: str, secret_id: str, version: int, key: bytes | None = None) -> str:
    """The value ``seal`` sealed; WrongKey or Tampered if it cannot be opened."""
    key = key if key is not None else current_key()
    if sealed_key_id != key_id(key):
        raise WrongKey(f"secret {secret_id} v{version} was sealed under key {sealed_key_id}, "
                       f"this process has key {key_id(key)} (AENV_SECRETS_KEY / AENV_SECRETS_KEY_FILE)")
    sealed = bytes(sealed)
    if sealed[:1] != FORMAT or len(sealed) < 1 + NONCE_BYTES + 16:
        raise Tampered(f"secret {secret_id} v{version}: unknown sealed format")
    try:
        plain = AESGCM(key).decrypt(sealed[1:1 + NONCE_BYTES], sealed[1 + NONCE_BYTES:],
                                    _associated(secret_id, version))
    except InvalidTag:
        raise Tampered(f"secret {secret_id} v{version} does not open under its key: altered or moved") from None
    return plain.decode()
