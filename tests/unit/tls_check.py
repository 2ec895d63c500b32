"""A real TLS handshake on loopback (a server with a leaf of ``vmm.egress_ca``, a client that
trusts a given CA file), shared by the CA's and the guest trust store's tests."""
import socket
import ssl
import tempfile
import threading


def handshake(leaf, cafile, server_hostname: str) -> bytes:
    """What the client reads (``b"ok"``) once it verified the server; raises
    ``ssl.SSLCertVerificationError`` when it does not trust it."""
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with tempfile.NamedTemporaryFile() as chain, tempfile.NamedTemporaryFile() as key:
        chain.write(leaf.chain_pem)
        key.write(leaf.key_pem)
        chain.flush()
        key.flush()
        server_ctx.load_cert_chain(chain.name, key.name)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve():
        conn, _ = listener.accept()
        try:
            with server_ctx.wrap_socket(conn, server_side=True) as tls:
                tls.sendall(b"ok")
        except (ssl.SSLError, OSError):
            pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client_ctx = ssl.create_default_context(cafile=str(cafile))
    try:
        with socket.create_connection(("127.0.0.1", port)) as raw:
            with client_ctx.wrap_socket(raw, server_hostname=server_hostname) as tls:
                return tls.recv(2)
    finally:
        thread.join(5)
        listener.close()
