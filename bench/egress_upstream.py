"""Benchmark: what chaining a sandbox's egress through its upstream proxy (``network.egressProxy``,
vmm/net/egress_proxy/upstream_chain.py) costs per connection and in throughput.

No VM: clients on the node bound to "slot addresses" reach the node egress proxy as a slot's
and the node's DNATs deliver a guest (harness.named_hosts.proxy_world), the upstreams are
mitmproxy's SOCKS5 and HTTP proxies in the external host's namespace
(harness.upstream_proxies). Each ``*_connection`` is TCP connect + one GET + close:

- ``direct``: to good.test's address, no proxy at all;
- ``upstream only``: the client itself asks the SOCKS5 upstream (a hand-made SOCKS5 CONNECT):
  what the upstream hop costs without aenv;
- ``by address socks5`` / ``by address http``: an open policy with an upstream: the node's
  relay (CHAIN_PORT) reads SO_ORIGINAL_DST, dials the upstream, joins the streams;
- ``by name``: a domain sandbox without upstream (mitmproxy judges the Host) — the existing
  path, for comparison; ``by name socks5``: the same with the upstream (mitmproxy's server
  connection to a one-shot loopback relay joined to the upstream);
- ``https by name socks5``: TLS judged by SNI and passed through, chained;
- ``... tls``: the same SOCKS5 upstream reached over TLS (``egressProxy.tls``: behind
  harness/tls_front.py, its certificate verified against the test's CA): ``upstream only tls``
  is the client itself doing that TLS + SOCKS5 (the front's own cost included, a Python relay),
  ``by address socks5 tls`` / ``by name socks5 tls`` aenv doing it.

``throughput``: one 64 MiB body over one connection: direct, through the SOCKS5 upstream
alone, and by address through aenv's relay and the SOCKS5 upstream, plain and over TLS.

Needs root, nft, dnsmasq and mitmproxy + python-socks in .venv-egress (scripts/setup.sh).
Prints a table; writes JSON to bench/results/egress_upstream-<UTC stamp>.json.

    .venv/bin/python bench/egress_upstream.py [--runs 200]
"""
from __future__ import annotations

import argparse
import json
import platform
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
from harness.api_stand_in import StandIn, served  # noqa: E402
from harness.named_hosts import proxy_world  # noqa: E402
from harness.networld import EXT_A  # noqa: E402
from harness.upstream_proxies import (HTTP_PROXY, SOCKS, SOCKS_TLS, TLS_NAME, UPSTREAM, Upstreams,  # noqa: E402
                                      chained_dnat)
from vmm.net import slots  # noqa: E402
from vmm.net.dns import service_ip  # noqa: E402

POOL = "10.23.0.0/24"
OPEN_SOCKS, OPEN_HTTP, BY_NAME, BY_NAME_SOCKS = "10.23.0.3", "10.23.0.5", "10.23.0.7", "10.23.0.9"
OPEN_TLS, BY_NAME_TLS = "10.23.0.11", "10.23.0.13"  # the SOCKS5 upstream over TLS
PASSWORD = {"c-socks": "bench-socks", "c-http": "bench-http"}
BULK_PORT, BULK_BYTES = 8099, 64 << 20
CONTEXT = ssl.create_default_context()
CONTEXT.check_hostname, CONTEXT.verify_mode = False, ssl.CERT_NONE
REQUEST = b"GET / HTTP/1.1\r\nHost: good.test\r\nConnection: close\r\n\r\n"
BULK = f"""
import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("{EXT_A}", {BULK_PORT}))
s.listen(8)
chunk = b"x" * 65536
while True:
    c, _ = s.accept(); c.recv(100)
    for _ in range({BULK_BYTES} // 65536):
        c.sendall(chunk)
    c.close()
"""


class Passwords(StandIn):
    def answer(self, body: dict) -> tuple[int, dict]:
        return 200, {"password": PASSWORD.get(body.get("credential"), ""), "ttl": 600}


def _read_all(sock) -> bytes:
    out = []
    while chunk := sock.recv(1 << 20):
        out.append(chunk)
    return b"".join(out)


def _socks_connect(sock: socket.socket, host: str, port: int) -> None:
    """A SOCKS5 CONNECT with user / password (RFC 1928 / 1929), for the upstream-only baseline."""
    user, password = b"alice", PASSWORD["c-socks"].encode()
    sock.sendall(b"\x05\x01\x02")
    assert sock.recv(2) == b"\x05\x02"
    sock.sendall(b"\x01" + bytes([len(user)]) + user + bytes([len(password)]) + password)
    assert sock.recv(2) == b"\x01\x00"
    sock.sendall(b"\x05\x01\x00\x01" + socket.inet_aton(host) + port.to_bytes(2, "big"))
    reply = sock.recv(10)
    assert reply[:2] == b"\x05\x00", reply


UPSTREAM_TLS: list[ssl.SSLContext] = []  # the client's own TLS to the upstream (the test CA), once known


