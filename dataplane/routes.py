"""What the data plane knows about a request before it talks to a guest: which sandbox
and port it is for, the sandbox's current route (read from the database each time),
whether the request may pass (envd's access token, the traffic access token, envd's
node-only routes), the headers sent upstream, and every answer the data plane itself
gives (E2B's bodies and status codes; spec §1.5, §4.6; networking note §3).

One place for these, shared by the HTTP proxy (``dataplane.proxy``) and the WebSocket
bridge (``dataplane.websockets``), so both route, refuse and word errors alike.

Two proxy contracts are served, and each request is answered in the one that addressed
it (its ``Dialect``, chosen once by ``addressed``). Why two: the E2B SDKs match E2B's
bodies and statuses (``is_running()`` is False only on a 502 "was not found"), while
AgentENV's ``aenv`` and its users expect AgentENV's (``410 Gone`` for a paused sandbox).

============================  ====================================  =========================================
                              E2B                                   AgentENV
============================  ====================================  =========================================
addressed by                  ``E2b-Sandbox-Id`` [+ ``-Port``],     ``x-agentenv-sandbox-id`` +
                              or host ``{port}-{id}.{domain}``      ``x-agentenv-target-port`` (the E2B names
                                                                    are aliases) on the data plane's port; the
                                                                    same at ``/proxy[/…]`` on the API's port
path sent to the guest        as sent                               as sent, less a leading ``/proxy``
port when not given           49983 (envd)                          none: 400
no sandbox named              400 (a signed ``/files`` URL names    400 "missing sandbox routing header"
                              its sandbox by its signature)
bad port / id                 400 / —                               400
unknown, killed, another      502 "The sandbox was not found"       404 "sandbox not found"
team's (by its X-API-Key)
paused, no autoResume; or     502 "The sandbox was not found"       410 "sandbox is not proxyable in its
creating, killing                                                   current state (…)"
autoResume                    resumed, then served (failure 502,    the same
                              timeout 504)
private port, no or wrong     403                                   401
``e2b-traffic-access-token``
secure envd, no or wrong      401                                   401
``X-Access-Token``
port closed, guest silent     502 "port is not open" / 504          502 / 504
body                          JSON ``{sandboxId, message, code}``   JSON ``{code, message}``
============================  ====================================  =========================================

Both: tokens are checked before an auto-resume (traffic without its token wakes
nothing); a valid platform ``X-API-Key`` is never forwarded to the guest, and one of
another team finds nothing; envd's node-only routes are 403.
"""
import enum
import hmac
import json
import posixpath
import re
import time
from dataclasses import dataclass
from urllib.parse import parse_qs

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connections

from api import cors
from envd import ENVD_PORT
from envd.auth import EXPIRED_MESSAGE, UNAUTHORIZED_MESSAGE, make_signature

from sandboxes.states import DEAD, RESUMABLE, ROUTABLE

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
# The deployment's signed-URL policy (AENV_SIGNED_URL_REQUIRE_EXPIRATION, AENV_SIGNED_URL_MAX_TTL).
MSG_EXPIRATION_REQUIRED = "signature expiration is required (signed URLs must expire here)"
MSG_EXPIRATION_TOO_FAR = "signature expiration is too far in the future (at most {max_ttl} s ahead)"
MSG_BAD_PORT = "invalid sandbox port: a port is a number from 1 to 65535 in ASCII digits"

TRAFFIC_TOKEN_HEADER = b"e2b-traffic-access-token"
E2B_SANDBOX_HEADER, E2B_PORT_HEADER = b"e2b-sandbox-id", b"e2b-sandbox-port"
AGENTENV_SANDBOX_HEADER, AGENTENV_PORT_HEADER = b"x-agentenv-sandbox-id", b"x-agentenv-target-port"
API_KEY_HEADER = b"x-api-key"
# AgentENV's path prefix for the data plane on the API's port (not forwarded).
PROXY_PREFIX = b"/proxy"
# In a sandbox's maskRequestHost, replaced by the port the request is for.
MASK_PORT_PLACEHOLDER = "${PORT}"

HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"proxy-connection",
    b"te", b"trailer", b"trailers", b"transfer-encoding", b"upgrade", b"expect",
})
# Never sent upstream: they address the data plane, not the guest (Host is set per port).
ROUTING_HEADERS = frozenset({E2B_SANDBOX_HEADER, E2B_PORT_HEADER, AGENTENV_SANDBOX_HEADER, AGENTENV_PORT_HEADER,
                             b"host", TRAFFIC_TOKEN_HEADER})
# uvicorn writes its own; the upstream's would be duplicates.
RESPONSE_DROP = frozenset({b"date", b"server"})

# A sandbox host: ``{port}-{id}.`` (ASCII digits: ``\d`` would take other scripts' digits;
# the port's range is ``parse_port``'s to judge).
HOST_RE = re.compile(r"^(?P<port>[0-9]+)-(?P<id>[A-Za-z0-9_-]+)\.")
# A port as sent: ASCII digits only (no sign, space, or other Unicode digit: '²'.isdigit()).
PORT_RE = re.compile(rb"[0-9]{1,5}")
# What a sandbox id may look like (models.Sandbox.id), checked before it reaches a query.
SANDBOX_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True)
class Route:
    """A sandbox's route as the database has it now.

    ``host:port`` is envd (``envd_host:envd_port``); ``guest_host`` reaches every other
    guest TCP port ("" when only envd's port is forwarded: the slirp fallback);
    ``traffic_token`` is E2B's trafficAccessToken ("" = public); ``mask_host`` the
    sandbox's ``network.maskRequestHost`` ("" = forward the client's Host); ``team_id``
    whose sandbox it is (a platform API key of another team finds nothing)."""

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
    team_id: str = ""

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
                "guest_host", "traffic_access_token", "network", "team_id")


def _route_of(row) -> Route:
    sandbox_id, state, host, port, secure, token, generation, guest_host, traffic_token, network, team_id = row
    return Route(sandbox_id, state, host or "", port, bool(secure), token or "", generation or 0,
                 guest_host or "", traffic_token or "", _mask_host(network), str(team_id or ""))


def _lookup_sync(sandbox_ids: list[str]) -> dict[str, Route]:
    from sandboxes.models import Sandbox

    try:
        rows = list(Sandbox.objects.filter(pk__in=sandbox_ids).values_list(*ROUTE_FIELDS))
    finally:
        # This runs on executor threads outside Django's request cycle: nothing else
        # would close (or drop a broken) connection.
        close_unusable()
    return {row[0]: _route_of(row) for row in rows}


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

    def refusal(self, token: str) -> "Refused | None":
        """None when ``token`` made this signature, it has not expired and it keeps the
        deployment's policy; else envd's 401 (the signature judged first, as E2B's envd
        does: a forged URL is "invalid signature" whatever expiration it claims)."""
        if not (token and self.signed_by(token)):
            return Refused(answer=signature_refused(MSG_INVALID_SIGNATURE))
        if self.expired:
            return Refused(answer=signature_expired())
        return self.policy_refusal()

    def policy_refusal(self) -> "Refused | None":
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


class RouteTable:
    """The current route of a sandbox, read from the database each time it is asked."""

    async def get(self, sandbox_id: str) -> Route | None:
        return (await self.get_many([sandbox_id])).get(sandbox_id)

    async def get_many(self, sandbox_ids: list[str]) -> dict[str, Route]:
        """The routes of those of ``sandbox_ids`` that exist, in one query."""
        return await sync_to_async(_lookup_sync, thread_sensitive=False)(list(sandbox_ids))

    async def key_team(self, raw_key: bytes) -> str | None:
        """The team whose live API key ``raw_key`` is, or None: not one of ours."""
        return await sync_to_async(_key_team_sync, thread_sensitive=False)(raw_key.decode("latin-1").strip())


