"""A stand-in for the TLS terminator in front of the data plane with host routing (docs/networks.md:
a wildcard DNS record and certificate for ``*.AENV_SANDBOX_DOMAIN``), so the unchanged SDKs
can be run without ``E2B_SANDBOX_URL``: they then reach ``https://49983-<id>.<domain>``.

No DNS name or port 443 is needed: this is the SDKs' ``proxy`` — SOCKS5 for the Python SDK
(``socks5h://``: the API's plain HTTP is tunnelled too), HTTP ``CONNECT`` for the TypeScript
SDK (undici tunnels every request). A tunnel to port 443 is TLS-terminated with a
certificate for the name asked for (SNI), issued by a CA of its own (trusted through
``SSL_CERT_FILE`` / ``NODE_EXTRA_CA_CERTS``), and piped to the data plane as plain HTTP/1.1;
a tunnel to a loopback port (the API) is piped as it is. A reset on one side resets the
other, as an L4 terminator does. Runs its own event loop in a thread: the sync SDK blocks
the test's thread."""
from __future__ import annotations

import asyncio
import datetime
import ipaddress
import socket
import ssl
import struct
import threading
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

HEADER_LIMIT = 8192
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


class TlsIngress:
    def __init__(self, upstream: tuple[str, int], workdir: Path):
        self.upstream = upstream
        self.workdir = workdir
        self.port = 0
        self._ca_key = ec.generate_private_key(ec.SECP256R1())
        self._ca = _certificate(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "aenv test ingress CA")]),
                                self._ca_key.public_key(), None, self._ca_key, ca=True)
        self.ca_file = workdir / "ingress-ca.pem"
        self.ca_file.write_bytes(self._ca.public_bytes(serialization.Encoding.PEM))
        self._contexts: dict[str, ssl.SSLContext] = {}
        self._default = self._context_for("localhost")
        self._default.sni_callback = self._pick_context
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tls-ingress", daemon=True)
        self._server: asyncio.AbstractServer | None = None

    @property
    def socks_url(self) -> str:
        return f"socks5h://127.0.0.1:{self.port}"

    @property
    def connect_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "TlsIngress":
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0), self._loop).result(10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        async def close():
            self._server.close()
            await self._server.wait_closed()

        if self._server is not None:
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    # ------------------------------------------------------------------ certificates

    def _context_for(self, name: str) -> ssl.SSLContext:
        ctx = self._contexts.get(name)
        if ctx is None:
            key = ec.generate_private_key(ec.SECP256R1())
            cert = _certificate(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]), key.public_key(),
                                name, self._ca_key, issuer=self._ca.subject)
            stem = self.workdir / f"ingress-{len(self._contexts)}"
            stem.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
            stem.with_suffix(".key").write_bytes(key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(stem.with_suffix(".crt"), stem.with_suffix(".key"))
            ctx.set_alpn_protocols(["http/1.1"])  # the data plane speaks HTTP/1.1
            self._contexts[name] = ctx
        return ctx

    def _pick_context(self, sslobj, server_name, _ctx):
        if server_name:
            sslobj.context = self._context_for(server_name)

    # ------------------------------------------------------------------ tunnels

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        try:
            first = await reader.readexactly(1)
            if first == b"\x05":
                target = await _socks5(reader, writer)
            else:
                target = await _http_connect(first, reader, writer)
            if target is None:
                return writer.close()
            host, port = target
            if port == 443:
                await writer.start_tls(self._default)
                host, port = self.upstream
            elif host not in LOOPBACK:
                return _abort(writer)
            up_reader, up_writer = await asyncio.open_connection(host, port)
        except (OSError, asyncio.IncompleteReadError, ssl.SSLError, ValueError):
            return _abort(writer)
        await _splice((reader, writer), (up_reader, up_writer))


async def _socks5(reader, writer) -> tuple[str, int] | None:
    """RFC 1928, no authentication, CONNECT only."""
    methods = await reader.readexactly((await reader.readexactly(1))[0])
    if 0 not in methods:
        writer.write(b"\x05\xff")
        return None
    writer.write(b"\x05\x00")
    version, command, _, kind = await reader.readexactly(4)
    if version != 5 or command != 1:
        writer.write(b"\x05\x07\x00\x01" + bytes(6))
        return None
    if kind == 1:
        host = str(ipaddress.IPv4Address(await reader.readexactly(4)))
    elif kind == 4:
        host = str(ipaddress.IPv6Address(await reader.readexactly(16)))
    elif kind == 3:
        host = (await reader.readexactly((await reader.readexactly(1))[0])).decode("ascii")
    else:
        writer.write(b"\x05\x08\x00\x01" + bytes(6))
        return None
    port = struct.unpack(">H", await reader.readexactly(2))[0]
    writer.write(b"\x05\x00\x00\x01" + bytes(6))
    return host, port


async def _http_connect(first: bytes, reader, writer) -> tuple[str, int] | None:
    head = first + await reader.readuntil(b"\r\n\r\n")
    if len(head) > HEADER_LIMIT:
        return None
    method, authority, _ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
    if method != "CONNECT":
        writer.write(b"HTTP/1.1 405 Method Not Allowed\r\ncontent-length: 0\r\n\r\n")
        return None
    host, _, port = authority.rpartition(":")
    writer.write(b"HTTP/1.1 200 Connection Established\r\n\r\n")
    return host.strip("[]"), int(port)


async def _splice(a, b) -> None:
    """Both directions until one ends: an end closes both sides, a reset (or any failure)
    resets both."""
    async def one_way(src: asyncio.StreamReader, dst: asyncio.StreamWriter):
        while chunk := await src.read(65536):
            dst.write(chunk)
            await dst.drain()

    tasks = [asyncio.ensure_future(one_way(a[0], b[1])), asyncio.ensure_future(one_way(b[0], a[1]))]
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    failed = any(t.exception() is not None for t in done)
    for _, writer in (a, b):
        if failed:
            _abort(writer)
        else:
            writer.close()


def _abort(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


def _certificate(subject, public_key, dns_name, signing_key, *, issuer=None, ca=False):
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer or subject)
               .public_key(public_key).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=2))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
            decipher_only=False), critical=True)
    else:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(dns_name)]), critical=False)
    return builder.sign(signing_key, hashes.SHA256())
