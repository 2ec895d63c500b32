"""A small offline "world" for network tests: an external host in a namespace of the test's
own, node services that must stay unreachable, and a probe run inside a guest.

Only loopback and namespaces made here are ever targets (the brief's rule). The external
host X is joined to the node by a veth: the node is NET.1, X answers HTTP on NET.10 and .20,
where NET is a /24 of 198.19.0.0/16 (RFC 2544's benchmarking range, always denied to guests, so
the test stacks reopen those two addresses and the egress policy alone decides). Each test run
takes its own /24 (``AENV_TEST_EXT_NET``, inherited by its workers and the stacks it starts),
because the external host routes NET in the root namespace: two runs on one machine sharing
one range reached each other's servers.
"""
from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field

# the run's /24: from the pytest controller's session number (tests/conftest.py), else this process
_NET = int(os.environ.setdefault(
    "AENV_TEST_EXT_NET", str(int(os.environ.get("AENV_TEST_NET_SESSION") or os.getpid()) % 250)))
NET = f"198.19.{_NET}"
NODE_SIDE = f"{NET}.1"
EXT_A = f"{NET}.10"
EXT_B = f"{NET}.20"


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


@dataclass
class ExternalHost:
    name: str = field(default_factory=lambda: f"aenvext{os.getpid() % 100000}")
    procs: list = field(default_factory=list)

    @property
    def veth(self) -> str:
        return f"aenvxh{os.getpid() % 100000}"

    def start(self) -> "ExternalHost":
        self.stop()
        _sh("ip", "netns", "add", self.name)
        _sh("ip", "link", "add", self.veth, "type", "veth", "peer", "name", "xpeer", "netns", self.name)
        _sh("ip", "addr", "add", f"{NODE_SIDE}/24", "dev", self.veth)
        _sh("ip", "link", "set", self.veth, "up")
        # replies from X come back in here and are forwarded to the slot that asked
        _sh("sysctl", "-q", "-w", f"net.ipv4.conf.{self.veth}.forwarding=1")
        for cmd in (["ip", "link", "set", "lo", "up"], ["ip", "addr", "add", f"{EXT_A}/24", "dev", "xpeer"],
                    ["ip", "addr", "add", f"{EXT_B}/24", "dev", "xpeer"], ["ip", "link", "set", "xpeer", "up"]):
            _sh("ip", "netns", "exec", self.name, *cmd)
        for address in (EXT_A, EXT_B):
            self.procs.append(subprocess.Popen(
                ["ip", "netns", "exec", self.name, "python3", "-m", "http.server", "--bind", address, "80"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/tmp"))
        deadline = time.monotonic() + 20
        for address in (EXT_A, EXT_B):
            while subprocess.run(["ip", "netns", "exec", self.name, "python3", "-c",
                                  f"import socket; socket.create_connection(('{address}', 80), 1)"],
                                 capture_output=True).returncode != 0:
                assert time.monotonic() < deadline, f"the external host's server on {address} did not start"
                time.sleep(0.1)
        return self

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait(timeout=10)
        self.procs = []
        subprocess.run(["ip", "link", "del", self.veth], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)


class NodeService:
    """A TCP listener on every address of the node (0.0.0.0): what a guest must never reach."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("0.0.0.0", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


def node_addresses() -> list[str]:
    """Every IPv4 address of the node (slot veths included), loopback aside: the guest's own
    127.0.0.1 is itself."""
    from pyroute2 import IPRoute  # noqa: PLC0415

    with IPRoute() as ipr:
        found = {a.get_attr("IFA_ADDRESS") for a in ipr.get_addr(family=2)}
    return sorted(a for a in found if a and not a.startswith("127."))


def dns_ask(server: str, name: str, *, tcp: bool = False, source: str | None = None,
            timeout: float = 3.0) -> tuple[str, int]:
    """One A query to ``server``:53 over UDP or TCP: (address, TTL) of the first answer."""
    import struct  # noqa: PLC0415

    qid = int.from_bytes(os.urandom(2), "big")
    labels = b"".join(bytes([len(p)]) + p.encode() for p in name.split("."))
    query = struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0) + labels + b"\0" + struct.pack(">HH", 1, 1)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM if tcp else socket.SOCK_DGRAM) as s:
        s.settimeout(timeout)
        if source:
            s.bind((source, 0))
        if tcp:
            s.connect((server, 53))
            s.sendall(struct.pack(">H", len(query)) + query)
            size = struct.unpack(">H", s.recv(2, socket.MSG_WAITALL))[0]
            reply = s.recv(size, socket.MSG_WAITALL)
        else:
            s.sendto(query, (server, 53))
            reply = s.recv(4096)
    assert struct.unpack(">H", reply[:2])[0] == qid and struct.unpack(">H", reply[6:8])[0] >= 1, reply
    ttl, length = struct.unpack(">IH", reply[-10:-4])
    assert length == 4, reply
    return socket.inet_ntoa(reply[-4:]), ttl


# Run in the guest: ``python3 -c PROBE DEADLINE ADDRESS:PORT...``. Every connection is started
# at once (non-blocking), then all are awaited together until one deadline: a denied connection
# is dropped, so it costs that deadline, once for all of them. It starts counting once every SYN
# is out: neither the interpreter's start nor the number of targets eats into it. Prints one
# "<address>:<port> open|closed" line per target.
PROBE = r"""
import errno, select, socket, sys, time
deadline = float(sys.argv[1])
verdict, pending, poller = {}, {}, select.poll()
for target in sys.argv[2:]:
    address, port = target.rsplit(":", 1)
    s = socket.socket()
    s.setblocking(False)
    code = s.connect_ex((address, int(port)))
    if code == 0:
        verdict[target] = "open"
    elif code in (errno.EINPROGRESS, errno.EAGAIN):
        pending[s.fileno()] = (target, s)
        poller.register(s, select.POLLOUT)
    else:
        verdict[target] = "closed"
end = time.monotonic() + deadline
while pending and (left := end - time.monotonic()) > 0:
    for fd, _ in poller.poll(left * 1000):
        target, s = pending.pop(fd)
        poller.unregister(fd)
        verdict[target] = "open" if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0 else "closed"
for target, _ in pending.values():
    verdict[target] = "closed"
for target in sys.argv[2:]:
    print(target, verdict[target])
"""
# A permitted connection is answered within milliseconds (a SYN-ACK from the node or the test
# world); a dropped one never. 3 s is the first SYN and its retransmission after 1 s.
PROBE_DEADLINE = 3.0


def probe(sandbox, targets: list[tuple[str, int]], deadline: float = PROBE_DEADLINE) -> dict[tuple[str, int], bool]:
    """From inside the guest: which of ``targets`` accept a TCP connection (all at once, one
    shared deadline: a round with targets that must stay closed costs it once)."""
    import shlex  # noqa: PLC0415

    targets = list(dict.fromkeys(targets))  # one connection each
    argv = " ".join(shlex.quote(f"{a}:{p}") for a, p in targets)
    out = sandbox.commands.run(f"python3 -c {shlex.quote(PROBE)} {deadline} {argv}", timeout=120).stdout
    result = {}
    for line in out.splitlines():
        where, _, verdict = line.partition(" ")
        address, _, port = where.rpartition(":")
        result[(address, int(port))] = verdict == "open"
    assert set(result) == set(targets), out
    return result
