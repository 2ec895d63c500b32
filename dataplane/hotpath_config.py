"""The hot path's HAProxy configuration: the data plane's rules for a user-port request,
spelled in HAProxy's language.

Why HAProxy, and why only behind a handoff: per request, aenv's Python data plane costs
~1–2 ms of CPU (bench/dataplane.py: 0.05–0.10× the requests/s of going straight to the guest);
HAProxy relays the same request for a few tens of µs. But HAProxy ends a response whose
upstream broke with a FIN, never a reset, and E2B's SDKs need the reset to report a killed
sandbox (``dataplane.proxy._reset_on_close``). So clients still connect to the data plane
(uvicorn), which answers each connection's first request with every check and auto-resume;
a keep-alive connection whose first request went to a running sandbox's user port is then
handed to HAProxy (``dataplane.handoff``), which serves its next requests from two maps that
``dataplane.steer`` keeps equal to the database, and sends everything else back to the data
plane over HTTP (marked ``VIA_HEADER``, so it is never handed off twice).

What HAProxy serves itself — only what ``dataplane.proxy`` would forward unchanged:

- E2B's addressing: exactly one ``E2b-Sandbox-Id`` and one ``E2b-Sandbox-Port``, or no
  ``E2b-Sandbox-Id`` and a ``{port}-{id}.`` host (lower-cased, as ``dataplane.addressing``);
  a port of 1–65535 in ASCII digits that is not envd's;
- a sandbox port in ``PORTS_MAP`` (running, with a guest address, no ``maskRequestHost``; a
  port is added, with its server ``<id>_<port>.<serial>``, when the data plane hands off a connection
  that used it);
- when it is in ``TOKENS_MAP``: exactly one ``e2b-traffic-access-token`` whose SHA-256 is the
  map's value;
- no AgentENV routing header, no ``X-API-Key`` (the team check reads the database), no
  ``Upgrade`` (WebSockets stay with ``dataplane.websockets``).

Anything else — envd, paused sandboxes (auto-resume), wrong or missing tokens (their answers),
unknown sandboxes — goes to the data plane unchanged. The routing headers and the token are not
sent to the guest; the guest's cookies are confined as ``dataplane.cookies`` says (host-routed:
``Domain`` removed; header-routed: dropped); a port nothing answers on gets E2B's 502 body.
"""
from __future__ import annotations

import json

from api import cors
from envd import ENVD_PORT

from dataplane.answers import MSG_PORT_CLOSED
from dataplane.headers import VIA_HEADER as _VIA

PORTS_MAP = "ports.map"  # "<sandbox id>_<port>" → its server's name ("<sandbox id>_<port>.<serial>")
TOKENS_MAP = "tokens.map"  # sandbox id → sha256 hex of its traffic access token
# Set on every request HAProxy sends to the data plane (and removed from clients'): the data
# plane never hands such a connection back (dataplane.handoff); never forwarded to a guest.
VIA_HEADER = _VIA.decode()
GUEST_BACKEND, DATAPLANE_BACKEND = "guest", "dataplane"
# A service that starts listening a moment late is still reached (the data plane tries for
# ~1 s, dataplane.proxy.USER_PORT_RETRY_DELAYS): HAProxy waits 1 s before its one retry.
CONNECT_RETRIES = 1
# Idle keep-alive clients: as uvicorn's --timeout-keep-alive in every launch command.
KEEPALIVE_TIMEOUT = "300s"
# Streams (server-sent events, long polls) may stay quiet for long: no inactivity cut.
STREAM_TIMEOUT = "24h"
REUSE = "safe"
# Guest connections are kept alive and shared between a port's clients (``http-reuse safe``,
# an idle pool per server: ``haproxy_admin.POOL``), which is what lets the hot path come near
# a straight connection to the guest. Why that is safe across a pause and a resume: HAProxy
# 2.6 keeps some idle guest connections in the client's session instead of the server's pool
# (every one under ``http-reuse never``; in any mode, one the guest answered with an NTLM or
# Negotiate challenge), bound to the server object; ``del server`` does not always close
# them, and a server added later at the freed object's place in memory reused them: a
# request went to the paused VM's old address and waited out ``timeout server`` (24 h). So a
# server is never freed while a connection to it exists: each route gets a server of its own
# name (``<id>_<port>.<serial>``, never reused; ``PORTS_MAP`` says which), and a server taken
# out is only put in maintenance (its pooled connections closed, its streams shut) and
# deleted once HAProxy shows no connection to it (``dataplane.steer``). A session's idle
# connection to a stopped VM is found dead by TCP keep-alive probes (``SRV_TCP_KEEPALIVE``),
# so a retired server waits at most about that long, or until its clients leave.
SRV_TCP_KEEPALIVE = ("30s", "10s", 3)  # srvtcpka-idle, -intvl, -cnt


