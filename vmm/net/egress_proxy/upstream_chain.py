"""Chaining the egress proxy's connections to a sandbox's upstream proxy (``network.egressProxy``).

Why this way: mitmproxy chains to an upstream only inside its HTTP layer (an HTTP proxy, by
CONNECT), not for connections it passes through unparsed (TLS without rules), and never to
SOCKS5. So the addon dials the upstream itself (``dial``: SOCKS5 with python-socks, a
well-kept client from PyPI; HTTP CONNECT with a few lines of its own, ``_http_connect``; over
TLS (``egressProxy.tls``) SOCKS5 with a few lines of its own too, ``_socks5``: python-socks
opens TLS to a proxy only under the name it dials, and the node dials the address it checked
while verifying the certificate against the name the user gave):

- a connection judged by name (mitmproxy's): in ``server_connect``, then mitmproxy's server
  connection is pointed at a one-shot listener on loopback (``Relay``) joined to the upstream
  socket, so passed-through TLS, HTTP and intercepted TLS are chained the same way. The
  listener takes one connection, and only mitmproxy's own (its peer must be the server
  connection's local address), so no other local process can borrow the tunnel;
- a connection the slot's CIDRs allow (no name to judge): never parsed; the node sends it to
  a plain relay (the addon's second listener), which reads its destination
  (``original_dst``), dials and ``join``s: any protocol, server-first ones included.

A dial that fails fails the connection before anything is sent (never a direct fallback).

TLS to the upstream (the slot file's ``tls``, E2B's ``egressProxy.tls``): the certificate is
always verified, against ``tls_server_name`` (E2B's ``serverName``, else the address's host),
by the system's trust store or, when the user gave one, only by ``tls_ca`` (E2B's ``caCert``);
TLS 1.2 or newer; a failed handshake fails the connection (never plaintext instead). TLS has
no half-close: a sandbox's half-close cannot reach the upstream, so after it the reply is
still relayed while it keeps coming (``LINGER`` seconds without a byte end it).

The upstream's address is checked when it is dialled (a name resolved then, by the node's
resolver): never a non-public address unless the operator allowed it
(``AENV_EGRESS_PROXY_ALLOW_PRIVATE``), never the node. The password comes from the API
(``POST /nodes/egress-proxy/resolve``) for the sandbox and the credential id its slot file
names, and is kept in memory only (``Passwords``).

Runs in mitmproxy's Python environment (loaded by addon.py as a module of this folder);
imports nothing of aenv."""
from __future__ import annotations

import asyncio
import base64
import functools
import ipaddress
import socket
import ssl
import struct
import threading
import time

from python_socks import ProxyConnectionError, ProxyError, ProxyTimeoutError, ProxyType
from python_socks.async_.asyncio import Proxy  # its SOCKS5 client (HTTP CONNECT: _http_connect)

CONNECT_TIMEOUT = 15.0
ACCEPT_TIMEOUT = 10.0
ROUTE = "/nodes/egress-proxy/resolve"
CHUNK = 65536
SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h
LINGER = 30.0  # after a sandbox's half-close over TLS: how long the reply may pause before the end
# RFC 1928's replies, for the log
SOCKS5_REPLIES = {1: "general failure", 2: "not allowed by its rules", 3: "network unreachable",
                  4: "host unreachable", 5: "connection refused", 6: "TTL expired", 7: "command not supported",
                  8: "address type not supported"}


class UpstreamFailed(Exception):
    """The upstream proxy could not be reached, refused, or may not be used: the connection fails."""


class Passwords:
    """Passwords by (sandbox, credential id), asked of the API once per ``ttl``; thread-safe.
    ``post``: vmm/egress_secrets.py's JSON POST (the same node authentication)."""

    def __init__(self, config: dict, post, clock=time.monotonic, timeout: float = 10.0):
        self.url = config["url"].rstrip("/") + ROUTE
        self._headers = dict(config["headers"])
        self._post, self._clock, self._timeout = post, clock, timeout
        self._cache: dict[tuple[str, str], tuple[str, float]] = {}
        self._lock = threading.Lock()

    def password(self, sandbox: str, credential: str) -> str:
        with self._lock:
            hit = self._cache.get((sandbox, credential))
            if hit and hit[1] > self._clock():
                return hit[0]
        try:
            status, body = self._post(self.url, self._headers, {"sandboxID": sandbox, "credential": credential},
                                      self._timeout)
        except Exception as exc:  # the client's own "unavailable"
            raise UpstreamFailed(f"the API cannot be asked for the proxy's password: {type(exc).__name__}") from None
        if status != 200 or not isinstance(body.get("password"), str):
            raise UpstreamFailed(f"the API did not give the proxy's password ({status})")
        with self._lock:
            self._cache[(sandbox, credential)] = (body["password"], self._clock() + max(0, int(body.get("ttl") or 0)))
        return body["password"]

    def forget(self, sandbox: str) -> None:
        with self._lock:
            for key in [k for k in self._cache if k[0] == sandbox]:
                del self._cache[key]


