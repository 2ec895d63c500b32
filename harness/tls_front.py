"""A TLS front for the test upstream proxies (harness.upstream_proxies): ends TLS with a
certificate of the test's own CA and passes the plaintext on to a proxy listening beside it,
so a plain SOCKS5 / HTTP proxy is reached as an upstream over TLS (``egressProxy.tls``).

Why a script of its own: mitmproxy's socks5 and regular modes do not listen with TLS, and a
few lines of asyncio do (stdlib only: it runs in the external host's namespace). Each
finished handshake prints ``tunnel <peer>`` (asyncio calls ``serve`` only then), so a test
can tell whether a node got through the TLS at all.

``python3 tls_front.py LISTEN_IP PORT BACKEND_PORT CERT KEY``"""
from __future__ import annotations

import asyncio
import ssl
import sys

CHUNK = 65536


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()  # the TLS client's close_notify or FIN: a half-close to the proxy
        else:
            writer.close()  # TLS has no half-close: the proxy's end is the end
    except (ConnectionError, OSError):
        writer.close()


async def main(listen: str, port: int, backend: int, cert: str, key: str) -> None:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        print("tunnel", writer.get_extra_info("peername")[0], flush=True)
        try:
            up_reader, up_writer = await asyncio.open_connection(listen, backend)
        except OSError:
            writer.close()
            return
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            up_writer.close()
            writer.close()

    server = await asyncio.start_server(serve, listen, port, ssl=context)
    print("listening", listen, port, flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    ip, listen_port, backend_port, cert_file, key_file = sys.argv[1:6]
    asyncio.run(main(ip, int(listen_port), int(backend_port), cert_file, key_file))
