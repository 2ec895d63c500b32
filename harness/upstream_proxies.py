"""Upstream proxies for network.egressProxy's tests and benchmark: a real SOCKS5 and a real
HTTP proxy (mitmproxy's own ``socks5`` and ``regular`` modes from .venv-egress, user and
password required, tunnels passed through unparsed) in the external host's namespace
(harness.networld, ``proxy_world``'s ``egress.ext_netns``) on an address of their own, with a
name table of their own (``/etc/netns/<netns>/hosts``, which ``ip netns exec`` mounts as
/etc/hosts): the upstream resolves good.test and evil.test itself, as a remote proxy would.
Each is also reached over TLS (``egressProxy.tls``) on a port of its own, through
harness/tls_front.py with a certificate for ``TLS_NAME`` from a CA of its own (``tls_ca``:
neither the system's nor the named hosts'). Only the test's own namespace is ever served."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from harness.named_hosts import make_cert
from harness.networld import EXT_A, EXT_B, NET
from vmm.net.dns import service_ip
from vmm.net.egress import DEFAULT_MITMDUMP
from vmm.net.slots import CHAIN_PORT

UPSTREAM = f"{NET}.30"  # the upstreams' address, in the external host's namespace
SOCKS, HTTP_PROXY = 1080, 3128
SOCKS_TLS, HTTP_PROXY_TLS = 1443, 3129  # the same proxies behind TLS
TLS_NAME = "proxy.test"  # the name on the TLS fronts' certificate (not the address)
FRONT = Path(__file__).with_name("tls_front.py")


@contextmanager
def chained_dnat(pool: str, clients: tuple[str, ...], table: str):
    """The node's ``chained`` DNAT (vmm.net.slots) for connections made on the node itself, in an
    nft table ``table`` of its own for the block: any TCP of ``clients`` ("slot addresses") to
    another address than ``pool``'s resolver goes to the proxy's relay (CHAIN_PORT), its
    destination kept for ``SO_ORIGINAL_DST``."""
    ip = service_ip(pool)
    try:
        subprocess.run(["nft", "-f", "-"], check=True, capture_output=True, text=True, timeout=30, input=f"""
table ip {table} {{
    chain out {{
        type nat hook output priority -100; policy accept;
        ip saddr {{ {", ".join(clients)} }} ip daddr != {{ {ip}, 127.0.0.0/8 }} meta l4proto tcp dnat ip to {ip}:{CHAIN_PORT}
    }}
}}
""")
        yield
    finally:
        subprocess.run(["nft", "delete", "table", "ip", table], capture_output=True, timeout=30)


def _in(netns: str, *argv: str) -> None:
    subprocess.run(["ip", "netns", "exec", netns, *argv], check=True, capture_output=True, timeout=30)


class Upstreams:
    """``socks`` on UPSTREAM:SOCKS and ``http`` on UPSTREAM:HTTP_PROXY, their logs in ``work``;
    ``socks-tls`` and ``http-tls`` (UPSTREAM:SOCKS_TLS, UPSTREAM:HTTP_PROXY_TLS) end TLS in front
    of them (their logs: a ``tunnel`` line per finished handshake); ``tls_ca``: the PEM their
    certificate chains to."""

    def __init__(self, netns: str, work: Path, socks_auth: str, http_auth: str):
        self.netns, self.work = netns, Path(work)
        self.auth = {"socks": socks_auth, "http": http_auth}
        self.procs: dict[str, subprocess.Popen] = {}
        self.etc = Path("/etc/netns") / netns
        self.tls_ca = ""

    def start(self) -> "Upstreams":
        _in(self.netns, "ip", "addr", "add", f"{UPSTREAM}/24", "dev", "xpeer")
        self.etc.mkdir(parents=True, exist_ok=True)
        (self.etc / "hosts").write_text(f"127.0.0.1 localhost\n{EXT_A} good.test\n{EXT_B} evil.test\n")
        tls = self.work / "tls"
        tls.mkdir(exist_ok=True)
        self.cert = make_cert(tls, [TLS_NAME])
        self.tls_ca = (tls / "hosts-ca.pem").read_text()
        for name in ("socks", "http", "socks-tls", "http-tls"):
            self.run(name)
        return self

    def run(self, name: str) -> None:
        if name.endswith("-tls"):
            port, backend = (SOCKS_TLS, SOCKS) if name == "socks-tls" else (HTTP_PROXY_TLS, HTTP_PROXY)
            argv = [sys.executable, str(FRONT), UPSTREAM, str(port), str(backend), *map(str, self.cert)]
        else:
            mode, port = (f"socks5@{UPSTREAM}:{SOCKS}", SOCKS) if name == "socks" else \
                (f"regular@{UPSTREAM}:{HTTP_PROXY}", HTTP_PROXY)
            argv = [str(DEFAULT_MITMDUMP), "--mode", mode, "--proxyauth", self.auth[name], "--ignore-hosts", ".*",
                    "--set", f"confdir={self.work / name}"]
        log = open(self.work / f"{name}.log", "ab")  # noqa: SIM115 - the process keeps it
        self.procs[name] = subprocess.Popen(["ip", "netns", "exec", self.netns, *argv], stdout=log, stderr=log,
                                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # its log is read as it runs
        deadline = time.monotonic() + 30
        while subprocess.run(["ip", "netns", "exec", self.netns, "python3", "-c",
                              f"import socket; socket.create_connection(('{UPSTREAM}', {port}), 1)"],
                             capture_output=True).returncode != 0:
            assert time.monotonic() < deadline, f"the {name} upstream did not start"
            time.sleep(0.2)

    def log(self, name: str) -> str:
        return (self.work / f"{name}.log").read_text(errors="replace")

    def seen(self, name: str, check, seconds: float = 10) -> bool:
        """Whether ``check(log)`` holds within ``seconds`` (mitmproxy logs a moment later)."""
        deadline = time.monotonic() + seconds
        while not check(self.log(name)):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def stop(self, name: str | None = None) -> None:
        for key in [name] if name else list(self.procs):
            proc = self.procs.pop(key, None)
            if proc is not None:
                proc.kill()
                proc.wait(timeout=10)
        if name is None:
            subprocess.run(["rm", "-rf", str(self.etc)], check=False)