def one(address: tuple[str, int], source: str | None = None, tls: bool = False, socks: bool = False) -> float:
    t0 = time.perf_counter()
    sock = socket.create_connection(address, timeout=15, source_address=(source, 0) if source else None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if socks and address[1] == SOCKS_TLS:
        sock = UPSTREAM_TLS[0].wrap_socket(sock, server_hostname=TLS_NAME)
    if socks:
        _socks_connect(sock, EXT_A, 80)
    if tls:
        sock = CONTEXT.wrap_socket(sock, server_hostname="good.test")
    with sock:
        sock.sendall(REQUEST)
        assert b"good.test" in _read_all(sock)
    return (time.perf_counter() - t0) * 1000


def throughput(source: str | None, socks: bool = False) -> float:
    t0 = time.perf_counter()
    with socket.create_connection((UPSTREAM, SOCKS) if socks else (EXT_A, BULK_PORT), timeout=60,
                                  source_address=(source, 0) if source else None) as sock:
        if socks:
            _socks_connect(sock, EXT_A, BULK_PORT)
        sock.sendall(b"go")
        got = len(_read_all(sock))
    assert got == BULK_BYTES, got
    return BULK_BYTES / (time.perf_counter() - t0) / (1 << 20)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args()
    if not slots.netns_supported():
        print("needs root, nft and nsenter", file=sys.stderr)
        return 2
    ip = service_ip(POOL)
    samples: dict[str, list[float]] = {}
    rates: dict[str, list[float]] = {}
    with served(Passwords, bearer="bench") as config, tempfile.TemporaryDirectory() as work, \
            proxy_world(POOL, (OPEN_SOCKS, OPEN_HTTP, BY_NAME, BY_NAME_SOCKS, OPEN_TLS, BY_NAME_TLS), secrets=config,
                        allow_private_upstream=True) as egress, \
            chained_dnat(POOL, (OPEN_SOCKS, OPEN_HTTP, OPEN_TLS), "aenvupbench"):
        ups = Upstreams(egress.ext_netns, Path(work), f"alice:{PASSWORD['c-socks']}", f"bob:{PASSWORD['c-http']}")
        bulk = None
        try:
            ups.start()
            bulk = subprocess.Popen(["ip", "netns", "exec", egress.ext_netns, "python3", "-c", BULK])
            socks_up = {"scheme": "socks5", "host": UPSTREAM, "port": SOCKS, "username": "alice",
                        "credential": "c-socks"}
            http_up = {"scheme": "http", "host": UPSTREAM, "port": HTTP_PROXY, "username": "bob",
                       "credential": "c-http"}
            egress.allow(OPEN_SOCKS, "b1", (), upstream=socks_up)
            egress.allow(OPEN_HTTP, "b2", (), upstream=http_up)
            egress.allow(BY_NAME, "b3", ("good.test",))
            egress.allow(BY_NAME_SOCKS, "b4", ("good.test",), upstream=socks_up, deny=("0.0.0.0/0",))
            over_tls = {**socks_up, "port": SOCKS_TLS, "tls": True, "tls_server_name": TLS_NAME, "tls_ca": ups.tls_ca}
            egress.allow(OPEN_TLS, "b5", (), upstream=over_tls)
            egress.allow(BY_NAME_TLS, "b6", ("good.test",), upstream=over_tls, deny=("0.0.0.0/0",))
            UPSTREAM_TLS.append(ssl.create_default_context(cadata=ups.tls_ca))
            time.sleep(1)
            ways = {"direct": lambda: one((EXT_A, 80)),
                    "upstream only": lambda: one((UPSTREAM, SOCKS), socks=True),
                    "by address socks5": lambda: one((EXT_A, 80), OPEN_SOCKS),
                    "by address http": lambda: one((EXT_A, 80), OPEN_HTTP),
                    "by name": lambda: one((ip, 80), BY_NAME),
                    "by name socks5": lambda: one((ip, 80), BY_NAME_SOCKS),
                    "https direct": lambda: one((EXT_A, 443), tls=True),
                    "https by name socks5": lambda: one((ip, 443), BY_NAME_SOCKS, tls=True),
                    "upstream only tls": lambda: one((UPSTREAM, SOCKS_TLS), socks=True),
                    "by address socks5 tls": lambda: one((EXT_A, 80), OPEN_TLS),
                    "by name socks5 tls": lambda: one((ip, 80), BY_NAME_TLS)}
            for name, call in ways.items():
                call()  # warm up (the password is asked once, then kept)
                samples[f"{name}_connection"] = [call() for _ in range(args.runs)]
            for name, source, socks in (("direct", None, False), ("upstream only", None, True),
                                        ("by address socks5", OPEN_SOCKS, False),
                                        ("by address socks5 tls", OPEN_TLS, False)):
                rates[name] = [throughput(source, socks) for _ in range(5)]
        finally:
            if bulk is not None:
                bulk.kill()
                bulk.wait(timeout=10)
            ups.stop()
    summary = {name: {"median_ms": round(statistics.median(v), 3), "p95_ms": round(percentile(v, 95), 3),
                      "n": len(v)} for name, v in samples.items()}
    print("| connection (connect + GET + close) | median ms | p95 ms | n |\n|---|---:|---:|---:|")
    for name, row in summary.items():
        print(f"| {name} | {row['median_ms']} | {row['p95_ms']} | {row['n']} |")
    mbps = {name: round(statistics.median(v), 1) for name, v in rates.items()}
    print("throughput (64 MiB, median of 5, MiB/s): " + ", ".join(f"{k} {v}" for k, v in mbps.items()))
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = ROOT / "bench" / "results" / f"egress_upstream-{stamp}.json"
    path.write_text(json.dumps({"host": platform.node(), "kernel": platform.release(), "runs": args.runs,
                                "summary": summary, "throughput_mib_s": mbps, "samples": samples,
                                "rates": rates}, indent=2))
    print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
