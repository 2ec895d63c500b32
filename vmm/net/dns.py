"""The node's resolver for its guests: a dnsmasq on an address of its own.

Why: a guest's resolv.conf says 8.8.8.8 (E2B's default); its slot DNATs port 53 of that to
this resolver, which forwards to the node's own resolvers. So DNS works offline and with a
loopback or private resolver (this machine's sits in 10/8, which guests may never reach),
and the egress policy still applies: denying 8.8.8.8 or everything denies DNS, as on E2B.
The address is the slot pool's base + 1, which no slot uses, so every aenv instance on a
host has its own; it sits on ``lo`` as a /32 (dummy interfaces need a module some kernels,
this one included, lack); guests reach it only through the DNAT (it is in every slot's deny
set, and the node's table lets slots reach nothing else of the node).
Extra names (tests, an internal mirror) go in files under ``hosts_dir`` (``/etc/hosts``
format), which dnsmasq re-reads when they change. dnsmasq outlives the worker like QEMU
does; a node start reuses it or starts it.
"""
from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from pyroute2 import IPRoute


class DNSError(Exception):
    """The node's resolver could not be started."""


def service_ip(pool: str) -> str:
    return str(ipaddress.ip_network(pool)[1])


def _on_lo(address: str, present: bool) -> None:
    with IPRoute() as ipr:
        lo = ipr.link_lookup(ifname="lo")[0]
        there = any(a.get_attr("IFA_ADDRESS") == address for a in ipr.get_addr(index=lo, family=2))
        if present and not there:
            ipr.addr("add", index=lo, address=address, prefixlen=32)
        elif there and not present:
            ipr.addr("del", index=lo, address=address, prefixlen=32)


def _alive(pidfile: Path) -> int | None:
    try:
        pid = int(pidfile.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    return pid if b"dnsmasq" in cmdline and str(pidfile).encode() in cmdline else None


class NodeDNS:
    """The resolver of one aenv instance (prefix, pool), its files under ``state_dir``."""

    def __init__(self, prefix: str, pool: str, state_dir: Path):
        self.prefix, self.ip = prefix, service_ip(pool)
        self.state_dir = Path(state_dir)
        self.pidfile = self.state_dir / "dnsmasq.pid"
        self.hosts_dir = self.state_dir / "hosts.d"

    def running(self) -> bool:
        return _alive(self.pidfile) is not None

    def ensure(self) -> None:
        """The service address on lo and a dnsmasq answering on it."""
        binary = shutil.which("dnsmasq") or "/usr/sbin/dnsmasq"
        if not Path(binary).exists():
            raise DNSError("dnsmasq not found (apt-get install dnsmasq-base)")
        _on_lo(self.ip, True)
        if self.running():
            return
        self.hosts_dir.mkdir(parents=True, exist_ok=True)
        argv = [binary, f"--pid-file={self.pidfile}", f"--listen-address={self.ip}", "--bind-interfaces",
                "--port=53", "--no-hosts", f"--hostsdir={self.hosts_dir}",
                "--resolv-file=/etc/resolv.conf", "--cache-size=1000", "--domain-needed",
                "--user=root", f"--log-facility={self.state_dir / 'dnsmasq.log'}"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise DNSError(f"dnsmasq failed: {done.stderr.strip() or done.returncode}")
        deadline = time.monotonic() + 5
        while not self.running():
            if time.monotonic() > deadline:
                raise DNSError("dnsmasq did not write its pid file")
            time.sleep(0.02)

    def stop(self) -> None:
        """Stops dnsmasq and removes its address (an instance going away for good)."""
        pid = _alive(self.pidfile)
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
            for _ in range(100):
                if _alive(self.pidfile) is None:
                    break
                time.sleep(0.02)
        self.pidfile.unlink(missing_ok=True)
        _on_lo(self.ip, False)
