"""What the data plane knows about a request before it talks to a guest: which sandbox
and port it is for, the sandbox's current route (read from the database each time),
whether the request may pass (envd's access token, the traffic access token, envd's
node-only routes), the headers sent upstream, and every answer the data plane itself
gives (E2B's bodies and status codes; spec §1.5, §4.6; networking note §3).

One place for these, shared by the HTTP proxy (``sandboxes.proxy``) and the WebSocket
bridge (``sandboxes.proxy_ws``), so both route, refuse and word errors alike.
"""
import hmac
import json
import posixpath
import re
import time
from collections import OrderedDict
from dataclasses import dataclass
from urllib.parse import parse_qs

from asgiref.sync import sync_to_async
from django.db import connections

from aenv_site import cors
from envd import ENVD_PORT
from envd.auth import EXPIRED_MESSAGE, make_signature

from .states import RESUMABLE, ROUTABLE

MSG_NOT_FOUND = "The sandbox was not found"
MSG_PORT_CLOSED = "The sandbox is running but port is not open"
MSG_TOKEN_MISSING = ("Sandbox is secured with traffic access token. "
                     "Token header 'e2b-traffic-access-token' is missing")
MSG_TOKEN_INVALID = ("Sandbox is secured with traffic access token. "
                     "Provided token in header 'e2b-traffic-access-token' is invalid")
MSG_INTERNAL_ROUTE = "This envd route is only reachable by the sandbox's node"
# envd's words for a signed file URL it refuses (E2B's envd: the signature is judged first).
MSG_INVALID_SIGNATURE = "invalid signature"
MSG_INVALID_EXPIRATION = "invalid signature expiration"

TRAFFIC_TOKEN_HEADER = b"e2b-traffic-access-token"
# In a sandbox's maskRequestHost, replaced by the port the request is for.
MASK_PORT_PLACEHOLDER = "${PORT}"

HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"proxy-connection",
    b"te", b"trailer", b"trailers", b"transfer-encoding", b"upgrade", b"expect",
})
# Never sent upstream: they address the data plane, not the guest (Host is set per port).
ROUTING_HEADERS = frozenset({b"e2b-sandbox-id", b"e2b-sandbox-port", b"host", TRAFFIC_TOKEN_HEADER})
# uvicorn writes its own; the upstream's would be duplicates.
RESPONSE_DROP = frozenset({b"date", b"server"})

HOST_RE = re.compile(r"^(?P<port>\d{1,5})-(?P<id>[A-Za-z0-9_-]+)\.")


@dataclass(frozen=True)
class Route:
    """A sandbox's route as the database has it now.

    ``host:port`` is envd (``envd_host:envd_port``); ``guest_host`` reaches every other
    guest TCP port ("" when only envd's port is forwarded: the slirp fallback);
    ``traffic_token`` is E2B's trafficAccessToken ("" = public); ``mask_host`` the
    sandbox's ``network.maskRequestHost`` ("" = forward the client's Host)."""

    sandbox_id: str
    state: str
    host: str
    port: int | None
    secure: bool
    token: str
    generation: int = 0
    guest_host: str = ""
    traffic_token: str = ""
    mask_host: str = ""

    @property
    def routable(self) -> bool:
        return self.state in ROUTABLE and bool(self.host) and bool(self.port)

    @property
    def upstream(self) -> tuple:
        """What identifies the VM process behind the route (and so its connections)."""
        return self.generation, self.host, self.port, self.guest_host

    def address(self, port: int) -> tuple[str, int] | None:
        """Where guest port ``port`` is reached from here; None if it cannot be."""
        if port == ENVD_PORT:
            return self.host, self.port
        return (self.guest_host, port) if self.guest_host else None


def _mask_host(network) -> str:
    value = network.get("maskRequestHost") if isinstance(network, dict) else None
    return value if isinstance(value, str) else ""


ROUTE_FIELDS = ("id", "state", "envd_host", "envd_port", "secure", "envd_access_token", "vm_generation",
                "guest_host", "traffic_access_token", "network")


def _route_of(row) -> Route:
    sandbox_id, state, host, port, secure, token, generation, guest_host, traffic_token, network = row
    return Route(sandbox_id, state, host or "", port, bool(secure), token or "", generation or 0,
                 guest_host or "", traffic_token or "", _mask_host(network))


def _lookup_sync(sandbox_ids: list[str]) -> dict[str, Route]:
    from sandboxes.models import Sandbox

    try:
        rows = list(Sandbox.objects.filter(pk__in=sandbox_ids).values_list(*ROUTE_FIELDS))
    finally:
        # This runs on executor threads outside Django's request cycle: nothing else
        # would close (or drop a broken) connection.
        close_unusable()
    return {row[0]: _route_of(row) for row in rows}


# Sandboxes a signed file URL without a sandbox id may reach.
SIGNED_REACHABLE = ROUTABLE | RESUMABLE


