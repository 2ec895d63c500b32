"""A sandbox's ``network.egressProxy`` (E2B's "bring your own proxy"): checked once at the
edge, stored on the row with its password sealed, shown back without it, and handed to the
node without it.

Why a module of its own: the password is a credential of the user's, so where it may go is
narrow and must be one place's job. It is sealed with AES-256-GCM under the secrets key
(``team_secrets.crypto``: ``AENV_SECRETS_KEY`` / ``AENV_SECRETS_KEY_FILE``, outside the
database) inside the row's ``network`` JSON (so pause, resume, snapshots and fork children keep
it with the rest of the policy), never enters a response (``public``), an event (``public``
again), a task's arguments (``spec``: a credential id instead) or a log. Only the sandbox's
node gets it, from ``POST /nodes/egress-proxy/resolve`` (``resolve``), asked by its egress
proxy when it dials the upstream.

The wire shape is E2B's (``SandboxEgressProxyConfig``): ``address`` (``host:port``),
``username`` / ``password`` (RFC 1929, each at most 255 bytes; a password only with a
username) and ``tls``. E2B's proxy is SOCKS5; aenv also takes ``socks5://host:port`` and
``http://host:port`` (an HTTP proxy, spoken to with CONNECT), the address shown back as given.
``tls`` (E2B's ``{enabled, serverName, caCert}``): the node speaks TLS to the proxy (the SOCKS5
or CONNECT handshake and the tunnel inside it), verifying its certificate against
``serverName`` (else the address's host) with the system's trust store, or with ``caCert``
alone (PEM, at most 8192 bytes, E2B's limit; public material, so the node is told it); never
unverified. Shown back as ``{enabled, serverName}``, without ``caCert`` (E2B's read-back).
An IPv6 upstream (``[2001:db8::1]:1080``) is refused: aenv's nodes have no IPv6 path out
(guests have no IPv6 either), so a name must have an IPv4 address.

The upstream must be public: an IP literal in a loopback, private, link-local or otherwise
non-public range, or a name that does not resolve or resolves into one (asked for at most
``RESOLVE_BUDGET`` seconds), is refused, unless
the operator set ``AENV_EGRESS_PROXY_ALLOW_PRIVATE`` (e.g. a proxy in the same network; the
tests' namespace proxies). The node checks the address again when it dials (a name is
resolved then, so a DNS change cannot send it elsewhere)."""
from __future__ import annotations

import base64
import binascii
import concurrent.futures
import hashlib
import ipaddress
import os
import socket
import ssl

from cryptography import x509
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from django.conf import settings

from events.outbound import refusal
from sandboxes.errors import Invalid, NotFound
from sandboxes.models import Sandbox
from team_secrets import crypto
from team_secrets.resolve import LIVE
from vmm.net import domains

KEY = "egressProxy"
SCHEMES = {"socks5": "socks5", "socks5h": "socks5", "http": "http"}
MAX_CREDENTIAL_BYTES = 255  # RFC 1929's limit, E2B's too
MAX_ADDRESS = 300
MAX_CA_BYTES = 8192  # E2B's limit for tls.caCert
_NO_IPV6 = ("IPv6 upstream proxies are not supported (aenv's nodes reach upstream proxies over IPv4): "
            "give an IPv4 address or a name with an IPv4 address")
_AD = b"aenv egress proxy password v1"  # no sandbox id: fork children share the sealed value
# A name is resolved at the edge for at most this long (the check runs in the request's event
# loop); past it the name is accepted, as the node resolves and checks it at every dial.
RESOLVE_BUDGET = 1.5
_LOOKUPS = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="egress-proxy-lookup")


def _text(value, what: str, limit: int) -> str:
    if not isinstance(value, str) or not value:
        raise Invalid(f"network.egressProxy.{what} must be a non-empty string")
    try:
        raw = value.encode()
    except UnicodeEncodeError:
        raise Invalid(f"network.egressProxy.{what} is not valid Unicode") from None
    if len(raw) > limit or any(c in value for c in "\r\n\x00"):
        raise Invalid(f"network.egressProxy.{what}: at most {limit} bytes, without CR, LF or NUL")
    return value


def _ipv6(text: str) -> bool:
    return domains.is_ip(text) and ipaddress.ip_address(text).version == 6


def _host_name(text: str) -> bool:
    """Whether ``text`` (lower case) is a host name (not an IP address nor a pattern)."""
    return not domains.is_ip(text) and not text.startswith("*") and domains.normalise(text) == text


