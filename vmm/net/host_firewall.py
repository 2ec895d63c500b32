"""The node's accepts in the host's iptables FORWARD path, for hosts whose firewall drops
forwarded traffic by default: above all Docker's.

Why: Docker sets the ``filter`` table's FORWARD policy to DROP. In nftables every base chain
on the forward hook sees a packet and a drop in any of them is final, so the accept of the
node's own table (vmm.net.host_table) does not get a sandbox's packet past Docker's chain:
guests lose their egress. The node therefore inserts two accepts, tagged with a comment
``aenv-<prefix>``: from its slot veths with a pool source, and to them with a pool
destination. They go into DOCKER-USER (the chain Docker documents for user rules and does
not flush) or, with no Docker, at the head of a FORWARD chain whose policy is DROP. They
open nothing: the node's table runs first (priority -10) and its drops (guest to node,
guest to guest, new flows into a slot) stay final; each slot's own table still denies the
private ranges and the node's addresses.

Both iptables backends are looked at: Docker uses whichever the ``iptables`` alternative
named when it started (iptables-nft: nftables' ``ip filter`` table; iptables-legacy: only
where the kernel has its filter table, so looking never creates one). Docker recreates its
chains when it restarts and a firewall reload drops ours, so ``ensure`` runs at node start,
for each slot made and periodically (vmm.net.slot_pool); it changes nothing that is already
right and never adds a rule twice. ``remove`` takes them out (node stop, instance removal).
"""
from __future__ import annotations

import ipaddress
import shlex
import shutil
import subprocess
import threading
from pathlib import Path

RECHECK = 10.0  # seconds between checks while the node runs (a Docker restart's gap at most)
LEGACY_TABLES = Path("/proc/net/ip_tables_names")  # the legacy tables this netns has
DOCKER_CHAIN = "DOCKER-USER"

_lock = threading.Lock()  # one check at a time in this process (slot setup and the refill thread)


class HostFirewallError(Exception):
    """iptables refused to list or change the filter table."""


def tag(prefix: str) -> str:
    return f"aenv-{prefix}"


def rules(prefix: str, pool: str) -> list[list[str]]:
    """The accepts (iptables match arguments): the slots' forwarded traffic, both ways."""
    net = str(ipaddress.ip_network(pool))
    veths = f"{prefix}v+"  # every host veth of this instance (vmm.net.slots: <prefix>v<N>)
    comment = ["-m", "comment", "--comment", tag(prefix)]
    return [["-i", veths, "-s", net, *comment, "-j", "ACCEPT"],
            ["-o", veths, "-d", net, *comment, "-j", "ACCEPT"]]


def backends() -> list[str]:
    """The iptables tools whose filter table may hold a FORWARD drop here."""
    found = []
    if shutil.which("iptables-nft"):
        found.append("iptables-nft")
    try:
        legacy = "filter" in LEGACY_TABLES.read_text().split()
    except OSError:
        legacy = False
    if legacy and shutil.which("iptables-legacy"):
        found.append("iptables-legacy")
    return found


def _run(tool: str, *args: str) -> str:
    try:
        done = subprocess.run([tool, "-w", "-t", "filter", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise HostFirewallError(f"{tool}: {exc}") from None
    if done.returncode != 0:
        raise HostFirewallError(f"{tool} {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def _pairs(args: list[str]) -> frozenset:
    """A rule's arguments as a set of (option, value): how iptables orders them does not matter."""
    return frozenset(zip(args[::2], args[1::2]))


def _state(tool: str, prefix: str) -> tuple[str | None, list[list[str]]]:
    """(the chain our accepts belong in, or None; our rules now, as ``-A <chain> ...`` argv)."""
    listed = _run(tool, "-S").splitlines()
    if any(line.startswith("#") and "incompatible" in line for line in listed):
        raise HostFirewallError(f"{tool}: the filter table is nftables' own, not iptables' (accept the slot pool "
                                "in its forward chain yourself)")
    try:
        lines = [shlex.split(line) for line in listed if line.strip() and not line.startswith("#")]
    except ValueError as exc:
        raise HostFirewallError(f"{tool} -S: {exc}") from None
    chains = {line[1] for line in lines if line[:1] == ["-N"]}
    forward_drop = ["-P", "FORWARD", "DROP"] in lines
    target = DOCKER_CHAIN if DOCKER_CHAIN in chains else "FORWARD" if forward_drop else None
    ours = [line for line in lines if line[:1] == ["-A"] and ("--comment", tag(prefix)) in _pairs(line[2:])]
    return target, ours


def ensure(prefix: str, pool: str) -> dict[str, str | None]:
    """Puts the accepts where each backend's FORWARD path needs them, once; removes ours from
    anywhere else (a chain Docker no longer has, a policy no longer DROP). Returns
    {tool: the chain they are in, or None}."""
    wanted = rules(prefix, pool)
    where: dict[str, str | None] = {}
    errors = []
    with _lock:
        for tool in backends():
            try:
                target, ours = _state(tool, prefix)
                right = (target is not None and len(ours) == len(wanted)
                         and all(line[1] == target for line in ours)
                         and {_pairs(line[2:]) for line in ours} == {_pairs(rule) for rule in wanted})
                if not right:
                    for line in ours:
                        _run(tool, "-D", *line[1:])
                    for rule in reversed(wanted) if target else ():
                        _run(tool, "-I", target, "1", *rule)
                where[tool] = target
            except HostFirewallError as exc:  # the other backend is still put right
                errors.append(str(exc))
    if errors:
        raise HostFirewallError("; ".join(errors))
    return where


def remove(prefix: str) -> int:
    """Takes this instance's accepts out of every backend; how many were there."""
    removed = 0
    with _lock:
        for tool in backends():
            for line in _state(tool, prefix)[1]:
                _run(tool, "-D", *line[1:])
                removed += 1
    return removed
