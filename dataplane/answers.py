"""Every answer the data plane gives itself, in the words of the contract that addressed
the request: why it answers (``Why``), the one table of statuses and messages per dialect
(``ANSWERS``), E2B's and AgentENV's bodies, envd's signed-URL 401s, CORS preflights, and
``Refused``, the exception that carries an answer out of any check (spec §1.5, §4.6;
networking note §3).

Why one module: the HTTP proxy (``dataplane.proxy``), the WebSocket bridge
(``dataplane.websockets``) and the signer lookup (``dataplane.signers``) must refuse and
word errors alike. Which sandbox and dialect a request addresses is
``dataplane.addressing``; whether it may pass, ``dataplane.access``; the headers sent
upstream, ``dataplane.headers``.

Two proxy contracts are served, and each request is answered in the one that addressed
it (its ``Dialect``, chosen once by ``dataplane.addressing.addressed``). Why two: the E2B
SDKs match E2B's bodies and statuses (``is_running()`` is False only on a 502 "was not
found"), while AgentENV's ``aenv`` and its users expect AgentENV's (``410 Gone`` for a
paused sandbox).

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
import json

from api import cors
from envd import ENVD_PORT
from envd.auth import EXPIRED_MESSAGE, UNAUTHORIZED_MESSAGE

from dataplane.headers import with_cors
from dataplane.routes import Route
from sandboxes.states import DEAD, ROUTABLE

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
