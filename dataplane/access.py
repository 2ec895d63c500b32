"""Whether a request may pass to its sandbox: envd's node-only routes, envd's access
token (``X-Access-Token``), E2B's traffic access token on the other ports, and the
signature of a signed ``/files`` URL (what it covers, and the deployment's policy on it).

Why one module: these are checked before anything is resumed (traffic without its token
wakes nothing), for HTTP and WebSocket requests alike (``EnvdProxy.admit``), and they
fold paths exactly as envd resolves them so no spelling slips past. A refusal is a
``dataplane.answers.Refused``, said in the request's dialect (the table there).
"""
import hmac
import posixpath
import re
import time
from dataclasses import dataclass
from urllib.parse import parse_qs

from django.conf import settings

from envd.auth import make_signature

from dataplane.answers import (MSG_EXPIRATION_REQUIRED, MSG_EXPIRATION_TOO_FAR, MSG_INVALID_EXPIRATION,
                               MSG_INVALID_SIGNATURE, Refused, Why, signature_expired, signature_refused,
                               unavailable)
from dataplane.headers import TRAFFIC_TOKEN_HEADER
from dataplane.routes import Route
from sandboxes.states import RESUMABLE

@dataclass(frozen=True)
class SignedFile:
    """A ``/files`` request carrying E2B's URL signature (``download_url`` / ``upload_url``):
    what the signature covers, so the sandbox whose envd token made it can be found
    (``dataplane.signers``) and the URL judged as envd judges it (``refusal``)."""

    path: str
    operation: str
    username: str
    signature: str
    expiration: int | None

    def signed_by(self, token: str) -> bool:
        expected = make_signature(self.path, self.operation, self.username, token, self.expiration)
        return hmac.compare_digest(expected.encode(), self.signature.encode())

    @property
    def expired(self) -> bool:
        return self.expiration is not None and self.expiration < time.time()

    def refusal(self, token: str) -> Refused | None:
        """None when ``token`` made this signature, it has not expired and it keeps the
        deployment's policy; else envd's 401 (the signature judged first, as E2B's envd
        does: a forged URL is "invalid signature" whatever expiration it claims)."""
        if not (token and self.signed_by(token)):
            return Refused(answer=signature_refused(MSG_INVALID_SIGNATURE))
        if self.expired:
            return Refused(answer=signature_expired())
        return self.policy_refusal()

    def policy_refusal(self) -> Refused | None:
        """This deployment's limits on signed URLs, which E2B's SDK leaves to the caller
        (no expiration unless ``use_signature_expiration`` is given): required expiration
        (``AENV_SIGNED_URL_REQUIRE_EXPIRATION``) and the farthest one accepted
        (``AENV_SIGNED_URL_MAX_TTL`` s from now; 0: any)."""
        if self.expiration is None:
            if settings.AENV_SIGNED_URL_REQUIRE_EXPIRATION:
                return Refused(answer=signature_refused(MSG_EXPIRATION_REQUIRED))
            return None
        max_ttl = settings.AENV_SIGNED_URL_MAX_TTL
        if max_ttl and self.expiration > time.time() + max_ttl:
            return Refused(answer=signature_refused(MSG_EXPIRATION_TOO_FAR.format(max_ttl=max_ttl)))
        return None


def signed_file(scope) -> SignedFile | None:
    """The signature of a ``GET`` / ``POST /files`` (envd's download / upload) request, or
    None when it is not one. Raises Refused (E2B's 401) for an expiration that is not a number."""
    if scope.get("method") not in ("GET", "POST") or _folded(scope.get("path", "")) != "/files":
        return None
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
    params = {name: values[0] for name, values in query.items()}
    if not params.get("signature"):
        return None
    expiration = params.get("signature_expiration") or None
    if expiration is not None:
        try:
            expiration = int(expiration)
        except ValueError:
            raise Refused(answer=signature_refused(MSG_INVALID_EXPIRATION)) from None
    return SignedFile(path=params.get("path", ""), operation="read" if scope["method"] == "GET" else "write",
                      username=params.get("username", ""), signature=params["signature"], expiration=expiration)



def needs_token(path: str, query: bytes) -> bool:
    """Secure sandboxes: every envd call needs X-Access-Token, except /health and
    signed /files URLs (judged by ``wake_refusal``; envd verifies the signature itself).
    Paths are folded as envd resolves them."""
    path = _folded(path)
    if path == "/health":
        return False
    return not (path == "/files" and re.search(rb"(^|&)signature=", query))


def _folded(path: str) -> str:
    """A decoded path with repeated slashes and dot segments folded, as envd resolves it."""
    return posixpath.normpath(re.sub(r"/+", "/", "/" + path))


def is_node_only(path: str) -> bool:
    """envd routes only the sandbox's node calls, on envd's address and never through
    the data plane: ``/init`` (env vars, clock, entropy, the access token) and aenv's
    own ``/aenv/...`` (the guest sync before a filesystem-only pause). Judged on the
    decoded path with repeated slashes and dot segments folded, so no spelling slips
    past that envd would still serve."""
    path = _folded(path)
    return path == "/init" or path == "/aenv" or path.startswith("/aenv/")


def traffic_token_refusal(route: Route, headers: dict[bytes, bytes]) -> Refused | None:
    """None when the request may reach the sandbox's non-envd ports; else why not."""
    if not route.traffic_token:
        return None
    given = headers.get(TRAFFIC_TOKEN_HEADER)
    if given is None:
        return Refused(Why.TRAFFIC_TOKEN_MISSING, route.sandbox_id)
    if not hmac.compare_digest(given, route.traffic_token.encode()):
        return Refused(Why.TRAFFIC_TOKEN_INVALID, route.sandbox_id)
    return None


def access_token_refusal(route: Route, path: str, query: bytes, headers: dict[bytes, bytes]) -> Refused | None:
    """None when the request may reach envd; else why not (secure sandboxes only)."""
    if not (route.secure and needs_token(path, query)):
        return None
    given = headers.get(b"x-access-token", b"")
    if hmac.compare_digest(given, route.token.encode()):
        return None
    return Refused(Why.ACCESS_TOKEN_INVALID if given else Why.ACCESS_TOKEN_MISSING, route.sandbox_id)


def wake_refusal(route: Route, scope, headers: dict[bytes, bytes]) -> Refused | None:
    """For envd's port, after ``access_token_refusal``: None when the request may go on
    (and wake a paused sandbox); else why not. A secured sandbox is reached with its
    X-Access-Token or, on a signed ``/files`` URL, a signature its token made — judged here
    (unexpired, within the deployment's policy: ``SignedFile.refusal``) before anything is
    resumed, and for running sandboxes too, as envd in the guest does not know the policy.
    Without either, a paused secured sandbox is not woken: ``/health`` (which envd answers
    without a token) is told it is not running, as without autoResume."""
    if not route.secure:
        return None
    given = headers.get(b"x-access-token")
    if given is not None and route.token and hmac.compare_digest(given, route.token.encode()):
        return None
    signed = signed_file(scope)
    if signed is not None:
        return signed.refusal(route.token)
    if route.state in RESUMABLE:
        return unavailable(route.sandbox_id, route)
    return None