def _key_team_sync(raw_key: str) -> str | None:
    from sandboxes.models import ApiKey, hash_api_key

    try:
        team_id = (ApiKey.objects.filter(key_hash=hash_api_key(raw_key), revoked_at__isnull=True)
                   .values_list("team_id", flat=True).first())
    finally:
        close_unusable()
    return str(team_id) if team_id else None


def close_unusable() -> None:
    for conn in connections.all(initialized_only=True):
        conn.close_if_unusable_or_obsolete()


# --------------------------------------------------------------------------- requests


class Dialect(enum.Enum):
    """Whose proxy contract a request is answered in (see the table above)."""

    E2B = "e2b"
    AGENTENV = "agentenv"


class Why(enum.Enum):
    """Why the data plane answers a request itself; how each is said is the dialect's (``ANSWERS``)."""

    NO_TARGET = "no sandbox named"
    BAD_SANDBOX_ID = "malformed sandbox id"
    NO_PORT = "no target port"
    BAD_PORT = "not a port (ASCII digits, 1-65535)"
    NOT_FOUND = "unknown, gone, or another team's"
    NOT_RUNNING = "paused and not auto-resumed, or in passing (creating, killing)"
    PORT_CLOSED = "nothing answers on the port"
    NODE_ONLY = "envd route only the node may call"
    TRAFFIC_TOKEN_MISSING = "private port without e2b-traffic-access-token"
    TRAFFIC_TOKEN_INVALID = "private port with a wrong e2b-traffic-access-token"
    ACCESS_TOKEN_MISSING = "secure envd without X-Access-Token"
    ACCESS_TOKEN_INVALID = "secure envd with a wrong X-Access-Token"
    UPSTREAM_TIMEOUT = "the guest did not answer in time"
    RESUME_FAILED = "auto-resume failed"
    RESUME_TIMEOUT = "auto-resume timed out"


@dataclass(frozen=True)
class Target:
    """What a request addresses: the dialect it is answered in, the sandbox ("" when it
    names none) and port, or why its routing headers cannot be used (``error``)."""

    dialect: Dialect
    sandbox_id: str = ""
    port: int = ENVD_PORT
    error: Why | None = None


# Scope keys: the Target of a request (set by ``addressed``); the API's ``/proxy`` mount's
# mark on the requests it hands to the data plane (dataplane.mount).
TARGET = "aenv.target"
API_MOUNT = "aenv.api_mount"


def _header(headers: dict[bytes, bytes], name: bytes) -> str:
    return headers.get(name, b"").decode("latin-1").strip()


def parse_port(raw: bytes | str) -> int | None:
    """The port a header, host label or path gives, or None when it is no port: ASCII
    digits only — no sign, space or other Unicode digit (``'²'.isdigit()`` is True and
    ``int('²')`` raises) — from 1 to 65535. The one place ports from a request are read."""
    if isinstance(raw, str):
        try:
            raw = raw.encode("ascii")
        except UnicodeEncodeError:
            return None
    if not PORT_RE.fullmatch(raw):
        return None
    port = int(raw)
    return port if valid_port(port) else None


def _header_port(headers: dict[bytes, bytes], *names: bytes) -> int | None | bool:
    """The first of ``names`` present, parsed (None: present but no port); False when
    none is present. Only HTTP's optional whitespace around the value is ignored."""
    for name in names:
        raw = headers.get(name)
        if raw is not None:
            return parse_port(raw.strip(b" \t"))
    return False


def _agentenv_target(headers: dict[bytes, bytes]) -> Target:
    """AgentENV's routing headers (the E2B names as aliases); both are required."""
    sandbox_id = _header(headers, AGENTENV_SANDBOX_HEADER) or _header(headers, E2B_SANDBOX_HEADER)
    port = _header_port(headers, AGENTENV_PORT_HEADER, E2B_PORT_HEADER)
    error = None
    if not sandbox_id:
        error = Why.NO_TARGET
    elif not SANDBOX_ID_RE.fullmatch(sandbox_id):
        error = Why.BAD_SANDBOX_ID
    elif port is False:
        error = Why.NO_PORT
    elif port is None:
        error = Why.BAD_PORT
    if error is not None:
        return Target(Dialect.AGENTENV, error=error)
    return Target(Dialect.AGENTENV, sandbox_id, port)


