"""A network namespace of the caller's, joined to the root namespace by a veth pair, with
its traffic optionally limited to a rate in both directions (``tc`` token bucket filters):
where a test store (``harness.moto_s3``) runs when a benchmark needs the store behind a
link of known bandwidth, e.g. the 1 Gbit/s the seed recommends between nodes and store.

Why a namespace and tbf on each veth end: on loopback nothing can be shaped without
shaping the whole machine. A veth pair's two ends each have their own egress queue, so a
tbf at the root end limits what goes to the namespace (uploads to the store) and one at
the namespace's end what comes back (downloads); no ifb redirect is needed. Only the
namespace and the two links made here are touched, with the addresses of a /30 the caller
owns (.1 in the root namespace, .2 inside).
"""
from __future__ import annotations

import ipaddress
import os
import re
import subprocess
from dataclasses import dataclass, field

RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]?)(bit|bps)?\s*$", re.IGNORECASE)
UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}
INSIDE = "peer0"  # the namespace's end of the pair


def parse_rate(text: str) -> int:
    """``1gbit`` / ``500mbit`` / ``800k`` / ``100mbps`` (bytes/s, as tc reads it) → bits per second."""
    m = RATE.match(text or "")
    if not m:
        raise ValueError(f"a rate is a number with k/m/g and bit or bps (1gbit, 500mbit): {text!r}")
    bits = float(m.group(1)) * UNITS[m.group(2).lower()] * (8 if (m.group(3) or "").lower() == "bps" else 1)
    if bits < 8000:
        raise ValueError(f"rate {text!r} is below 8 kbit/s")
    return int(bits)


def tbf(dev: str, bits_per_s: int) -> list[str]:
    """The tc command that limits ``dev``'s egress to ``bits_per_s``: a token bucket whose burst
    is 2 ms at that rate but at least 128 KiB (a veth hands over GSO packets of up to 64 KiB;
    tbf splits larger ones), queueing at most 50 ms before it drops."""
    burst = max(bits_per_s // 8 // 500, 128 * 1024)
    return ["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{bits_per_s}bit",
            "burst", str(burst), "latency", "50ms"]


@dataclass
class ShapedLink:
    """``name``: the namespace (also the root end's link name, so at most 15 characters);
    ``cidr``: a /30 of the caller's; ``rate``: e.g. ``1gbit``, or None for no limit."""

    cidr: str
    rate: str | None = None
    name: str = field(default_factory=lambda: f"aenvst{os.getpid() % 100000}")
    started: bool = False

    def __post_init__(self):
        net = ipaddress.ip_network(self.cidr)
        if net.version != 4 or net.prefixlen != 30:
            raise ValueError(f"the link needs an IPv4 /30 of the caller's, not {self.cidr}")
        if len(self.name) > 15 or not re.fullmatch(r"[a-z0-9]+", self.name):
            raise ValueError(f"link name {self.name!r}: at most 15 lowercase letters and digits")
        hosts = list(net.hosts())
        self.host_ip, self.inside_ip, self.prefixlen = str(hosts[0]), str(hosts[1]), net.prefixlen
        self.bits_per_s = parse_rate(self.rate) if self.rate else None

    def inside(self, *argv: str) -> list[str]:
        """``argv`` run in the namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def commands(self) -> list[list[str]]:
        """Every command ``start`` runs, in order (pure: the unit test reads them)."""
        cmds = [["ip", "netns", "add", self.name],
                ["ip", "link", "add", self.name, "type", "veth", "peer", "name", INSIDE, "netns", self.name],
                ["ip", "addr", "add", f"{self.host_ip}/{self.prefixlen}", "dev", self.name],
                ["ip", "link", "set", self.name, "up"],
                self.inside("ip", "link", "set", "lo", "up"),
                self.inside("ip", "addr", "add", f"{self.inside_ip}/{self.prefixlen}", "dev", INSIDE),
                self.inside("ip", "link", "set", INSIDE, "up")]
        if self.bits_per_s:
            cmds += [tbf(self.name, self.bits_per_s), self.inside(*tbf(INSIDE, self.bits_per_s))]
        return cmds

    def start(self) -> "ShapedLink":
        self.stop()  # what a crashed run of the same process id left
        self.started = True
        for argv in self.commands():
            done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
            if done.returncode != 0:
                self.stop()
                raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
        return self

    def qdiscs(self) -> str:
        """What tc reports for both ends (sent bytes, drops, overlimits): for the record."""
        out = []
        for argv in (["tc", "-s", "qdisc", "show", "dev", self.name], self.inside("tc", "-s", "qdisc", "show", "dev",
                                                                                  INSIDE)):
            out.append(subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout.strip())
        return "\n".join(out)

    def stop(self) -> None:
        """The root end and the namespace (its end goes with it); nothing else."""
        subprocess.run(["ip", "link", "del", self.name], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=30)
        self.started = False
