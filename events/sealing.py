"""Webhook signature secrets at rest: encrypted (Fernet: AES-128-CBC + HMAC-SHA256) with a
key derived from Django's SECRET_KEY, which lives outside the database (``DJANGO_SECRET_KEY``
or the owner-only file AENV_HOME/secret_key, ``config.secret_key``).

Why reversible at all: the control plane must sign every delivery with the secret itself
(a hash could only check a signature, not make one). Why not the database's own: a copy of
the database (a backup, a replica, a node's read of it) then shows no secret; only a process
that also has the installation's key can sign. Changing SECRET_KEY makes stored secrets
unreadable: their deliveries fail (``signature_error``) until each webhook gets a new
``signatureSecret`` (PATCH)."""
from __future__ import annotations

import base64
import hashlib

from cryptography.fernet import Fernet, InvalidToken
from django.conf import settings

_LABEL = b"aenv webhook signature secrets v1\x00"


class Unreadable(Exception):
    """A sealed secret this installation's key cannot open (SECRET_KEY changed)."""


def _box() -> Fernet:
    key = hashlib.sha256(_LABEL + settings.SECRET_KEY.encode()).digest()
    return Fernet(base64.urlsafe_b64encode(key))


def seal(secret: str) -> str:
    return _box().encrypt(secret.encode()).decode()


def unseal(sealed: str) -> str:
    try:
        return _box().decrypt(sealed.encode()).decode()
    except InvalidToken as exc:
        raise Unreadable("the webhook's secret was sealed with another SECRET_KEY") from exc
