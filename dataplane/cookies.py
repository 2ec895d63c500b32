"""The guest's ``Set-Cookie`` headers, confined to the one sandbox host that served them.

Why: every sandbox is reached as ``{port}-{id}.{AENV_SANDBOX_DOMAIN}``, one shared domain.
A cookie a guest sets with ``Domain={the domain}`` (or any parent of its host) is stored
by the browser for every sandbox of every team under it: one tenant's guest could plant
cookies in another's app (session fixation, cookie tossing) or shadow its cookies. And
the hosts the data plane answers for any sandbox (routing headers, signed file URLs,
AgentENV's ``/proxy`` on the API's port — the dashboard's own host) belong to no one
sandbox: a cookie set there is every sandbox's, and on the API's host the dashboard's
(cookies ignore ports: ``127.0.0.1:3001`` sets cookies for ``127.0.0.1:3000`` too).

The rule, for HTTP responses and WebSocket handshake answers alike:

- a request addressed by its sandbox host (``{port}-{id}.…`` naming the very sandbox and
  port it was routed to): every ``Set-Cookie`` passes without its ``Domain`` attribute, so
  it is host-only (the browser returns it to that exact host and no other);
- any other request: the guest's ``Set-Cookie`` (and the obsolete ``Set-Cookie2``) are dropped.
"""
from dataplane import addressing

SET_COOKIE = b"set-cookie"
DROPPED = frozenset({SET_COOKIE, b"set-cookie2"})


def own_host(scope) -> bool:
    """Whether the request came through the host of the sandbox and port it is routed to
    (and not through the API's ``/proxy`` mount, which is the API's host)."""
    if scope.get(addressing.API_MOUNT):
        return False
    target = scope.get(addressing.TARGET)
    host = next((v for n, v in scope.get("headers") or () if n.lower() == b"host"), b"")
    m = addressing.HOST_RE.match(host.decode("latin-1").strip().lower())
    return bool(target is not None and target.sandbox_id and m
                and m.group("id") == target.sandbox_id.lower() and int(m.group("port")) == target.port)


def host_only(value: bytes) -> bytes:
    """A ``Set-Cookie`` value without its ``Domain`` attribute(s); the rest as sent."""
    name_value, *attributes = value.split(b";")
    kept = [a for a in attributes if a.split(b"=", 1)[0].strip().lower() != b"domain"]
    return b";".join([name_value, *kept])


def confine(headers: list[tuple[bytes, bytes]], scope) -> list[tuple[bytes, bytes]]:
    """The guest's response headers with its cookies confined as the module says."""
    keep = own_host(scope)
    out = []
    for name, value in headers:
        lowered = name.lower()
        if lowered in DROPPED:
            if keep and lowered == SET_COOKIE:
                out.append((name, host_only(value)))
            continue
        out.append((name, value))
    return out