def has_proxy_prefix(raw_path: bytes) -> bool:
    """``/proxy`` or ``/proxy/…``, matched on the raw (undecoded) path as AgentENV does."""
    return raw_path == PROXY_PREFIX or raw_path.startswith(PROXY_PREFIX + b"/")


def names_a_sandbox(headers: dict[bytes, bytes]) -> bool:
    """The request carries a sandbox routing header (either dialect's name)."""
    return bool(_header(headers, AGENTENV_SANDBOX_HEADER) or _header(headers, E2B_SANDBOX_HEADER))


def _address(headers: dict[bytes, bytes], raw_path: bytes, mounted: bool) -> tuple[Target, bool]:
    """(the request's Target, whether its leading ``/proxy`` is AgentENV's prefix).

    The one place the dialect is chosen. On the API's ``/proxy`` mount: AgentENV. On the
    data plane's port, first match wins: ``E2b-Sandbox-Id`` → E2B (as E2B: path as sent,
    port 49983 unless given); ``x-agentenv-sandbox-id`` → AgentENV; a ``{port}-{id}.`` host
    → E2B; a ``/proxy`` path naming no sandbox → AgentENV (its 400); anything else → E2B
    (a signed ``/files`` URL, or E2B's 400)."""
    prefixed = has_proxy_prefix(raw_path)
    if not mounted:
        sandbox_id = _header(headers, E2B_SANDBOX_HEADER)
        if sandbox_id:
            port = _header_port(headers, E2B_PORT_HEADER)
            if port is None:
                return Target(Dialect.E2B, sandbox_id, error=Why.BAD_PORT), False
            return Target(Dialect.E2B, sandbox_id, ENVD_PORT if port is False else port), False
        if not _header(headers, AGENTENV_SANDBOX_HEADER):
            m = HOST_RE.match(_header(headers, b"host").lower())
            if m:
                port = parse_port(m.group("port"))
                if port is None:
                    return Target(Dialect.E2B, m.group("id"), error=Why.BAD_PORT), False
                return Target(Dialect.E2B, m.group("id"), port), False
            if not prefixed:
                return Target(Dialect.E2B), False
    return _agentenv_target(headers), prefixed


def addressed(scope, headers: dict[bytes, bytes]) -> dict:
    """The request's scope as the data plane serves it: its Target under ``TARGET`` and,
    when AgentENV's ``/proxy`` prefix addressed it, the path without it (``/proxy`` alone
    is the guest's ``/``). The prefix is matched on the raw path, as AgentENV matches it."""
    raw_path = scope.get("raw_path") or scope["path"].encode()
    target, prefixed = _address(headers, raw_path, bool(scope.get(API_MOUNT)))
    scope = {**scope, TARGET: target}
    if prefixed:
        cut = len(PROXY_PREFIX)
        scope.update(path=scope["path"][cut:] or "/", raw_path=raw_path[cut:] or b"/",
                     root_path=scope.get("root_path", "") + PROXY_PREFIX.decode())
    return scope


def dialect_of(scope) -> Dialect:
    target = scope.get(TARGET)
    return target.dialect if target is not None else Dialect.E2B


def parse_target(headers: dict[bytes, bytes]) -> tuple[str, int] | None:
    """(sandbox_id, port) a request names by its headers or Host, in either dialect, else
    None (the data plane's metrics label)."""
    target, _ = _address(headers, b"", mounted=False)
    return (target.sandbox_id, target.port) if target.sandbox_id and target.error is None else None


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


def valid_port(port: int) -> bool:
    return 0 < port < 65536


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


