"""Named test hosts for the egress proxy's tests and benchmark: an HTTP (port 80) and an HTTPS
(port 443) server on each of the external host's addresses (harness.networld), each answering
with its own name and the Host it was asked for, plus plain listeners on the DNS ports (53,
853) and on 8053 (a port no rule treats specially). Only addresses inside the test's own
namespace are ever served (the brief's rule).
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

SERVER = r'''
import socket, ssl, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

address, name, cert, key = sys.argv[1:5]

class Answer(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        body = f"{name} host={self.headers.get('Host')}\n".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass

plain = ThreadingHTTPServer((address, 80), Answer)
tls = ThreadingHTTPServer((address, 443), Answer)
context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
context.load_cert_chain(cert, key)
tls.socket = context.wrap_socket(tls.socket, server_side=True)

def hello(port):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((address, port))
    s.listen(16)
    while True:
        c, _ = s.accept()
        c.sendall(f"{name}:{port}\n".encode())
        c.close()

for port in (53, 853, 8053):
    threading.Thread(target=hello, args=(port,), daemon=True).start()
threading.Thread(target=tls.serve_forever, daemon=True).start()
plain.serve_forever()
'''


def make_cert(directory: Path, names: list[str]) -> tuple[Path, Path]:
    """A self-signed certificate for ``names`` (the guest's clients do not verify it)."""
    cert, key = directory / "hosts.pem", directory / "hosts.key"
    san = ",".join(f"DNS:{n}" for n in names)
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-days", "2", "-subj", f"/CN={names[0]}", "-addext", f"subjectAltName={san}",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True, timeout=60)
    return cert, key


class NamedHosts:
    """``hosts``: address -> name, served inside the network namespace ``netns``."""

    def __init__(self, netns: str, hosts: dict[str, str], directory: Path):
        self.netns, self.hosts, self.directory = netns, hosts, Path(directory)
        self.procs: list[subprocess.Popen] = []

    def start(self) -> "NamedHosts":
        self.directory.mkdir(parents=True, exist_ok=True)
        cert, key = make_cert(self.directory, list(self.hosts.values()))
        script = self.directory / "named_server.py"
        script.write_text(SERVER)
        for address, name in self.hosts.items():
            self.procs.append(subprocess.Popen(
                ["ip", "netns", "exec", self.netns, sys.executable, str(script), address, name, str(cert), str(key)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 20
        for address in self.hosts:
            for port in (80, 443, 8053):
                while subprocess.run(["ip", "netns", "exec", self.netns, sys.executable, "-c",
                                      f"import socket; socket.create_connection(('{address}', {port}), 1)"],
                                     capture_output=True).returncode != 0:
                    assert time.monotonic() < deadline, f"the named host {address}:{port} did not start"
                    time.sleep(0.1)
        return self

    def hosts_file(self) -> str:
        """The lines for the node resolver's hosts.d (vmm.net.dns)."""
        return "".join(f"{address} {name}\n" for address, name in self.hosts.items())

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait(timeout=10)
        self.procs = []
