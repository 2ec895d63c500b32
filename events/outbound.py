"""The one HTTP client that POSTs to team-chosen URLs, fenced against SSRF.

Why its own client: a webhook URL is the team's choice and the control plane makes the
request, so without a fence a team could make the control plane call its own private
network (the database, Redis, a cloud metadata service). The fence:

- only ``http`` / ``https`` URLs with a host and no user info (``check_url``);
- every address the host resolves to is checked at each attempt (``refusal``): loopback and
  private ranges unless AENV_WEBHOOK_ALLOW_PRIVATE, link-local (metadata), multicast,
  unspecified and reserved ones always; the connection then goes to the address that was
  checked (pinned), so a second DNS answer cannot swap it;
- redirects are never followed (a 3xx is a failed attempt); proxies from the environment
  are never used;
- the whole attempt is cut off at ``timeout`` seconds and at most ``max_bytes`` of the
  answer are read."""
from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

SCHEMES = {"http": 80, "https": 443}


class BadUrl(ValueError):
    """A URL no webhook may have (the message says why)."""


@dataclass(frozen=True)
class Target:
    scheme: str
    host: str
    port: int
    path: str


@dataclass
class Outcome:
    """What one POST gave: ``status`` (None: no answer) or ``error_class`` (E2B's names:
    http_error, dns_error, timeout, transport_error, request_error) and ``error``."""

    status: int | None = None
    body: bytes = b""
    error_class: str = ""
    error: str = ""
    duration_ms: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300


def check_url(url: str) -> Target:
    """The parts of a webhook URL, or BadUrl."""
    if (not isinstance(url, str) or not url or len(url) > 2048
            or any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F for c in url)):
        raise BadUrl("url must be an absolute http(s) URL of at most 2048 characters, without spaces "
                     "or control characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise BadUrl(f"url is not a valid URL: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise BadUrl("url must use http or https")
    if not parts.hostname:
        raise BadUrl("url must name a host")
    if parts.username is not None or parts.password is not None:
        raise BadUrl("url must not carry user info (user:password@)")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return Target(scheme, parts.hostname.rstrip(".").lower(), port or SCHEMES[scheme], path)


# Cloud metadata services outside the link-local range (AWS over IPv6, Alibaba in CGNAT space).
METADATA = {ipaddress.ip_address("fd00:ec2::254"), ipaddress.ip_address("100.100.100.200")}
THIS_NETWORK = ipaddress.ip_network("0.0.0.0/8")  # 0.x.x.x reaches the host itself on Linux


def _embedded_v4(ip):
    """The IPv4 address an IPv6 one carries (mapped, 6to4, Teredo), else None."""
    if isinstance(ip, ipaddress.IPv6Address):
        return ip.ipv4_mapped or ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
    return None


def refusal(address: str, allow_private: bool) -> str | None:
    """Why an address may not be called (None: it may)."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    inner = _embedded_v4(ip)
    if inner is not None:
        why = refusal(str(inner), allow_private)
        if why or ip.ipv4_mapped is not None:
            return why
    if ip.is_unspecified or ip.is_multicast or ip.is_link_local or ip in METADATA or (
            isinstance(ip, ipaddress.IPv4Address) and ip in THIS_NETWORK):
        return f"{ip} is a link-local, metadata, multicast or unspecified address"
    if ip.is_loopback or ip.is_private or (isinstance(ip, ipaddress.IPv4Address)
                                            and ip in ipaddress.ip_network("100.64.0.0/10")):
        return None if allow_private else f"{ip} is a loopback or private address"
    if ip.is_reserved or not ip.is_global:
        return f"{ip} is not a public address"
    return None


def resolve(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (an IP literal: itself)."""
    try:
        return [str(ipaddress.ip_address(host))]
    except ValueError:
        pass
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in infos))


def check_destination(target: Target, allow_private: bool) -> str:
    """The address to connect to: every address of the host must be allowed (a name that
    also resolves to a private address is refused). BadUrl when one is not; socket.gaierror
    when the host does not resolve."""
    addresses = resolve(target.host, target.port)
    if not addresses:
        raise socket.gaierror(f"{target.host} has no address")
    for address in addresses:
        why = refusal(address, allow_private)
        if why:
            raise BadUrl(f"destination refused: {target.host} resolves to {why}")
    return addresses[0]


class _Pinned(http.client.HTTPConnection):
    """HTTP to a checked address, with the URL's host in the Host header."""

    def __init__(self, host, port, address, timeout):
        super().__init__(host, port, timeout=timeout)
        self.address = address

    def connect(self):
        self.sock = socket.create_connection((self.address, self.port), self.timeout)


class _PinnedTls(http.client.HTTPSConnection):
    """HTTPS to a checked address: the certificate is checked against the URL's host (SNI too)."""

    def __init__(self, host, port, address, timeout):
        super().__init__(host, port, timeout=timeout, context=ssl.create_default_context())
        self.address = address

    def connect(self):
        raw = socket.create_connection((self.address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(raw, server_hostname=self.host)


def post(url: str, body: bytes, headers: dict, *, timeout: float, max_bytes: int,
         allow_private: bool) -> Outcome:
    """One POST of ``body`` to ``url`` within the fence; never raises for the receiver's
    faults (they are in the Outcome)."""
    t0 = time.monotonic()
    outcome = Outcome()
    try:
        target = check_url(url)
        address = check_destination(target, allow_private)
    except BadUrl as exc:
        outcome.error_class, outcome.error = "request_error", str(exc)
    except (socket.gaierror, UnicodeError) as exc:
        outcome.error_class, outcome.error = "dns_error", f"cannot resolve the host: {exc}"
    else:
        _send(target, address, body, headers, timeout - (time.monotonic() - t0), max_bytes, outcome)
    outcome.duration_ms = round((time.monotonic() - t0) * 1000, 1)
    return outcome


def _send(target: Target, address: str, body: bytes, headers: dict, timeout: float, max_bytes: int,
          outcome: Outcome) -> None:
    kind = _PinnedTls if target.scheme == "https" else _Pinned
    conn = kind(target.host, target.port, address, max(timeout, 0.001))
    expired = threading.Event()

    def cut_off():  # the deadline of the whole attempt, however slowly the receiver trickles
        expired.set()
        sock = conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    timer = threading.Timer(max(timeout, 0.001), cut_off)
    timer.daemon = True
    timer.start()
    try:
        conn.request("POST", target.path, body=body, headers=headers)
        response = conn.getresponse()
        outcome.body = response.read(max_bytes)
        outcome.status = response.status
        if not outcome.ok:
            outcome.error_class = "http_error"
            outcome.error = (f"answered {response.status} (redirects are not followed)"
                             if 300 <= response.status < 400 else f"answered {response.status}")
    except (TimeoutError, socket.timeout):
        outcome.error_class, outcome.error = "timeout", f"no answer within {timeout:.1f} s"
    except (OSError, http.client.HTTPException, ssl.SSLError) as exc:
        if expired.is_set():
            outcome.error_class, outcome.error = "timeout", f"no answer within {timeout:.1f} s"
        else:
            outcome.error_class, outcome.error = "transport_error", f"{type(exc).__name__}: {exc}"
    finally:
        timer.cancel()
        conn.close()