def parse_address(address) -> tuple[str, str, int]:
    """``[socks5://|http://]host:port`` → (scheme, host, port), or Invalid."""
    text = _text(address, "address", MAX_ADDRESS).strip()
    scheme = "socks5"
    if "://" in text:
        given, text = text.split("://", 1)
        scheme = SCHEMES.get(given.lower(), "")
        if not scheme:
            raise Invalid(f"network.egressProxy.address: {given!r} is not a proxy aenv chains to "
                          "(socks5:// or http://; for TLS to the proxy set tls)")
    if "@" in text:
        raise Invalid("network.egressProxy.address must not carry credentials: give username and password")
    host, sep, port = text.rpartition(":")
    if any(_ipv6(t) for t in (host[1:-1] if host.startswith("[") else "", host, text)):
        raise Invalid(f"network.egressProxy.address: {_NO_IPV6}")  # [v6]:port, v6:port, a bare v6
    if not sep or not port.isdigit() or not 0 < int(port) < 65536 or "/" in text:
        raise Invalid("network.egressProxy.address must be host:port (e.g. proxy.example.com:1080)")
    host = host.lower().rstrip(".")
    if not domains.is_ip(host) and not _host_name(host):
        raise Invalid(f"network.egressProxy.address: {host[:100]!r} is not a host name or IPv4 address")
    return scheme, host, int(port)


def _check_reachable(host: str, port: int) -> None:
    """The upstream must be public unless the operator allows otherwise (module docstring)."""
    allow_private = settings.AENV_EGRESS_PROXY_ALLOW_PRIVATE
    if domains.is_ip(host):
        addresses = [host]
    elif allow_private:
        return  # the node resolves it when it dials (and checks again there)
    else:
        lookup = _LOOKUPS.submit(socket.getaddrinfo, host, port, socket.AF_INET, socket.SOCK_STREAM)
        try:
            addresses = list(dict.fromkeys(i[4][0] for i in lookup.result(timeout=RESOLVE_BUDGET)))
        except concurrent.futures.TimeoutError:
            return  # a slow resolver: the node checks the name at every dial anyway
        except (OSError, UnicodeError):
            raise Invalid(f"network.egressProxy.address: {host} does not resolve to an IPv4 address") from None
    for address in addresses:
        why = refusal(address, allow_private)
        if why:
            raise Invalid(f"network.egressProxy.address: {why}; the proxy must be reachable on the internet")


def _tls(value) -> dict | None:
    """E2B's ``tls`` → what is stored (``{"enabled": True, "serverName"?, "caCert"?}``) or
    None (off), or Invalid. ``true`` is accepted as ``{"enabled": true}``."""
    if value in (None, False):
        return None
    if value is True:
        value = {"enabled": True}
    if not isinstance(value, dict):
        raise Invalid("network.egressProxy.tls must be an object (enabled, serverName, caCert)")
    unknown = set(value) - {"enabled", "serverName", "caCert"}
    if unknown:
        raise Invalid(f"network.egressProxy.tls takes enabled, serverName and caCert, not {sorted(unknown)[0]!r}")
    if not isinstance(value.get("enabled"), bool):
        raise Invalid("network.egressProxy.tls.enabled must be true or false")
    if not value["enabled"]:
        if len(value) > 1:
            raise Invalid("network.egressProxy.tls: with enabled false no other field may be set")
        return None
    stored = {"enabled": True}
    if value.get("serverName") is not None:
        name = _text(value["serverName"], "tls.serverName", 253).strip().lower().rstrip(".")
        if not _host_name(name) and not (domains.is_ip(name) and ipaddress.ip_address(name).version == 4):
            raise Invalid(f"network.egressProxy.tls.serverName: {name[:100]!r} is not a host name or IPv4 address")
        stored["serverName"] = name
    if value.get("caCert") is not None:
        stored["caCert"] = _ca_cert(value["caCert"])
    return stored


def _ca_cert(value) -> str:
    """``tls.caCert``: PEM certificates that the node's TLS (OpenSSL, as here) can load."""
    if not isinstance(value, str) or not value.strip():
        raise Invalid("network.egressProxy.tls.caCert must be a non-empty string of PEM certificates")
    if len(value.encode(errors="replace")) > MAX_CA_BYTES:
        raise Invalid(f"network.egressProxy.tls.caCert: at most {MAX_CA_BYTES} bytes of PEM certificates")
    if any(ord(c) < 32 and c not in "\t\r\n" for c in value):  # PEM is text (and JSONB takes no NUL)
        raise Invalid("network.egressProxy.tls.caCert: PEM text, without control characters")
    try:
        certificates = x509.load_pem_x509_certificates(value.encode())
        ssl.create_default_context(cadata=value)  # what the node does with it
    except (ValueError, ssl.SSLError, UnicodeError):
        raise Invalid("network.egressProxy.tls.caCert is not PEM certificates "
                      "(-----BEGIN CERTIFICATE----- blocks)") from None
    if not certificates:
        raise Invalid("network.egressProxy.tls.caCert holds no certificate")
    return value


