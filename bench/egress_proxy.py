"""Benchmark: what the node egress proxy (vmm.net.egress: mitmproxy with aenv's addon) costs
per connection and per request, against the same servers reached directly.

No VM (a TCG guest's own slowness would hide the proxy's): a client on the node, bound to a
"slot address", talks to the proxy's listeners as a slot's DNAT delivers a guest
(harness.named_hosts.proxy_world: named hosts in a namespace of the benchmark's own, a node
resolver, the proxy). Direct = the same client to the server's address. Measured:

- ``https_connection``: TCP connect + TLS handshake + one GET + close (the proxy reads the
  SNI, asks the resolver, connects and passes the bytes through);
- ``http_connection``: TCP connect + one GET + close (the proxy parses the request and
  re-sends it);
- ``http_request``: one GET on a kept-alive connection (each is judged by its Host);
- ``https_request``: one GET on a kept-alive TLS connection (bytes passed through).

``intercepted``: the same through the proxy with ``network.rules`` for good.test (one header
set, no secret): TLS is ended at the proxy with a leaf of the node's CA and opened again to the
server (verified against the hosts' test CA), and every request gets the header.

``haproxy`` (where Debian's haproxy is installed): the same through HAProxy routing by SNI (TCP
mode) and by Host (HTTP mode) to a fixed server, no lookup: what a C proxy costs for the
judging alone, the alternative weighed against mitmproxy (docs/networks.md says why
mitmproxy).

Needs root, nft, dnsmasq and mitmproxy in .venv-egress (scripts/setup.sh). Prints a table;
writes JSON to bench/results/egress_proxy-<UTC stamp>.json.

    .venv/bin/python bench/egress_proxy.py [--runs 200]
"""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.lifecycle_common import percentile  # noqa: E402
from harness.named_hosts import proxy_world  # noqa: E402
from harness.networld import EXT_A  # noqa: E402
from vmm.net import slots  # noqa: E402
from vmm.net.dns import service_ip  # noqa: E402

POOL = "10.18.0.0/24"  # the benchmark's own resolver instance (base + 1) and client (+ 3)
CLIENT = "10.18.0.3"
CONTEXT = ssl.create_default_context()
CONTEXT.check_hostname, CONTEXT.verify_mode = False, ssl.CERT_NONE
REQUEST = b"GET / HTTP/1.1\r\nHost: good.test\r\n\r\n"


def _answer(stream) -> bytes:
    length = 0
    status = stream.readline()
    assert status.startswith(b"HTTP/1.1 200"), status
    while (line := stream.readline().strip()):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return stream.read(length)


HAPROXY = """
global
    maxconn 1000
defaults
    timeout connect 5s
    timeout client 30s
    timeout server 30s
frontend tls
    mode tcp
    bind {ip}:{tls}
    tcp-request inspect-delay 5s
    tcp-request content accept if {{ req.ssl_hello_type 1 }}
    use_backend good_tls if {{ req.ssl_sni -i good.test }}
backend good_tls
    mode tcp
    server good {server}:443
frontend plain
    mode http
    bind {ip}:{http}
    http-request deny unless {{ req.hdr(host),field(1,:) -i good.test }}
    default_backend good_http
backend good_http
    mode http
    server good {server}:80
"""
HAPROXY_PORTS = {80: 16080, 443: 16443}


def _open(address: tuple[str, int], tls: bool):
    # mitmproxy knows the client by its slot address (and only its connections are DNATed to
    # it); the external host routes only the node's own
    source = (CLIENT, 0) if address[0] == service_ip(POOL) and address[1] in (80, 443) else None
    sock = socket.create_connection(address, timeout=10, source_address=source)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return CONTEXT.wrap_socket(sock, server_hostname="good.test") if tls else sock


def one_connection(address, tls: bool) -> float:
    t0 = time.perf_counter()
    with _open(address, tls) as sock:
        sock.sendall(REQUEST)
        assert b"good.test" in _answer(sock.makefile("rb"))
    return (time.perf_counter() - t0) * 1000


