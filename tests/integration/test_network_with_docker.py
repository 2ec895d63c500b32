"""A node on a host that also runs Docker (issue 23), with the real daemon running: Docker's
``filter`` table drops forwarded traffic by default (FORWARD policy DROP, its chains first),
and a drop in any base chain is final in nftables. The node keeps its slots' accepts in
DOCKER-USER (vmm.net.host_firewall), so a guest still reaches what its egress policy allows,
and still reaches nothing of the node, of its neighbours or of the private ranges — also after
they are taken out of Docker's chain (as a Docker restart after a firewall reload does).
"""
import shlex
import subprocess
import time

import pytest
from e2b import Sandbox

from vmm.net import host_firewall, slots

from harness.docker_daemon import DockerUnavailable, ensure_dockerd
from harness.networld import EXT_A, EXT_B, ExternalHost, NodeService, node_addresses, probe

pytestmark = [pytest.mark.vm,
              pytest.mark.skipif(not slots.netns_supported(), reason="needs root, nft and nsenter (netns backend)")]


def _iptables(*args: str) -> str:
    """The ``iptables`` Docker uses (Debian's alternative: iptables-nft or iptables-legacy)."""
    return subprocess.run(["iptables", "-w", "-t", "filter", *args], capture_output=True, text=True,
                          check=True).stdout


@pytest.fixture(scope="module")
def docker():
    """Docker's daemon running, with the FORWARD drop it sets on a host that booted with
    forwarding off (set here, as Docker would, if forwarding was already on when it started)."""
    try:
        ensure_dockerd()
    except DockerUnavailable as exc:
        pytest.skip(f"no Docker daemon: {exc}")
    policy = "DROP" if "-P FORWARD DROP" in _iptables("-S", "FORWARD") else "ACCEPT"
    _iptables("-P", "FORWARD", "DROP")
    assert "-N DOCKER-USER" in _iptables("-S"), "Docker made no DOCKER-USER chain"
    yield
    _iptables("-P", "FORWARD", policy)


@pytest.fixture(scope="module")
def world(stack, docker):
    """The external host (EXT_A and EXT_B) and a service on every node address."""
    ext = ExternalHost().start()
    service = NodeService()
    try:
        yield ext, service
    finally:
        service.close()
        ext.stop()


def _ours(prefix: str) -> list[str]:
    return [line for line in _iptables("-S", "DOCKER-USER").splitlines() if host_firewall.tag(prefix) in line]


def test_egress_and_isolation_with_docker_running(stack, sdk_env, world):
    ext, service = world
    box = Sandbox.create(timeout=600, network={"allow_out": [EXT_A], "deny_out": ["0.0.0.0/0"]})
    neighbour = Sandbox.create(timeout=600)
    try:
        neighbour.commands.run("cd /tmp && python3 -m http.server 8080 >/dev/null 2>&1", background=True)
        near = stack.db("from sandboxes.models import Sandbox; "
                        f"print(Sandbox.objects.get(pk='{neighbour.sandbox_id}').envd_host)").strip().splitlines()[-1]
        forbidden = [(address, port) for address in node_addresses()  # docker0's 172.17.0.1 among them
                     for port in (service.port, 6379, 22)]
        forbidden += [(near, 49983), (near, 8080), ("172.17.0.2", 80), ("10.0.2.2", 6379), ("169.254.169.254", 80)]
        before = service.accepted
        reached = probe(box, [(EXT_A, 80), (EXT_B, 80), *forbidden])
        assert reached.pop((EXT_A, 80)), "the allowed host is unreachable: Docker's FORWARD drop wins"
        assert not reached.pop((EXT_B, 80)), "the egress policy does not hold next to Docker"
        assert [t for t, ok in reached.items() if ok] == []
        assert service.accepted == before
        # the node's accepts are in Docker's user chain, once
        assert len(_ours(stack.net_prefix)) == 2, _iptables("-S", "DOCKER-USER")
        # the neighbour's egress (open policy) works too
        assert probe(neighbour, [(EXT_B, 80)]) == {(EXT_B, 80): True}

        # the accepts gone from Docker's chain (a restart after a firewall reload recreates it
        # empty; only ours are taken out here, the host's other rules stay): put back, once
        for line in _ours(stack.net_prefix):
            _iptables("-D", *shlex.split(line)[1:])
        deadline = time.monotonic() + 3 * host_firewall.RECHECK
        while len(_ours(stack.net_prefix)) != 2:
            assert time.monotonic() < deadline, "the node did not put its accepts back into DOCKER-USER"
            time.sleep(0.5)
        time.sleep(2 * host_firewall.RECHECK)  # a few more checks: still once
        assert len(_ours(stack.net_prefix)) == 2, _iptables("-S", "DOCKER-USER")
        assert probe(box, [(EXT_A, 80), (EXT_B, 80)]) == {(EXT_A, 80): True, (EXT_B, 80): False}
    finally:
        for s in (box, neighbour):
            try:
                s.kill()
            except Exception:  # noqa: BLE001 - best effort cleanup
                pass


def test_a_stopped_node_takes_its_accepts_out_and_a_started_one_puts_them_back(stack, sdk_env, world):
    """The node's stop (SIGTERM: its running sandboxes are paused to disk, so no slot is in
    use) removes the accepts from Docker's chain; its next start writes them again."""
    assert len(_ours(stack.net_prefix)) == 2
    stack.stop("node", timeout=120)
    assert _ours(stack.net_prefix) == [], stack.log("node")
    stack.start_node()
    assert len(_ours(stack.net_prefix)) == 2
    box = Sandbox.create(timeout=600)
    try:
        assert probe(box, [(EXT_A, 80)]) == {(EXT_A, 80): True}
    finally:
        box.kill()
