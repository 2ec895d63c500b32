"""How a delivery is signed: the headers a receiver checks.

- ``aenv-signature: sha256=<hex>``: HMAC-SHA256 of the exact request body under the
  webhook's secret (the one to verify: an HMAC cannot be extended or forged without the
  secret);
- ``e2b-signature``: E2B's own scheme, unpadded URL-safe base64 of SHA-256(secret + body),
  so a receiver written for E2B verifies aenv's deliveries unchanged;
- ``e2b-signature-version: v1``, ``e2b-webhook-id``, ``e2b-delivery-id`` (the attempt)."""
from __future__ import annotations

import base64
import hashlib
import hmac

SIGNATURE = "aenv-signature"
E2B_SIGNATURE = "e2b-signature"


def hmac_signature(secret: str, body: bytes) -> str:
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def e2b_signature(secret: str, body: bytes) -> str:
    digest = hashlib.sha256(secret.encode() + body).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


def headers(secret: str, body: bytes, webhook_id, attempt_id) -> dict[str, str]:
    return {
        "Content-Type": "application/json",
        "User-Agent": "aenv-webhooks/1",
        SIGNATURE: hmac_signature(secret, body),
        E2B_SIGNATURE: e2b_signature(secret, body),
        "e2b-signature-version": "v1",
        "e2b-webhook-id": str(webhook_id),
        "e2b-delivery-id": str(attempt_id),
    }


def verify(secret: str, body: bytes, header: str) -> bool:
    """What a receiver does with ``aenv-signature`` (also the tests' receiver)."""
    return hmac.compare_digest(hmac_signature(secret, body), header or "")
