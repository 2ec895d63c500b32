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
format, world-readable), which dnsmasq re-reads when they change. dnsmasq outlives the
worker like QEMU does; a node start reuses it when its command line is the one wanted, else
replaces it.

Every guest shares this one resolver, so (issue 21): it runs as an unprivileged user (it
binds port 53 as root, then drops to ``dnsmasq`` or ``nobody``); it keeps no cache, so no
guest can tell from an answer's TTL or speed which names another guest looked up (the cost,
measured: a lookup takes ~0.8 ms instead of ~0.05 ms from a cache, the node's resolver being
one hop away); it may forward ``DNSLimits.forward_max`` queries at once (dnsmasq's default,
150, is a few guests' worth);
each slot's own table limits its guest's query rate and TCP connections (vmm.net.slots), so
one guest cannot take all of the resolver (dnsmasq serves at most 20 TCP connections at once:
a compile-time limit). The unprivileged user could not reach ``hosts_dir`` under a private
home (a 0700 parent), so dnsmasq runs in a mount namespace of its own where ``hosts_dir`` is
bind-mounted at ``RUNTIME/<prefix>``: the files stay where operators put them, and the
mount goes away with dnsmasq. That namespace keeps none of the node's other mounts
(``vmm.net.mount_scope``), so a volume the node unmounts is not held by the resolver.
"""
from __future__ import annotations

import grp
import ipaddress
import os
import pwd
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

MOUNT_SCOPE = Path(__file__).with_name("mount_scope.py")  # run as a script inside the namespace
RUNTIME = Path("/run/aenv-dns")  # mount points of the instances' hosts dirs (see the docstring)
LIMIT_MAX = 1_000_000  # above any sane value: a typo, not a setting
USERS = ("dnsmasq", "nobody")  # the first that exists runs the resolver (Debian's dnsmasq-base makes the first)


class DNSError(Exception):
    """The node's resolver could not be started."""


@dataclass(frozen=True)
class DNSLimits:
    """What one guest may take of the node's resolver (``rate``/``burst``: DNS packets per
    second to 8.8.8.8:53, UDP and TCP; ``tcp``: TCP connections to it at once; enforced in
    the guest's slot) and how many queries the resolver forwards at once for all guests."""

    rate: int = 200
    burst: int = 400
    tcp: int = 4
    forward_max: int = 4096

    def __post_init__(self):
        for name, value in (("AENV_NET_DNS_RATE", self.rate), ("AENV_NET_DNS_BURST", self.burst),
                            ("AENV_NET_DNS_TCP_CONNECTIONS", self.tcp),
                            ("AENV_NET_DNS_FORWARD_MAX", self.forward_max)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= LIMIT_MAX:
                raise ValueError(f"{name}={value!r}: a whole number from 1 to {LIMIT_MAX}")


def service_ip(pool: str) -> str:
    return str(ipaddress.ip_network(pool)[1])


def run_as() -> pwd.struct_passwd:
    """The unprivileged user dnsmasq drops to."""
    for name in USERS:
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise DNSError(f"none of the users {', '.join(USERS)} exists to run dnsmasq as (apt-get install dnsmasq-base)")


def _on_lo(address: str, present: bool) -> None:
    from pyroute2 import IPRoute  # noqa: PLC0415 - settings import DNSLimits; pyroute2 only here

    with IPRoute() as ipr:
        lo = ipr.link_lookup(ifname="lo")[0]
        there = any(a.get_attr("IFA_ADDRESS") == address for a in ipr.get_addr(index=lo, family=2))
        if present and not there:
            ipr.addr("add", index=lo, address=address, prefixlen=32)
        elif there and not present:
            ipr.addr("del", index=lo, address=address, prefixlen=32)


def _cmdline(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.decode(errors="replace").split("\0")[:-1]


def _alive(pidfile: Path) -> int | None:
    try:
        pid = int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return None
    argv = _cmdline(pid)
    return pid if argv and "dnsmasq" in argv[0] and f"--pid-file={pidfile}" in argv else None


def _exited(pid: int) -> bool:
    """Gone or a zombie (an exiting process loses its command line before its sockets)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


class NodeDNS:
    """The resolver of one aenv instance (prefix, pool), its files under ``state_dir``."""

    def __init__(self, prefix: str, pool: str, state_dir: Path, limits: DNSLimits = DNSLimits(),
                 resolv_file: str = "/etc/resolv.conf"):
        self.prefix, self.ip = prefix, service_ip(pool)
        self.state_dir = Path(state_dir)
        self.pidfile = self.state_dir / "dnsmasq.pid"
        self.hosts_dir = self.state_dir / "hosts.d"
        self.mount_point = RUNTIME / prefix  # where dnsmasq sees hosts_dir
        self.limits, self.resolv_file = limits, resolv_file

    def pid(self) -> int | None:
        return _alive(self.pidfile)

    def running(self) -> bool:
        return self.pid() is not None

    def argv(self, binary: str = "/usr/sbin/dnsmasq") -> list[str]:
        """dnsmasq's own command line (what a running one is compared with)."""
        user = run_as()
        return [binary, f"--pid-file={self.pidfile}", f"--listen-address={self.ip}", "--bind-interfaces",
                "--port=53", "--no-hosts", f"--hostsdir={self.mount_point}", f"--resolv-file={self.resolv_file}",
                "--cache-size=0", f"--dns-forward-max={self.limits.forward_max}", "--domain-needed",
                f"--user={user.pw_name}", f"--group={grp.getgrgid(user.pw_gid).gr_name}",
                f"--log-facility={self.state_dir / 'dnsmasq.log'}"]

    def ensure(self) -> None:
        """The service address on lo and a dnsmasq answering on it, started with ``argv``."""
        binary = shutil.which("dnsmasq") or "/usr/sbin/dnsmasq"
        if not Path(binary).exists():
            raise DNSError("dnsmasq not found (apt-get install dnsmasq-base)")
        _on_lo(self.ip, True)
        argv = self.argv(binary)
        pid = self.pid()
        if pid is not None:
            if _cmdline(pid) == argv:
                return
            self.stop(keep_address=True)  # an older or differently configured one (e.g. root's)
        self.hosts_dir.mkdir(parents=True, exist_ok=True)
        self.hosts_dir.chmod(0o755)  # dnsmasq reads it as its own user
        self.mount_point.mkdir(parents=True, exist_ok=True)
        # a mount namespace of dnsmasq's own, where hosts_dir is also at mount_point and no
        # other mount of the node is held (mount_scope: a volume unmounted later must go)
        needs = [self.state_dir, self.resolv_file, binary, "/etc", "/usr", "/lib", "/lib64", "/bin", "/sbin"]
        wrapper = ["unshare", "--mount", "--propagation", "private", "--", sys.executable, "-I", str(MOUNT_SCOPE),
                   "--bind", str(self.hosts_dir), str(self.mount_point),
                   *(arg for path in needs for arg in ("--need", str(path))), "--", *argv]
        done = subprocess.run(wrapper, capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise DNSError(f"dnsmasq failed: {done.stderr.strip() or done.returncode}")
        deadline = time.monotonic() + 5
        while not self.running():
            if time.monotonic() > deadline:
                raise DNSError("dnsmasq did not write its pid file")
            time.sleep(0.02)

    def stop(self, keep_address: bool = False) -> None:
        """Stops dnsmasq and (unless ``keep_address``: a restart) removes its address and
        mount point (an instance going away for good)."""
        pid = self.pid()
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
            for _ in range(250):
                if _exited(pid):  # its sockets closed: port 53 is free for the next one
                    break
                time.sleep(0.02)
        self.pidfile.unlink(missing_ok=True)
        if not keep_address:
            _on_lo(self.ip, False)
            try:
                self.mount_point.rmdir()
            except OSError:
                pass  # gone already, or (never) in use