def _secured_tokens_sync() -> list[tuple[str, str]]:
    """(id, envd token) of every secured sandbox a signed URL may reach (routable, or
    paused and maybe auto-resumable)."""
    from sandboxes.models import Sandbox

    try:
        return list(Sandbox.objects.filter(secure=True, state__in=SIGNED_REACHABLE)
                    .exclude(envd_access_token="").values_list("id", "envd_access_token"))
    finally:
        close_unusable()


@dataclass(frozen=True)
class SignedFile:
    """A ``/files`` request carrying E2B's URL signature (``download_url`` / ``upload_url``):
    what the signature covers, so the sandbox whose envd token made it can be found."""

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


class RouteTable:
    """The current route of a sandbox, read from the database each time it is asked."""

    # Signatures recently matched, and the sandbox whose token made them (a hint only:
    # every use is verified against that sandbox's token as the database has it now).
    SIGNED_HINTS = 4096

    def __init__(self):
        self._signed_hints: OrderedDict[str, str] = OrderedDict()

    async def get(self, sandbox_id: str) -> Route | None:
        return (await self.get_many([sandbox_id])).get(sandbox_id)

    async def get_many(self, sandbox_ids: list[str]) -> dict[str, Route]:
        """The routes of those of ``sandbox_ids`` that exist, in one query."""
        return await sync_to_async(_lookup_sync, thread_sensitive=False)(list(sandbox_ids))

    async def signed_by(self, signed: SignedFile) -> str | None:
        """The id of the sandbox whose envd token made ``signed``'s signature, or None.

        Why: with ``E2B_SANDBOX_URL`` the SDK's signed file URLs are
        ``{E2B_SANDBOX_URL}/files?path=…&signature=…``, with no sandbox id in the URL or
        its headers (a browser or curl fetches them as they are). The signature is a hash
        over the path, operation, user, expiration and the sandbox's envd token, so it
        names exactly one sandbox: the one whose token reproduces it. Secured sandboxes are
        tried in turn (one SHA-256 each); a match is remembered for the next request of
        the same URL."""
        hint = self._signed_hints.get(signed.signature)
        if hint is not None:
            route = await self.get(hint)
            if (route is not None and route.secure and route.state in SIGNED_REACHABLE and route.token
                    and signed.signed_by(route.token)):
                self._signed_hints.move_to_end(signed.signature)
                return hint
            self._signed_hints.pop(signed.signature, None)
        for sandbox_id, token in await sync_to_async(_secured_tokens_sync, thread_sensitive=False)():
            if signed.signed_by(token):
                self._signed_hints[signed.signature] = sandbox_id
                while len(self._signed_hints) > self.SIGNED_HINTS:
                    self._signed_hints.popitem(last=False)
                return sandbox_id
        return None


def close_unusable() -> None:
    for conn in connections.all(initialized_only=True):
        conn.close_if_unusable_or_obsolete()


# --------------------------------------------------------------------------- requests


def parse_target(headers: dict[bytes, bytes]) -> tuple[str, int] | None:
    """(sandbox_id, port) from the routing headers, else from the Host, else None."""
    sandbox_id = headers.get(b"e2b-sandbox-id", b"").decode("latin-1").strip()
    if sandbox_id:
        port = headers.get(b"e2b-sandbox-port", b"").decode("latin-1").strip()
        return sandbox_id, int(port) if port.isdigit() else ENVD_PORT
    host = headers.get(b"host", b"").decode("latin-1").strip().lower()
    m = HOST_RE.match(host)
    if m:
        return m.group("id"), int(m.group("port"))
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
            raise Refused(signature_refused(MSG_INVALID_EXPIRATION)) from None
    return SignedFile(path=params.get("path", ""), operation="read" if scope["method"] == "GET" else "write",
                      username=params.get("username", ""), signature=params["signature"], expiration=expiration)


def valid_port(port: int) -> bool:
    return 0 < port < 65536


def needs_token(path: str, query: bytes) -> bool:
    """Secure sandboxes: every envd call needs X-Access-Token, except /health and
    signed /files URLs (envd verifies the signature itself)."""
    path = path.rstrip("/")
    if path.endswith("/health"):
        return False
    return not (path.endswith("/files") and re.search(rb"(^|&)signature=", query))


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


def traffic_token_refusal(route: Route, headers: dict[bytes, bytes]):
    """None when the request may reach the sandbox's non-envd ports; else the 403."""
    if not route.traffic_token:
        return None
    given = headers.get(TRAFFIC_TOKEN_HEADER)
    if given is None:
        return json_response(403, {"sandboxId": route.sandbox_id, "message": MSG_TOKEN_MISSING, "code": 403})
    if not hmac.compare_digest(given, route.traffic_token.encode()):
        return json_response(403, {"sandboxId": route.sandbox_id, "message": MSG_TOKEN_INVALID, "code": 403})
    return None


def access_token_refusal(route: Route, path: str, query: bytes, headers: dict[bytes, bytes]):
    """None when the request may reach envd; else the 401 (secure sandboxes only)."""
    if not (route.secure and needs_token(path, query)):
        return None
    given = headers.get(b"x-access-token", b"")
    if hmac.compare_digest(given, route.token.encode()):
        return None
    return json_response(401, {
        "code": 401,
        "message": "missing or invalid X-Access-Token" if given else "missing X-Access-Token header",
    })