def refused(address: str, allow_private: bool, node: list) -> str | None:
    """Why the upstream at ``address`` may not be dialled (None: it may)."""
    ip = ipaddress.ip_address(address)
    if ip.version != 4 or ip.is_unspecified or ip.is_multicast or ip.is_link_local:
        return f"{ip} is no address an upstream proxy may have"
    if allow_private:
        return None
    if any(ip in net for net in node):
        return f"{ip} is this node's"
    return None if ip.is_global else f"{ip} is not a public address"


Streams = tuple  # (asyncio.StreamReader, asyncio.StreamWriter)


async def _http_connect(streams: Streams, username: str | None, password: str | None, host: str,
                        port: int) -> Streams:
    """A tunnel through an HTTP proxy (CONNECT). Not python-socks': its HTTP client reads the
    reply with one read and drops what follows it, which loses a server-first protocol's first
    bytes; here the stream keeps them."""
    reader, writer = streams
    try:
        authority = f"{host}:{port}"
        auth = ""
        if username:
            token = base64.b64encode(f"{username}:{password or ''}".encode()).decode()
            auth = f"Proxy-Authorization: Basic {token}\r\n"
        writer.write(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n{auth}\r\n".encode())
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        status = head.split(b"\r\n", 1)[0].split(b" ")
        if len(status) < 2 or not status[0].startswith(b"HTTP/1.") or not status[1].startswith(b"2"):
            raise UpstreamFailed(f"the upstream proxy answered {status[1:2] and status[1].decode(errors='replace')}")
    except BaseException:
        writer.close()
        raise
    return reader, writer


@functools.lru_cache(maxsize=64)
def tls_context(ca_pem: str) -> ssl.SSLContext:
    """What the upstream's certificate is verified with: ``ca_pem`` alone when given (it
    replaces the system's trust store, as E2B's ``caCert`` does), else the system's."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cadata=ca_pem or None)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context  # check_hostname and CERT_REQUIRED: create_default_context's


async def _open(address: str, port: int, upstream: dict) -> Streams:
    """A connection to the upstream at the checked ``address``: plain, or TLS verified
    against the upstream's name."""
    if not upstream.get("tls"):
        return await asyncio.open_connection(address, port)
    name = str(upstream.get("tls_server_name") or upstream["host"])
    try:
        return await asyncio.open_connection(address, port, ssl=tls_context(str(upstream.get("tls_ca") or "")),
                                             server_hostname=name, ssl_handshake_timeout=CONNECT_TIMEOUT)
    except ssl.SSLCertVerificationError as exc:
        raise UpstreamFailed(f"the upstream proxy's certificate is not trusted for {name}: "
                             f"{exc.verify_message or exc.reason}") from None
    except ssl.SSLError as exc:
        raise UpstreamFailed(f"no TLS with the upstream proxy {name}: {exc.reason or type(exc).__name__}") from None


async def _socks5(streams: Streams, username: str | None, password: str | None, host: str, port: int) -> Streams:
    """RFC 1928's CONNECT (RFC 1929's user and password when given) on open streams, the
    target named (the upstream resolves it) or an IPv4 address; exact reads, so nothing of
    the tunnel is lost."""
    reader, writer = streams
    try:
        methods = b"\x00\x02" if username else b"\x00"
        writer.write(b"\x05" + bytes([len(methods)]) + methods)
        version, method = await reader.readexactly(2)
        if version != 5 or method not in methods:
            raise UpstreamFailed("the upstream proxy does not speak SOCKS5 or takes none of the offered methods")
        if method == 2:
            user, secret = username.encode(), (password or "").encode()
            writer.write(b"\x01" + bytes([len(user)]) + user + bytes([len(secret)]) + secret)
            if (await reader.readexactly(2))[1] != 0:
                raise UpstreamFailed("the upstream proxy refused the user and password")
        try:
            target = b"\x01" + ipaddress.IPv4Address(host).packed
        except ValueError:
            name = host.encode("idna") if not host.isascii() else host.encode()
            target = b"\x03" + bytes([len(name)]) + name
        writer.write(b"\x05\x01\x00" + target + struct.pack("!H", port))
        await writer.drain()
        version, reply, _, kind = await reader.readexactly(4)
        if version != 5 or reply != 0:
            raise UpstreamFailed(f"the upstream proxy answered {SOCKS5_REPLIES.get(reply, reply)}")
        length = {1: 4, 4: 16}.get(kind) or (await reader.readexactly(1))[0]
        await reader.readexactly(length + 2)  # its bound address and port
    except BaseException:
        writer.close()
        raise
    return reader, writer


async def dial(upstream: dict, password: str | None, host: str, port: int, allow_private: bool,
               node: list) -> Streams:
    """Streams connected through ``upstream`` to ``host`` (a name: the upstream resolves it)
    and ``port``; UpstreamFailed otherwise."""
    name, proxy_port = str(upstream["host"]), int(upstream["port"])
    try:
        ipaddress.ip_address(name)
        addresses = [name]
    except ValueError:
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(name, proxy_port, family=socket.AF_INET,
                                                                 type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            raise UpstreamFailed(f"the upstream proxy {name} does not resolve to an IPv4 address") from None
        addresses = list(dict.fromkeys(info[4][0] for info in infos))
    for address in addresses:
        why = refused(address, allow_private, node)
        if why:
            raise UpstreamFailed(f"the upstream proxy {name}: {why}")
    username = upstream.get("username") or None
    try:
        if upstream["scheme"] == "http" or upstream.get("tls"):
            return await asyncio.wait_for(_handshake(addresses[0], proxy_port, upstream, password, host, port),
                                          CONNECT_TIMEOUT)
        proxy = Proxy(ProxyType.SOCKS5, addresses[0], proxy_port, username=username, password=password, rdns=True)
        sock = await proxy.connect(host, port, timeout=CONNECT_TIMEOUT)  # exact reads: nothing of the tunnel lost
        return await asyncio.open_connection(sock=sock)
    except UpstreamFailed:
        raise
    except (ProxyConnectionError, ProxyTimeoutError, ProxyError, OSError, asyncio.TimeoutError,
            asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
        raise UpstreamFailed(f"the upstream proxy {name}:{proxy_port} failed: {type(exc).__name__}") from None


async def _handshake(address: str, proxy_port: int, upstream: dict, password: str | None, host: str,
                     port: int) -> Streams:
    """Streams tunnelled through the upstream by aenv's own clients (HTTP CONNECT, or SOCKS5
    over TLS)."""
    streams = await _open(address, proxy_port, upstream)
    speak = _http_connect if upstream["scheme"] == "http" else _socks5
    return await speak(streams, upstream.get("username") or None, password, host, port)


def original_dst(sock: socket.socket) -> tuple[str, int]:
    """Where a connection DNATed here was going (``SO_ORIGINAL_DST``: a ``sockaddr_in``)."""
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    return socket.inet_ntoa(raw[4:8]), int.from_bytes(raw[2:4], "big")


async def join(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, upstream: Streams) -> None:
    """Copies both ways between a client's streams and the upstream's until both end (or,
    after the client's half-close over TLS, the reply pauses for ``LINGER``)."""
    up_reader, up_writer = upstream
    back_moved = [0]
    out = asyncio.ensure_future(_pipe(reader, up_writer))
    back = asyncio.ensure_future(_pipe(up_reader, writer, back_moved))
    try:
        await asyncio.wait((out, back), return_when=asyncio.FIRST_COMPLETED)
        if out.done() and not back.done() and not up_writer.can_write_eof():
            seen = -1
            while not back.done() and back_moved[0] != seen:  # still coming: wait on
                seen = back_moved[0]
                await asyncio.wait((back,), timeout=LINGER)
            back.cancel()
        await asyncio.gather(out, back, return_exceptions=True)
    finally:
        out.cancel()
        back.cancel()
        up_writer.close()
        writer.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, moved: list | None = None) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
            if moved is not None:
                moved[0] += len(data)
        if writer.can_write_eof():
            writer.write_eof()  # a half-close reaches the other side as one (over TLS it cannot)
    except (ConnectionError, OSError):
        writer.close()


class Relay:
    """A one-shot loopback listener that joins mitmproxy's server connection to streams
    already connected through the upstream."""

    def __init__(self, upstream: Streams):
        self.upstream = upstream
        self.accepted: asyncio.Future = asyncio.get_running_loop().create_future()
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []

    async def open(self) -> tuple[str, int]:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[:2]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.accepted.done():
            writer.close()
            return
        self.accepted.set_result((reader, writer))
        self.server.close()

    async def run(self, peer: tuple) -> None:
        """Joins the two once mitmproxy's connection (local address ``peer``) is accepted."""
        try:
            reader, writer = await asyncio.wait_for(asyncio.shield(self.accepted), ACCEPT_TIMEOUT)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            self.close()
            return
        self.writers.append(writer)
        if tuple(writer.get_extra_info("peername")[:2]) != tuple(peer[:2]):
            self.close()  # not mitmproxy's connection: the tunnel is never joined to it
            return
        try:
            await join(reader, writer, self.upstream)
        except OSError:
            pass
        finally:
            self.close()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for writer in self.writers:
            writer.close()
        self.upstream[1].close()
