"""Every header the data plane reads, drops or writes: the routing headers' names, what
is forwarded to the guest (less hop-by-hop and routing headers; the Host per port) and
back to the client, and the CORS headers E2B's envd puts on its answers.

Why one module: the HTTP proxy (``dataplane.proxy``) and the WebSocket bridge
(``dataplane.websockets``) must forward alike, and the names a request is addressed by
(``dataplane.addressing``) are the very ones never sent upstream. Which headers address
which dialect is the table in ``dataplane.answers``.
"""
from api import cors
from envd import ENVD_PORT

from dataplane.routes import Route

# What the data plane reads (``dataplane.addressing``, ``dataplane.access``). A platform
# X-API-Key is taken out of the forwarded headers only when it is one (``EnvdProxy._same_team``).
TRAFFIC_TOKEN_HEADER = b"e2b-traffic-access-token"
E2B_SANDBOX_HEADER, E2B_PORT_HEADER = b"e2b-sandbox-id", b"e2b-sandbox-port"
AGENTENV_SANDBOX_HEADER, AGENTENV_PORT_HEADER = b"x-agentenv-sandbox-id", b"x-agentenv-target-port"
API_KEY_HEADER = b"x-api-key"
# Marks the requests the hot path (HAProxy) sends back here (dataplane.hotpath_config).
VIA_HEADER = b"x-aenv-via-hotpath"
# In a sandbox's maskRequestHost, replaced by the port the request is for.
MASK_PORT_PLACEHOLDER = "${PORT}"

HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"proxy-connection",
    b"te", b"trailer", b"trailers", b"transfer-encoding", b"upgrade", b"expect",
})
# Never sent upstream: they address the data plane, not the guest (Host is set per port).
ROUTING_HEADERS = frozenset({E2B_SANDBOX_HEADER, E2B_PORT_HEADER, AGENTENV_SANDBOX_HEADER, AGENTENV_PORT_HEADER,
                             b"host", TRAFFIC_TOKEN_HEADER, VIA_HEADER})
# uvicorn writes its own; the upstream's would be duplicates.
RESPONSE_DROP = frozenset({b"date", b"server"})


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