def traffic_token_refusal(route: Route, headers: dict[bytes, bytes]) -> "Refused | None":
    """None when the request may reach the sandbox's non-envd ports; else why not."""
    if not route.traffic_token:
        return None
    given = headers.get(TRAFFIC_TOKEN_HEADER)
    if given is None:
        return Refused(Why.TRAFFIC_TOKEN_MISSING, route.sandbox_id)
    if not hmac.compare_digest(given, route.traffic_token.encode()):
        return Refused(Why.TRAFFIC_TOKEN_INVALID, route.sandbox_id)
    return None


def access_token_refusal(route: Route, path: str, query: bytes, headers: dict[bytes, bytes]) -> "Refused | None":
    """None when the request may reach envd; else why not (secure sandboxes only)."""
    if not (route.secure and needs_token(path, query)):
        return None
    given = headers.get(b"x-access-token", b"")
    if hmac.compare_digest(given, route.token.encode()):
        return None
    return Refused(Why.ACCESS_TOKEN_INVALID if given else Why.ACCESS_TOKEN_MISSING, route.sandbox_id)


def wake_refusal(route: Route, scope, headers: dict[bytes, bytes]) -> "Refused | None":
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


def signature_refused(message: str):
    """envd's 401 for a signed file URL (E2B's body: ``{"code": 401, "message": …}``)."""
    return json_response(401, {"code": 401, "message": message})


def signature_expired():
    return signature_refused(EXPIRED_MESSAGE)


MSG_NO_TARGET = ("missing E2b-Sandbox-Id header (or a {port}-{sandboxId}.{domain} host; "
                 "a /files URL without either must carry a secured sandbox's signature)")
MSG_NOT_PROXYABLE = "sandbox is not proxyable in its current state ({detail})"

E2B, AGENTENV = Dialect.E2B, Dialect.AGENTENV
# The one mapping of a refusal to its status and message, per dialect: E2B's are what its
# SDKs match (§1.5, §4.6 of the E2B spec), AgentENV's what its proxy answers. ``{detail}``
# is the refusal's detail. A reason only one dialect's addressing can produce has one entry.
ANSWERS: dict[Why, dict[Dialect, tuple[int, str]]] = {
    Why.NO_TARGET: {E2B: (400, MSG_NO_TARGET.replace("{", "{{").replace("}", "}}")),
                    AGENTENV: (400, "missing sandbox routing header")},
    Why.BAD_SANDBOX_ID: {AGENTENV: (400, "invalid sandbox routing header")},
    Why.NO_PORT: {AGENTENV: (400, "missing target port routing header")},
    Why.BAD_PORT: {E2B: (400, MSG_BAD_PORT), AGENTENV: (400, "invalid target port routing header")},
    Why.NOT_FOUND: {E2B: (502, MSG_NOT_FOUND), AGENTENV: (404, "sandbox not found")},
    Why.NOT_RUNNING: {E2B: (502, MSG_NOT_FOUND), AGENTENV: (410, MSG_NOT_PROXYABLE)},
    Why.PORT_CLOSED: {E2B: (502, MSG_PORT_CLOSED), AGENTENV: (502, "sandbox port is not reachable")},
    Why.NODE_ONLY: {E2B: (403, MSG_INTERNAL_ROUTE), AGENTENV: (403, MSG_INTERNAL_ROUTE)},
    Why.TRAFFIC_TOKEN_MISSING: {E2B: (403, MSG_TOKEN_MISSING), AGENTENV: (401, MSG_TOKEN_MISSING)},
    Why.TRAFFIC_TOKEN_INVALID: {E2B: (403, MSG_TOKEN_INVALID), AGENTENV: (401, MSG_TOKEN_INVALID)},
    # envd's own 401 (both dialects: envd, not the proxy, would answer it)
    Why.ACCESS_TOKEN_MISSING: {E2B: (401, UNAUTHORIZED_MESSAGE), AGENTENV: (401, UNAUTHORIZED_MESSAGE)},
    Why.ACCESS_TOKEN_INVALID: {E2B: (401, UNAUTHORIZED_MESSAGE), AGENTENV: (401, UNAUTHORIZED_MESSAGE)},
    Why.UPSTREAM_TIMEOUT: {E2B: (504, "The sandbox did not answer in time"),
                           AGENTENV: (504, "sandbox did not answer in time")},
    Why.RESUME_FAILED: {E2B: (502, "auto-resume failed: {detail}"), AGENTENV: (502, "auto-resume failed: {detail}")},
    Why.RESUME_TIMEOUT: {E2B: (504, "auto-resume failed: {detail}"), AGENTENV: (504, "auto-resume failed: {detail}")},
}
# E2B's bodies: ``{sandboxId, message, code}``, without the id where envd (not the proxy)
# would answer, plus the port where it is about one.
E2B_WITHOUT_ID = frozenset({Why.NO_TARGET, Why.ACCESS_TOKEN_MISSING, Why.ACCESS_TOKEN_INVALID})
E2B_WITH_PORT = frozenset({Why.PORT_CLOSED, Why.UPSTREAM_TIMEOUT})


