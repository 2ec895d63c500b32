"""Secrets in node task arguments travel sealed, never in clear.

Signing (``nodes.signing``) stops a stolen broker password from *running* tasks, but
anyone who can read the broker (its password, a dump of its memory or disk) could still
read the arguments. So the fields that carry secrets (``SEALED_FIELDS``: envd access
tokens, the sandbox's env vars, a template build's registry credentials) are encrypted
by the control plane (``seal_fields``) and opened by the node (``open_fields``) with
AES-GCM under a key derived (HKDF-SHA256) from ``DJANGO_SECRET_KEY``, which every process
of a deployment already shares. The field's name is the associated data, so a sealed value
cannot be moved to another field. Task results carry no secrets and are not sealed."""
from __future__ import annotations

import base64
import functools
import json
import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

# Sealed wherever they occur in a task's kwargs (nested too: fork children, a build's spec).
SEALED_FIELDS = frozenset({"access_token", "source_token", "env_vars", "from_image_registry"})
MARK = "__sealed__"
VERSION = "v1"
_INFO = b"aenv node task secrets v1"


class SealError(Exception):
    """A sealed value could not be opened: another DJANGO_SECRET_KEY, or it was altered."""


@functools.lru_cache(maxsize=4)
def _aead(secret: str) -> AESGCM:
    if not secret:
        raise SealError("no DJANGO_SECRET_KEY to seal task secrets with")
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_INFO).derive(secret.encode())
    return AESGCM(key)


def seal(value, field: str, secret: str) -> dict:
    """``value`` (anything JSON) as ``{MARK: "v1.<nonce+ciphertext>"}``, bound to ``field``."""
    nonce = os.urandom(12)
    box = _aead(secret).encrypt(nonce, json.dumps(value).encode(), field.encode())
    return {MARK: f"{VERSION}.{base64.urlsafe_b64encode(nonce + box).decode()}"}


def is_sealed(value) -> bool:
    return isinstance(value, dict) and set(value) == {MARK}


def unseal(sealed: dict, field: str, secret: str):
    token = sealed.get(MARK) if isinstance(sealed, dict) else None
    version, _, data = (token or "").partition(".")
    if version != VERSION:
        raise SealError(f"{field}: not a sealed value of version {VERSION}")
    try:
        raw = base64.urlsafe_b64decode(data.encode())
        plain = _aead(secret).decrypt(raw[:12], raw[12:], field.encode())
    except (InvalidTag, ValueError) as exc:
        raise SealError(f"{field}: the sealed value does not open (altered, or another DJANGO_SECRET_KEY)") from exc
    return json.loads(plain)


def seal_fields(value, secret: str):
    """A copy of ``value`` (task kwargs) with every ``SEALED_FIELDS`` entry that is not None sealed."""
    if isinstance(value, dict):
        return {k: (seal(v, k, secret) if k in SEALED_FIELDS and v is not None and not is_sealed(v)
                    else seal_fields(v, secret)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [seal_fields(v, secret) for v in value]
    return value


def open_fields(value, secret: str):
    """The inverse of ``seal_fields``: sealed entries opened (SealError if one does not open)."""
    if isinstance(value, dict):
        return {k: (unseal(v, k, secret) if is_sealed(v) else open_fields(v, secret)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [open_fields(v, secret) for v in value]
    return value
