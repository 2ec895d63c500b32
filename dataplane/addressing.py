"""Which sandbox, port and contract a request addresses: its routing headers (E2B's
``E2b-Sandbox-Id`` / ``-Port``, AgentENV's ``x-agentenv-sandbox-id`` /
``-target-port``), its ``{port}-{id}.{domain}`` host, or AgentENV's ``/proxy`` prefix —
read once into a ``Target`` on the request's scope (``addressed``).

Why one module: the dialect a request is answered in is chosen here and nowhere else
(the table of the two contracts is in ``dataplane.answers``), and ports and sandbox ids
from a request are parsed only here (``parse_port``), for the HTTP proxy, the WebSocket
bridge, the API's ``/proxy`` mount, the cookie rule and the metrics label alike.
"""
import re
from dataclasses import dataclass

from envd import ENVD_PORT

from dataplane.answers import Dialect, Why
from dataplane.headers import AGENTENV_PORT_HEADER, AGENTENV_SANDBOX_HEADER, E2B_PORT_HEADER, E2B_SANDBOX_HEADER

# AgentENV's path prefix for the data plane on the API's port (not forwarded).
PROXY_PREFIX = b"/proxy"
# A sandbox host: ``{port}-{id}.`` (ASCII digits: ``\d`` would take other scripts' digits;
# the port's range is ``parse_port``'s to judge).
HOST_RE = re.compile(r"^(?P<port>[0-9]+)-(?P<id>[A-Za-z0-9_-]+)\.")
# A port as sent: ASCII digits only (no sign, space, or other Unicode digit: '²'.isdigit()).
PORT_RE = re.compile(rb"[0-9]{1,5}")
# What a sandbox id may look like (models.Sandbox.id), checked before it reaches a query.
SANDBOX_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")


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


def valid_port(port: int) -> bool:
    return 0 < port < 65536