def answer(dialect: Dialect, why: Why, sandbox_id: str = "", port: int | None = None, detail: str = ""):
    """(status, headers, body) of a refusal as ``dialect`` says it: JSON ``{code, message}``
    for AgentENV, E2B's ``{sandboxId, message, code[, port]}`` for E2B."""
    status, template = ANSWERS[why][dialect]
    message = template.format(detail=detail)
    if dialect is Dialect.AGENTENV:
        return json_response(status, {"code": status, "message": message})
    body = {} if why in E2B_WITHOUT_ID or not sandbox_id else {"sandboxId": sandbox_id}
    body.update(message=message, code=status)
    if why in E2B_WITH_PORT:
        body["port"] = ENVD_PORT if port is None else port
    return json_response(status, body)


def unavailable(sandbox_id: str, route: Route | None) -> "Refused":
    """A sandbox that cannot take traffic now: not found when unknown or dead, else not
    running (paused and not auto-resumed, creating, killing)."""
    if route is None or route.state in DEAD or route.state in ROUTABLE:
        return Refused(Why.NOT_FOUND, sandbox_id)
    return Refused(Why.NOT_RUNNING, sandbox_id, detail=route.state)


def gone(sandbox_id: str, port: int, route: Route | None) -> "Refused":
    """After a failed attempt: unavailable if the sandbox has no route any more, else
    'port is not open'."""
    if route is None or not route.routable:
        return unavailable(sandbox_id, route)
    return Refused(Why.PORT_CLOSED, sandbox_id, port)


def preflight(headers: dict[bytes, bytes]):
    """The answer to a CORS preflight (never forwarded to envd)."""
    asked = {n.decode("latin-1"): v.decode("latin-1") for n, v in headers.items()}
    return 204, [(n.encode(), v.encode("latin-1")) for n, v in cors.preflight_headers(asked)], b""


def is_preflight(scope, headers: dict[bytes, bytes]) -> bool:
    return scope.get("method") == "OPTIONS" and b"access-control-request-method" in headers


class Refused(Exception):
    """The request is answered by the data plane itself: for ``why`` (about
    ``sandbox_id`` / ``port``), said in the request's dialect by ``answer_in``; or with a
    ready ``answer`` (status, headers, body) that does not depend on it (envd's signed-URL
    401s, a guest's rejected WebSocket handshake)."""

    def __init__(self, why: Why | None = None, sandbox_id: str = "", port: int | None = None, detail: str = "",
                 *, answer=None):
        super().__init__(why.name if why is not None else answer[0])
        self.why, self.sandbox_id, self.port, self.detail = why, sandbox_id, port, detail
        self._answer = answer

    def answer_in(self, dialect: Dialect):
        if self._answer is not None:
            return self._answer
        return answer(dialect, self.why, self.sandbox_id, self.port, self.detail)


class ResumeFailed(Refused):
    """Auto-resume of a paused sandbox failed (RESUME_FAILED) or timed out (RESUME_TIMEOUT)."""