def _seal(password: str) -> dict:
    key = crypto.current_key()
    nonce = os.urandom(crypto.NONCE_BYTES)
    sealed = crypto.FORMAT + nonce + AESGCM(key).encrypt(nonce, password.encode(), _AD)
    return {"sealed": base64.b64encode(sealed).decode(), "keyId": crypto.key_id(key)}


def checked(value) -> dict | None:
    """E2B's ``egressProxy`` object → what the row stores (the password sealed), None for none
    (null or absent), or Invalid."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise Invalid("network.egressProxy must be an object with an address")
    unknown = set(value) - {"address", "username", "password", "tls"}
    if unknown:
        raise Invalid(f"network.egressProxy takes address, username, password and tls, not {sorted(unknown)[0]!r}")
    scheme, host, port = parse_address(value.get("address"))
    username, password = value.get("username"), value.get("password")
    if username is not None:
        username = _text(username, "username", MAX_CREDENTIAL_BYTES)
        if scheme == "http" and ":" in username:
            raise Invalid("network.egressProxy.username: an HTTP proxy's username cannot contain ':'")
    if password is not None:
        password = _text(password, "password", MAX_CREDENTIAL_BYTES)
        if username is None:
            raise Invalid("network.egressProxy.password is valid only together with username")
    tls = _tls(value.get("tls"))
    _check_reachable(host, port)
    stored = {"address": value["address"].strip()}
    if username is not None:
        stored["username"] = username
    if password is not None:
        stored["password"] = _seal(password)
    if tls:
        stored["tls"] = tls
    return stored


def public(network: dict | None) -> dict | None:
    """``network`` as it may be shown (responses, events): ``egressProxy`` without its sealed
    password and its TLS without the CA (E2B shows address, username and tls' enabled and
    serverName only)."""
    if not isinstance(network, dict) or not isinstance(network.get(KEY), dict):
        return network
    proxy = network[KEY]
    shown = {"address": proxy.get("address")}
    if proxy.get("username") is not None:
        shown["username"] = proxy["username"]
    if isinstance(proxy.get("tls"), dict):
        shown["tls"] = {k: proxy["tls"][k] for k in ("enabled", "serverName") if k in proxy["tls"]}
    return {**network, KEY: shown}


def credential_id(stored: dict) -> str:
    """Names the sealed password (the node's cache key): changes whenever it is replaced."""
    sealed = (stored.get("password") or {}).get("sealed")
    return hashlib.sha256(sealed.encode()).hexdigest()[:16] if sealed else ""


def spec(stored: dict | None) -> dict | None:
    """What the node is told (NetworkSpec.egress_proxy): where and as whom, never the password;
    with TLS, the name to verify and the CA (empty: the system's trust store)."""
    if not stored:
        return None
    scheme, host, port = parse_address(stored["address"])
    told = {"scheme": scheme, "host": host, "port": port, "username": stored.get("username") or "",
            "credential": credential_id(stored)}
    tls = stored.get("tls")
    if isinstance(tls, dict) and tls.get("enabled"):
        told.update(tls=True, tls_server_name=tls.get("serverName") or host, tls_ca=tls.get("caCert") or "")
    return told


def password_of(stored: dict) -> str:
    """The sealed password opened (for the node route only); Invalid if it cannot be."""
    sealed = (stored or {}).get("password") or {}
    key = crypto.current_key()
    if sealed.get("keyId") != crypto.key_id(key):
        raise Invalid("the egress proxy password was sealed under another secrets key")
    try:
        raw = base64.b64decode(sealed.get("sealed") or "", validate=True)
        if raw[:1] != crypto.FORMAT:
            raise ValueError
        nonce = raw[1:1 + crypto.NONCE_BYTES]
        return AESGCM(key).decrypt(nonce, raw[1 + crypto.NONCE_BYTES:], _AD).decode()
    except (ValueError, binascii.Error, InvalidTag):
        raise Invalid("the egress proxy password does not open under the secrets key") from None


def resolve(node_id: str, sandbox_id: str, credential: str) -> str:
    """The password a node's egress proxy presents to sandbox ``sandbox_id``'s upstream: only
    for a sandbox live on that node whose proxy still has that credential (a replaced one is
    NotFound, so a stale cache entry cannot come back)."""
    sandbox = Sandbox.objects.filter(pk=sandbox_id).only("id", "node_id", "state", "network").first()
    if sandbox is None or sandbox.node_id != node_id or sandbox.state not in LIVE:
        raise NotFound(f'no live sandbox "{sandbox_id}" on node {node_id}', retry=False)
    stored = (sandbox.network or {}).get(KEY)
    if not isinstance(stored, dict) or not stored.get("password") or credential_id(stored) != credential:
        raise NotFound(f'sandbox "{sandbox_id}" has no egress proxy password {credential or "(none)"}', retry=False)
    return password_of(stored)
