"""Named test hosts for the egress proxy's tests and benchmark: an HTTP (port 80) and an HTTPS
(ports 443 and 8443) server on each of the external host's addresses (harness.networld), each answering
with its own name and the Host it was asked for (and the ``X-Aenv-*`` and ``Authorization``
headers it got, one ``name: value`` line each), plus plain listeners on the DNS ports (53,
853) and on 8053 (a port no rule treats specially); their certificate comes from a test CA
(``hosts-ca.pem``), which ``proxy_world`` makes the egress proxy trust upstream
(``upstream_ca``); ``proxy_world``: those hosts, a node resolver and the egress proxy
without a VM, with a node CA of its own. Only addresses inside the test's own namespaces
are ever served (the brief's rule).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

SERVER = r'''
import socket, ssl, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

address, name, cert, key = sys.argv[1:5]

class Answer(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are two writes: no delayed-ACK wait between them
    def do_GET(self):
        seen = "".join(f"{k.lower()}: {v}\n" for k, v in self.headers.items()
                       if k.lower().startswith("x-aenv-") or k.lower() == "authorization")
        body = f"{name} host={self.headers.get('Host')}\n{seen}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass

plain = ThreadingHTTPServer((address, 80), Answer)
context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
context.load_cert_chain(cert, key)
for port in (443, 8443):
    tls = ThreadingHTTPServer((address, port), Answer)
    tls.socket = context.wrap_socket(tls.socket, server_side=True)
    threading.Thread(target=tls.serve_forever, daemon=True).start()

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
plain.serve_forever()
'''


def make_cert(directory: Path, names: list[str]) -> tuple[Path, Path]:
    """A certificate for ``names`` issued by a test CA (``directory/hosts-ca.pem``, made here):
    what the egress proxy verifies intercepted upstreams against in the tests."""
    cert, key, ca = directory / "hosts.pem", directory / "hosts.key", directory / "hosts-ca.pem"
    ca_key = directory / "hosts-ca.key"
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    subprocess.run(["openssl", "req", "-x509", *ec, "-days", "2", "-subj", "/CN=aenv test hosts CA",
                    "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign",
                    "-keyout", str(ca_key), "-out", str(ca)], check=True, capture_output=True, timeout=60)
    csr = directory / "hosts.csr"
    subprocess.run(["openssl", "req", "-new", *ec, "-subj", f"/CN={names[0]}", "-keyout", str(key), "-out", str(csr)],
                   check=True, capture_output=True, timeout=60)
    ext = directory / "hosts.ext"
    ext.write_text("subjectAltName=" + ",".join(f"DNS:{n}" for n in names) + "\nextendedKeyUsage=serverAuth\n"
                   "basicConstraints=critical,CA:FALSE\n")
    subprocess.run(["openssl", "x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
                    "-CAcreateserial", "-days", "2", "-extfile", str(ext), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    ca.chmod(0o644)  # the proxy (nobody) verifies upstreams against it
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
            for port in (80, 443, 8443, 8053):
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


@contextmanager
def proxy_world(pool: str, clients: tuple[str, ...], max_connections: int | None = None,
                secrets: dict | None = None, allow_private_upstream: bool = False):
    """The node's egress proxy without a VM, for its tests and benchmark: an external host
    (harness.networld) serving good.test (EXT_A) and evil.test (EXT_B), a node resolver
    (vmm.net.dns) for a resolver instance of ``pool`` that answers those names only
    (its upstream is a loopback address where nothing answers), and the proxy on the
    resolver's address (``max_connections``: per sandbox, else the default); ``clients``
    ("slot addresses") are put on lo for the caller to bind to, and their TCP to the
    resolver's address (DNS aside) goes to the proxy's listener with the port kept for
    ``SO_ORIGINAL_DST``, as a slot's and the node's DNATs deliver a guest's. Yields the
    EgressProxy; removes everything. The proxy gets a node CA of its own (``egress.ca``, a
    vmm.egress_ca.NodeCA: what intercepted TLS is signed with), trusts the named hosts' test
    CA upstream, and fills secrets with ``secrets`` (``{"url", "headers"}``) when given;
    ``allow_private_upstream``: sandboxes' upstream proxies may be namespace addresses
    (``egress.ext_netns`` names the external host's namespace, where a test may run them)."""
    from harness.networld import EXT_A, EXT_B, ExternalHost  # noqa: PLC0415
    from vmm.net.dns import NodeDNS, _on_lo, service_ip  # noqa: PLC0415
    from vmm.net.egress import EgressProxy  # noqa: PLC0415
    from vmm.net.slots import PROXY_PORT  # noqa: PLC0415
    from vmm.egress_ca import NodeCA  # noqa: PLC0415

    ext = ExternalHost(name=f"aenvegx{os.getpid() % 100000}").start()
    for proc in ext.procs:  # its plain servers make way for the named ones
        proc.kill()
        proc.wait(timeout=10)
    ext.procs = []
    work = Path(tempfile.mkdtemp(prefix="aenv-egress-world-"))
    work.chmod(0o755)
    prefix = "eg" + uuid.uuid4().hex[:4]
    table = f"aenvegt_{prefix}"
    hosts = dns = egress = None
    try:
        hosts = NamedHosts(ext.name, {EXT_A: "good.test", EXT_B: "evil.test"}, work / "hosts").start()
        resolv = work / "resolv.conf"
        resolv.write_text(f"nameserver 127.53.{pool.split('.')[1]}.2\n")
        resolv.chmod(0o644)
        dns = NodeDNS(prefix, pool, work / "net", resolv_file=str(resolv))
        dns.ensure()
        (dns.hosts_dir / "named").write_text(hosts.hosts_file() + f"127.0.0.1 loop.test\n{EXT_A} alias.test\n")
        for address in clients:
            _on_lo(address, True)
        ip = service_ip(pool)
        subprocess.run(["nft", "-f", "-"], check=True, capture_output=True, text=True, timeout=30, input=f"""
table ip {table} {{
    chain out {{
        type nat hook output priority -100; policy accept;
        ip saddr {{ {", ".join(clients)} }} ip daddr {ip} tcp dport != 53 dnat ip to {ip}:{PROXY_PORT}
    }}
}}
""")
        ca = NodeCA.ensure(work / "egress-ca", "test")
        egress = EgressProxy(prefix, service_ip(pool), work / "net", reopened=(f"{EXT_A}/32", f"{EXT_B}/32"),
                             ca_pem=ca.mitmproxy_pem(), secrets=secrets,
                             upstream_ca=str(work / "hosts" / "hosts-ca.pem"),
                             allow_private_upstream=allow_private_upstream,
                             **({"max_connections": max_connections} if max_connections else {}))
        egress.ca = ca
        egress.ext_netns = ext.name
        egress.ensure()
        yield egress
    finally:
        if egress is not None:
            egress.stop()
        if dns is not None:
            dns.stop()
        subprocess.run(["nft", "delete", "table", "ip", table], capture_output=True, timeout=30)
        for address in clients:
            _on_lo(address, False)
        if hosts is not None:
            hosts.stop()
        ext.stop()
        shutil.rmtree(work, ignore_errors=True)