def _json(text: str) -> str:
    """A JSON body for an HAProxy ``string`` / ``lf-string`` argument (single-quoted)."""
    if "'" in text:
        raise ValueError("no single quotes in HAProxy answers")
    return text


def _error(status: int, message: str) -> str:
    body = _json(json.dumps({"code": status, "message": message}))
    return f"    http-error status {status} content-type application/json string '{body}'{_cors()}"


def _cors() -> str:
    return "".join(f" hdr {name} '{value}'" for name, value in cors.simple_headers())


def render(*, handoff_fd: int, admin_socket: str, maps_dir: str, dataplane: tuple[str, int],
           nbthread: int = 1, maxconn: int = 20000) -> str:
    """The whole haproxy.cfg. ``handoff_fd``: HAProxy's end of the socketpair the data plane
    passes connections over (``bind sockpair@``); ``dataplane``: where uvicorn listens.

    Why a server per sandbox port (``use-server`` by name, added at run time): a connection
    HAProxy received over a socketpair has no IP address to HAProxy, so ``set-dst`` (one
    transparent server, any address) cannot steer it; a named server can, and deleting it
    shuts exactly that sandbox's streams. Servers have weight 0: a request whose server does
    not exist is never balanced to another one (it gets a 503, said as E2B's 502)."""
    ports, tokens = f"{maps_dir}/{PORTS_MAP}", f"{maps_dir}/{TOKENS_MAP}"
    host, port = dataplane
    port_closed = _json(
        '{"sandboxId":"%[var(txn.sid)]","message":"' + MSG_PORT_CLOSED + '","code":502,"port":%[var(txn.port),add(0)]}')
    return f"""# Rendered by dataplane.hotpath_config at start; edits are lost.
global
    maxconn {maxconn}
    nbthread {nbthread}
    stats socket {admin_socket} mode 600 level admin
    log stderr format raw local0 err

defaults
    mode http
    log global
    option dontlognull
    timeout connect 3s
    timeout client {STREAM_TIMEOUT}
    timeout server {STREAM_TIMEOUT}
    timeout tunnel {STREAM_TIMEOUT}
    timeout http-keep-alive {KEEPALIVE_TIMEOUT}
    timeout http-request 60s
{_error(400, "bad request")}
{_error(408, "request timeout")}
{_error(500, "internal error of the data plane hot path")}
{_error(502, "bad gateway")}
{_error(503, "service unavailable")}
{_error(504, "gateway timeout")}

frontend hotpath
    bind sockpair@{handoff_fd}
    http-request del-header {VIA_HEADER}
    # E2B's addressing: the headers, or else a {{port}}-{{id}}. host
    acl by_header req.hdr_cnt(e2b-sandbox-id) eq 1
    acl by_header_port req.hdr_cnt(e2b-sandbox-port) eq 1
    acl no_header req.hdr_cnt(e2b-sandbox-id) eq 0
    acl agentenv req.hdr_cnt(x-agentenv-sandbox-id) gt 0
    acl agentenv req.hdr_cnt(x-agentenv-target-port) gt 0
    acl sandbox_host req.hdr(host),lower -m reg ^[0-9]{{1,5}}-[a-z0-9_-]{{1,64}}\\.
    http-request set-var(txn.sid) req.fhdr(e2b-sandbox-id) if by_header by_header_port !agentenv
    http-request set-var(txn.port) req.fhdr(e2b-sandbox-port) if by_header by_header_port !agentenv
    http-request set-var(txn.byhost) bool(true) if no_header !agentenv sandbox_host
    http-request set-var(txn.sid) req.hdr(host),lower,field(1,.),regsub(^[0-9]+-,) if {{ var(txn.byhost) -m bool }}
    http-request set-var(txn.port) req.hdr(host),lower,field(1,-) if {{ var(txn.byhost) -m bool }}
    acl port_digits var(txn.port) -m reg ^[0-9]{{1,5}}$
    acl port_range var(txn.port) -m int 1:65535
    acl port_envd var(txn.port) -m int {ENVD_PORT}
    # the sandbox port's server and the sandbox's token, as dataplane.steer keeps them
    http-request set-var(txn.route) var(txn.sid),concat(_,txn.port) if port_digits port_range !port_envd
    http-request set-var(txn.srv) var(txn.route),map({ports}) if {{ var(txn.route) -m found }}
    http-request set-var(txn.want) var(txn.sid),map({tokens}) if {{ var(txn.srv) -m found }}
    acl routed var(txn.srv) -m found
    acl token_needed var(txn.want) -m found
    acl token_one req.hdr_cnt(e2b-traffic-access-token) eq 1
    http-request set-var(txn.given) req.fhdr(e2b-traffic-access-token),sha2(256),hex,lower if token_needed token_one
    acl token_ok var(txn.given),strcmp(txn.want) eq 0
    # what only the data plane can judge
    acl theirs req.hdr_cnt(x-api-key) gt 0
    acl theirs req.hdr_cnt(upgrade) gt 0
    http-request set-var(txn.hot) bool(true) if routed !theirs !token_needed
    http-request set-var(txn.hot) bool(true) if routed !theirs token_needed token_one token_ok
    acl hot var(txn.hot) -m bool
    http-request del-header e2b-sandbox-id if hot
    http-request del-header e2b-sandbox-port if hot
    http-request del-header e2b-traffic-access-token if hot
    use_backend {GUEST_BACKEND} if hot
    default_backend {DATAPLANE_BACKEND}

backend {GUEST_BACKEND}
    retries {CONNECT_RETRIES}
    # guest connections kept alive, shared by the port's clients; their servers outlive them
    # (see above the module's timeouts)
    http-reuse {REUSE}
    option srvtcpka
    srvtcpka-idle {SRV_TCP_KEEPALIVE[0]}
    srvtcpka-intvl {SRV_TCP_KEEPALIVE[1]}
    srvtcpka-cnt {SRV_TCP_KEEPALIVE[2]}
    use-server %[var(txn.srv)] if TRUE
    # the guest's cookies (dataplane.cookies): host-only on its own host, else dropped
    http-response del-header set-cookie2
    http-response del-header set-cookie if !{{ var(txn.byhost) -m bool }}
    http-response replace-header set-cookie (?i)^(.*?)\\s*;\\s*domain\\s*=[^;]*(.*)$ \\1\\2
    http-response replace-header set-cookie (?i)^(.*?)\\s*;\\s*domain\\s*=[^;]*(.*)$ \\1\\2
    http-response del-header set-cookie if {{ res.hdr(set-cookie) -m reg (?i);\\s*domain\\s*= }}
    # nothing answers on the port: E2B's 502 "port is not open" (dataplane.answers)
    http-error status 503 content-type application/json lf-string '{port_closed}'{_cors()}
    http-after-response set-status 502 if {{ status 503 }}

backend {DATAPLANE_BACKEND}
    http-request set-header {VIA_HEADER} 1
    server dataplane {host}:{port}
"""