def requests_on_one_connection(address, tls: bool, runs: int) -> list[float]:
    out = []
    with _open(address, tls) as sock:
        stream = sock.makefile("rb")
        for _ in range(runs):
            t0 = time.perf_counter()
            sock.sendall(REQUEST)
            assert b"good.test" in _answer(stream)
            out.append((time.perf_counter() - t0) * 1000)
    return out


def start_haproxy(directory: Path) -> subprocess.Popen | None:
    """HAProxy judging by SNI / Host on the resolver's address, or None where it is not installed."""
    binary = shutil.which("haproxy")
    if binary is None:
        return None
    config = directory / "haproxy.cfg"
    config.write_text(HAPROXY.format(ip=service_ip(POOL), tls=HAPROXY_PORTS[443], http=HAPROXY_PORTS[80],
                                     server=EXT_A))
    proc = subprocess.Popen([binary, "-f", str(config), "-db"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection((service_ip(POOL), HAPROXY_PORTS[443]), timeout=1).close()
            return proc
        except OSError:
            assert time.monotonic() < deadline and proc.poll() is None, "haproxy did not start"
            time.sleep(0.1)


def measure(runs: int, haproxy: bool, egress) -> dict[str, list[float]]:
    proxy_ip = service_ip(POOL)
    paths = {"direct": {80: (EXT_A, 80), 443: (EXT_A, 443)},
             "proxy": {80: (proxy_ip, 80), 443: (proxy_ip, 443)},  # proxy_world's DNAT, as a slot's
             "intercepted": {80: (proxy_ip, 80), 443: (proxy_ip, 443)}}
    if haproxy:
        paths["haproxy"] = {port: (proxy_ip, listen) for port, listen in HAPROXY_PORTS.items()}
    samples: dict[str, list[float]] = {}
    for way, ports in paths.items():
        rules = {"good.test": [{"X-Aenv-Bench": "1"}]} if way == "intercepted" else None
        egress.allow(CLIENT, "bench", ("good.test",), rules)
        for name, port, tls in (("http", 80, False), ("https", 443, True)):
            one_connection(ports[port], tls)  # warm up
            samples[f"{name}_connection {way}"] = [one_connection(ports[port], tls) for _ in range(runs)]
            samples[f"{name}_request {way}"] = requests_on_one_connection(ports[port], tls, runs)
    return samples


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args()
    if not slots.netns_supported():
        print("needs root, nft and nsenter", file=sys.stderr)
        return 2
    with proxy_world(POOL, (CLIENT,)) as egress, tempfile.TemporaryDirectory() as work:
        haproxy = start_haproxy(Path(work))
        try:
            samples = measure(args.runs, haproxy is not None, egress)
        finally:
            if haproxy is not None:
                haproxy.terminate()
                haproxy.wait(timeout=10)
    summary = {name: {"median_ms": round(statistics.median(v), 3), "p90_ms": round(percentile(v, 90), 3),
                      "p95_ms": round(percentile(v, 95), 3), "n": len(v)} for name, v in samples.items()}
    print("| measure | way | median ms | p90 ms | p95 ms | n |\n|---|---|---:|---:|---:|---:|")
    for name, row in sorted(summary.items()):
        what, way = name.split(" ")
        print(f"| {what} | {way} | {row['median_ms']} | {row['p90_ms']} | {row['p95_ms']} | {row['n']} |")
    ways = [w for w in ("proxy", "intercepted", "haproxy") if f"http_request {w}" in summary]
    added = {way: {what: round(summary[f"{what} {way}"]["median_ms"] - summary[f"{what} direct"]["median_ms"], 3)
                   for what in ("http_connection", "https_connection", "http_request", "https_request")}
             for way in ways}
    for way, figures in added.items():
        print(f"added by {way} (median ms): " + ", ".join(f"{k} {v}" for k, v in figures.items()))
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = ROOT / "bench" / "results" / f"egress_proxy-{stamp}.json"
    path.write_text(json.dumps({"host": platform.node(), "kernel": platform.release(), "runs": args.runs,
                                "summary": summary, "added_median_ms": added, "samples": samples}, indent=2))
    print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
