"""Access-token and signed-URL checks (E2B's ``v1_`` file URL signatures)."""

import base64
import hashlib
import hmac
import time

EXPIRED_MESSAGE = "signature is already expired"
# envd's 401 without a valid X-Access-Token (E2B's words; the data plane says the same).
UNAUTHORIZED_MESSAGE = "unauthorized access, please provide a valid access token or method signing if supported"


class AuthError(Exception):
    """Authentication failure; ``str(exc)`` is the client-facing message."""


def token_matches(expected, given):
    """Constant-time comparison of access tokens (None/empty never matches)."""
    if not expected or given is None:
        return False
    return hmac.compare_digest(expected.encode(), given.encode())


def make_signature(path, operation, username, token, expiration=None):
    """Compute ``v1_<base64 sha256>`` exactly as the E2B SDK does."""
    raw = f"{path}:{operation}:{username or ''}:{token}"
    if expiration is not None:
        raw += f":{expiration}"
    digest = hashlib.sha256(raw.encode("utf-8")).digest()
    return "v1_" + base64.b64encode(digest).rstrip(b"=").decode("ascii")


def check_signature(token, path, operation, username, signature, expiration, now=None):
    """Raise AuthError unless ``signature`` is valid and unexpired for this request.

    The signature is judged before the expiration, as E2B's envd does: a forged URL is
    "invalid signature" whatever expiration it claims, and only a genuine one is told it
    has expired."""
    if not signature:
        raise AuthError("missing signature")
    exp_value = None
    if expiration not in (None, ""):
        try:
            exp_value = int(expiration)
        except ValueError:
            raise AuthError("invalid signature expiration") from None
    expected = make_signature(path, operation, username, token, exp_value)
    if not hmac.compare_digest(expected.encode(), signature.encode()):
        raise AuthError("invalid signature")
    if exp_value is not None and exp_value < (time.time() if now is None else now):
        raise AuthError(EXPIRED_MESSAGE)
