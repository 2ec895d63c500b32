"""Python the egress tests run inside a guest: plain sockets that report what a connection got
(the bytes, ``closed`` or ``failed: …``, never an exception) and a runner of named checks in
parallel. A test's script is ``LIB`` followed by its own checks, ending with
``print(json.dumps(run_checks(checks, names)))``: one JSON object, check -> what the guest got.

A connection waits at most ``CONNECT`` seconds to be accepted: a permitted one is accepted within
milliseconds (by the server, or by the node's egress proxy that a guest's traffic is redirected
to), a denied one is dropped and never is, and the checks of a round run at once, so a round with
checks that must fail costs ``CONNECT`` once, not their exchange's longer timeout (the
handshakes and answers that follow keep it)."""

LIB = r'''
import json, socket, ssl, sys, threading

CONNECT = 3  # seconds: a SYN and its retransmission

def connect(ip, port, timeout):
    s = socket.create_connection((ip, port), timeout=min(timeout, CONNECT))
    s.settimeout(timeout)
    return s

def read(sock):
    out = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            out += chunk
    except Exception:
        pass
    return out.decode(errors="replace")

def https(ip, sni, host=None, port=443, timeout=15, cafile=None, headers=""):
    # TLS naming ``sni`` to ip:port (the certificate checked against ``cafile`` if given, else
    # not), then a GET with Host ``host`` and ``headers`` (lines, each ending in CRLF)
    try:
        raw = connect(ip, port, timeout)
        if cafile:
            ctx = ssl.create_default_context(cafile=cafile)
        else:
            ctx = ssl.create_default_context()
            ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        tls = ctx.wrap_socket(raw, server_hostname=sni)
        tls.sendall(f"GET / HTTP/1.1\r\nHost: {host or sni}\r\n{headers}Connection: close\r\n\r\n".encode())
        return read(tls)
    except Exception as exc:
        return f"failed: {exc!r}"

def http(ip, host, timeout=15, headers=""):
    try:
        s = connect(ip, 80, timeout)
        s.sendall(f"GET / HTTP/1.1\r\nHost: {host}\r\n{headers}Connection: close\r\n\r\n".encode())
        return read(s)
    except Exception as exc:
        return f"failed: {exc!r}"

def tcp(ip, port, send=b"", timeout=8):
    try:
        s = connect(ip, port, timeout)
        if send:
            s.sendall(send)
        return read(s) or "closed"
    except Exception as exc:
        return f"failed: {exc!r}"

def run_checks(checks, names):
    results = {}
    def run(name):
        try:
            results[name] = checks[name]()
        except Exception as exc:
            results[name] = f"failed: {exc!r}"
    threads = [threading.Thread(target=run, args=(n,)) for n in names]
    for t in threads: t.start()
    for t in threads: t.join()
    return results
'''