def forward_headers(raw_headers, drop=frozenset()) -> list[tuple[bytes, bytes]]:
    """The client's headers less hop-by-hop ones (and those its Connection lists), the
    routing headers and ``drop``."""
    listed = set()
    for name, value in raw_headers:
        if name.lower() == b"connection":
            listed.update(t.strip().lower().encode() for t in value.decode("latin-1").split(","))
    return [(n, v) for n, v in raw_headers
            if n.lower() not in HOP_BY_HOP and n.lower() not in ROUTING_HEADERS
            and n.lower() not in listed and n.lower() not in drop]


def upstream_headers(raw_headers, route: Route, port: int, drop=frozenset()) -> list[tuple[bytes, bytes]]:
    """The headers sent to the guest. envd's port: no Host (the client library sets the
    upstream address). Other ports: the client's Host, as E2B forwards it, or with a
    ``maskRequestHost`` that mask (``${PORT}`` → the port) and the client's Host as
    ``X-Forwarded-Host``."""
    out = forward_headers(raw_headers, drop)
    if port == ENVD_PORT:
        return out
    client_host = next((v for n, v in raw_headers if n.lower() == b"host"), None)
    if route.mask_host:
        out = [(n, v) for n, v in out if n.lower() != b"x-forwarded-host"]
        host = route.mask_host.replace(MASK_PORT_PLACEHOLDER, str(port)).encode("latin-1", "replace")
        extra = [(b"host", host)] + ([(b"x-forwarded-host", client_host)] if client_host else [])
        return extra + out
    return ([(b"host", client_host)] if client_host else []) + out


def response_headers(raw_headers) -> list[tuple[bytes, bytes]]:
    return [(n, v) for n, v in forward_headers(raw_headers) if n.lower() not in RESPONSE_DROP]


def with_cors(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """An envd response (or one of ours) as E2B's envd answers browsers: readable from
    any origin, headers included; what the upstream said itself is kept."""
    present = {n.lower() for n, _ in headers}
    return headers + [(n.encode(), v.encode()) for n, v in cors.simple_headers() if n.lower().encode() not in present]


# --------------------------------------------------------------------------- answers


def json_response(status: int, body: dict):
    """(status, headers, body) of one of the data plane's own answers."""
    data = json.dumps(body).encode()
    headers = with_cors([(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())])
    return status, headers, data


def no_target():
    return json_response(400, {
        "code": 400,
        "message": "missing E2b-Sandbox-Id header (or a {port}-{sandboxId}.{domain} host; "
                   "a /files URL without either must carry a secured sandbox's signature)",
    })


def signature_refused(message: str):
    """envd's 401 for a signed file URL (E2B's body: ``{"code": 401, "message": …}``)."""
    return json_response(401, {"code": 401, "message": message})


def signature_expired():
    return signature_refused(EXPIRED_MESSAGE)


def not_found(sandbox_id: str):
    return json_response(502, {"sandboxId": sandbox_id, "message": MSG_NOT_FOUND, "code": 502})


def port_closed(sandbox_id: str, port: int = ENVD_PORT):
    return json_response(502, {"sandboxId": sandbox_id, "message": MSG_PORT_CLOSED, "code": 502, "port": port})


def gone(sandbox_id: str, port: int, route: Route | None):
    """After a failed attempt: 'was not found' if the sandbox has no route any more,
    else 'port is not open'."""
    if route is None or not route.routable:
        return not_found(sandbox_id)
    return port_closed(sandbox_id, port)


def node_only(sandbox_id: str):
    return json_response(403, {"sandboxId": sandbox_id, "message": MSG_INTERNAL_ROUTE, "code": 403})


def upstream_timeout(sandbox_id: str, port: int):
    return json_response(504, {"sandboxId": sandbox_id, "message": "The sandbox did not answer in time",
                               "code": 504, "port": port})


def preflight(headers: dict[bytes, bytes]):
    """The answer to a CORS preflight (never forwarded to envd)."""
    asked = {n.decode("latin-1"): v.decode("latin-1") for n, v in headers.items()}
    return 204, [(n.encode(), v.encode("latin-1")) for n, v in cors.preflight_headers(asked)], b""


def is_preflight(scope, headers: dict[bytes, bytes]) -> bool:
    return scope.get("method") == "OPTIONS" and b"access-control-request-method" in headers


class ResumeFailed(Exception):
    """Auto-resume of a paused sandbox failed; answered with ``status`` and ``message``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message

    def response(self, sandbox_id: str):
        return json_response(self.status, {"sandboxId": sandbox_id, "code": self.status, "message": self.message})


class Refused(Exception):
    """The request is answered by the data plane itself: ``answer`` is (status, headers, body)."""

    def __init__(self, answer):
        super().__init__(answer[0])
        self.answer = answer
