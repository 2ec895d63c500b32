"""Sandbox networking end to end with real VMs, real namespaces and the official SDK (issue 10):
a guest reaches nothing of the node and no other sandbox — fresh, restored from a snapshot
and forked — while the node reaches the guest and the egress policy decides what else it
reaches (an external host in a namespace of the test's own), live and across pause and fork.
"""
import ipaddress
import json
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from e2b import Sandbox

from vmm.net import slots

from harness.networld import EXT_A, EXT_B, NODE_SIDE, ExternalHost, NodeService, dns_ask, node_addresses, probe
from harness.stack import ROOT

pytestmark = [pytest.mark.vm,
              pytest.mark.skipif(not slots.netns_supported(), reason="needs root, nft and nsenter (netns backend)")]


@pytest.fixture(scope="module")
def world(stack):
    """The external host X and a service listening on every node address."""
    ext = ExternalHost().start()
    service = NodeService()
    # names the node's resolver answers (hostsdir: dnsmasq picks the file up by itself)
    hosts = stack.home / "net" / "hosts.d"
    hosts.mkdir(parents=True, exist_ok=True)
    (hosts / "test-world").write_text(f"{EXT_A} ext-a.test\n{EXT_B} ext-b.test\n")
    try:
        yield ext, service
    finally:
        service.close()
        ext.stop()


def _route(stack, sandbox_id: str) -> str:
    """The sandbox's slot address (where the node reaches it)."""
    out = stack.db("from sandboxes.models import Sandbox; "
                   f"print(Sandbox.objects.get(pk='{sandbox_id}').envd_host)")
    return out.strip().splitlines()[-1]


def _forbidden(stack, service: NodeService, neighbours: list[str]) -> list[tuple[str, int]]:
    """Everything a guest must not reach: the test's service, Redis, PostgreSQL, the API and
    the data plane on every node address; slirp's old host alias; metadata; the slot's
    gateway; the resolver other than through 8.8.8.8; every neighbour's envd and user port."""
    api_port = int(stack.api_url.rsplit(":", 1)[1])
    data_port = int(stack.sandbox_url.rsplit(":", 1)[1])
    targets = []
    for address in [*node_addresses(), "10.0.2.2"]:
        for port in (service.port, 6379, 5432, api_port, data_port, 53, 22):
            targets.append((address, port))
    targets += [("169.254.169.254", 80), ("169.254.0.22", service.port), ("169.254.0.22", 53)]
    for address in neighbours:
        targets += [(address, 49983), (address, 8080)]
    return targets


def _at_once(*calls):
    """The calls' results, the calls run at once (each waits on its guest or the node, not
    the test's CPU): a denied probe waits out its timeout, so guests probed together cost
    one timeout, not one each."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def _create(*options: dict) -> list[Sandbox]:
    """One sandbox per ``options`` (Sandbox.create's keywords), created at once; if one
    create fails, the others are killed before the error is raised."""
    with ThreadPoolExecutor(len(options)) as pool:
        futures = [pool.submit(Sandbox.create, timeout=600, **o) for o in options]
    made = [f.result() for f in futures if f.exception() is None]
    if len(made) < len(options):
        for s in made:
            s.kill()
        next(f.result() for f in futures if f.exception() is not None)  # raises the first error
    return made


def _assert_isolated(stack, service: NodeService, guests: list[tuple[Sandbox, list[str]]]) -> None:
    """Each guest (with its neighbours' addresses) reaches none of its forbidden targets;
    all guests probed at once."""
    before = service.accepted
    results = _at_once(*[lambda g=g, n=n: probe(g, _forbidden(stack, service, n) + [(EXT_A, 80)])
                         for g, n in guests])
    for (guest, _), reached in zip(guests, results):
        # the probe works: the external host (allowed by default) answers from the same guest
        assert reached.pop((EXT_A, 80)), f"{guest.sandbox_id} cannot reach the external test host: the probe proves nothing"
        assert [t for t, ok in reached.items() if ok] == [], guest.sandbox_id
    assert service.accepted == before


def test_guests_reach_nothing_of_the_node_nor_each_other(stack, sdk_env, world):
    ext, service = world
    a, b = _create({}, {})
    try:
        b.commands.run("cd /tmp && python3 -m http.server 8080 >/dev/null 2>&1", background=True)
        info = a.commands.run("ip -4 -o addr show eth0; cat /etc/resolv.conf").stdout
        assert "169.254.0.21/30" in info and "nameserver 8.8.8.8" in info
        addr_a, addr_b = _route(stack, a.sandbox_id), _route(stack, b.sandbox_id)
        assert addr_a != addr_b and ipaddress.ip_address(addr_a) in ipaddress.ip_network(stack.net_pool)
        # the node (and only the node) opens connections into a guest: B's server answers it
        deadline = time.monotonic() + 30
        import httpx
        while True:
            try:
                assert httpx.get(f"http://{addr_b}:8080/", timeout=3).status_code == 200
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "the node cannot reach B's port 8080"
                time.sleep(0.5)
        _assert_isolated(stack, service, [(a, [addr_b])])
        # DNS through the node's resolver: a name it serves, and only via 8.8.8.8
        assert EXT_A in a.commands.run("getent hosts ext-a.test").stdout
    finally:
        a.kill()
        b.kill()


def test_restored_and_forked_guests_are_isolated_too(stack, sdk_env, world):
    ext, service = world
    parent = Sandbox.create(timeout=600)
    made = []
    snapshot = None
    try:
        parent.commands.run("cd /tmp && python3 -m http.server 8080 >/dev/null 2>&1", background=True)
        snapshot = parent.create_snapshot()
        restored = Sandbox.create(snapshot.snapshot_id, timeout=600)
        made.append(restored)
        children = [c for c in parent.fork(count=2, timeout=300) if not isinstance(c, Exception)]
        made += children
        assert len(children) == 2
        addresses = {s.sandbox_id: _route(stack, s.sandbox_id) for s in [parent, *made]}
        assert len(set(addresses.values())) == 4, addresses  # each its own slot
        for guest in made:
            assert "169.254.0.21/30" in guest.commands.run("ip -4 -o addr show eth0").stdout
        _assert_isolated(stack, service, [
            (guest, [a for sid, a in addresses.items() if sid != guest.sandbox_id]) for guest in made])
    finally:
        for s in [*made, parent]:
            try:
                s.kill()
            except Exception:  # noqa: BLE001 - best effort cleanup
                pass
        if snapshot is not None:  # later tests count the store's snapshots
            Sandbox.delete_snapshot(snapshot.snapshot_id)


def _reach(sandbox) -> tuple[bool, bool]:
    r = probe(sandbox, [(EXT_A, 80), (EXT_B, 80)])
    return r[(EXT_A, 80)], r[(EXT_B, 80)]


def _ts_update(stack, sandbox_id: str, step: str, address: str) -> dict:
    """tests/ts/net/update_network.mjs: the npm SDK's updateNetwork on a running sandbox (no new
    one); what getInfo showed after it."""
    setup = subprocess.run([str(ROOT / "scripts" / "setup_ts_sdk.sh")], capture_output=True, text=True, timeout=600)
    assert setup.returncode == 0, setup.stdout + setup.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update(E2B_API_URL=stack.api_url, E2B_SANDBOX_URL=stack.sandbox_url, E2B_API_KEY=stack.api_key)
    out = subprocess.run(["node", str(ROOT / "tests" / "ts" / "net" / "update_network.mjs"), sandbox_id, step, address],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_egress_policy_as_e2b_defines_it(stack, sdk_env, world):
    boxes = []
    try:
        # four policies given at create, the four guests made and probed at once
        boxes += _create(dict(allow_internet_access=False),
                         dict(network={"deny_out": [f"{EXT_B}/32"]}),
                         dict(network={"allow_out": [EXT_B], "deny_out": ["0.0.0.0/0"]}),
                         # always-denied ranges stay denied even when allowOut names them
                         dict(network={"allow_out": ["10.0.0.0/8", NODE_SIDE]}))
        closed, deny_b, only_b, private = boxes
        gateway = _route(stack, private.sandbox_id)
        reached = _at_once(
            lambda: _reach(closed),
            # DNS is egress too: denied with everything else (as on E2B). The node's resolver
            # answers within milliseconds: one try of 3 s (RES_OPTIONS), not glibc's 2 x 5 s
            lambda: closed.commands.run("RES_OPTIONS='timeout:3 attempts:1' getent hosts ext-a.test || echo no-answer",
                                        timeout=90).stdout,
            lambda: _reach(deny_b),
            lambda: _reach(only_b),
            lambda: probe(private, [(gateway, 22), ("10.0.2.2", 6379), (EXT_A, 80)]))
        assert reached[0] == (False, False)
        assert reached[1].strip() == "no-answer"
        assert reached[2] == (True, False)
        assert reached[3] == (False, True)  # allow wins over deny
        assert reached[4] == {(gateway, 22): False, ("10.0.2.2", 6379): False, (EXT_A, 80): True}

        # live updates replace the whole policy; {} opens it again
        only_b.update_network({"deny_out": [EXT_A]})
        assert _reach(only_b) == (False, True)
        only_b.update_network({})
        assert _reach(only_b) == (True, True)
        # the TypeScript SDK's updateNetwork, on the same guest: the instance call with a
        # selector callback, then the class call with allowInternetAccess
        assert _ts_update(stack, only_b.sandbox_id, "allow-only", EXT_A)["network"] == {
            "allowOut": [EXT_A], "denyOut": ["0.0.0.0/0"]}
        assert _reach(only_b) == (True, False)
        assert _ts_update(stack, only_b.sandbox_id, "closed", EXT_A)["allowInternetAccess"] is False
        assert _reach(only_b) == (False, False)
        only_b.update_network({"deny_out": ["0.0.0.0/0"]})
        assert _reach(only_b) == (False, False)

        # the policy survives a pause (a new slot on resume) and is inherited by forks
        only_b.pause()
        again = Sandbox.connect(only_b.sandbox_id, timeout=600)
        child = [c for c in again.fork(count=1, timeout=300) if not isinstance(c, Exception)]
        boxes += child
        assert len(child) == 1
        assert _at_once(lambda: _reach(again), lambda: _reach(child[0])) == [(False, False), (False, False)]
    finally:
        for s in boxes:
            try:
                s.kill()
            except Exception:  # noqa: BLE001
                pass


def test_old_sdk_generation_network_options(stack, world):
    """SDK 2.45.1 (v1 create) sends the same network fields; they are enforced the same way."""
    import json
    import os
    import subprocess
    from pathlib import Path

    python = os.environ.get("AENV_OLD_SDK_PYTHON")
    if not python:
        pytest.skip("AENV_OLD_SDK_PYTHON not set: scripts/test.sh installs e2b==2.45.1 and sets it")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("E2B_")},
           "E2B_API_URL": stack.api_url, "E2B_SANDBOX_URL": stack.sandbox_url, "E2B_API_KEY": stack.api_key}
    out = subprocess.run([python, str(Path(__file__).with_name("old_sdk_network_flow.py")), EXT_A, EXT_B],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["version"] == "2.45.1"
    assert result["closed"] == [False, False]
    assert result["opened"] == [True, True]
    assert result["deny_b"] == [True, False]
    assert result["host"].startswith("8080-")


HOLD = r"""
import socket, sys, time
held, out = [], []
for _ in range(int(sys.argv[3])):
    s = socket.socket(); s.settimeout(5); t = time.monotonic()
    try:
        s.connect((sys.argv[1], int(sys.argv[2]))); held.append(s); out.append("ok")
    except OSError as e:
        out.append(f"{e.errno}:{time.monotonic() - t:.2f}")
print(" ".join(out), flush=True)
time.sleep(600)
"""


def _node_entries(address: str) -> list[str]:
    """The node's conntrack entries whose original source is ``address`` (a slot: its guest's flows)."""
    with open("/proc/net/nf_conntrack") as f:
        return [line for line in f if line.split("src=")[1].split()[0] == address]


def test_a_guest_at_its_conntrack_limit_is_refused_and_starves_no_one(stack, sdk_env, world):
    """A hostile guest holds all the connections it may (the limit lowered to 50 on its fresh
    slot, as AENV_NET_CT_MAX_PER_SANDBOX=50 would): its next connect and its DNS are refused at
    once; the node's table holds no more than 50 of its flows, for hours not days; the node
    still opens connections into it, more than 50; once its sandbox is gone its flows are
    out of the node's table."""
    from vmm.net.conntrack import GuestLimits

    box = Sandbox.create(timeout=600)
    try:
        address = _route(stack, box.sandbox_id)
        index = (int(ipaddress.ip_address(address)) - int(ipaddress.ip_network(stack.net_pool).network_address)) // 2
        slot = slots.Slot(stack.net_prefix, index, stack.net_pool)
        assert slot.address == address
        slots.apply_limits(slot, GuestLimits(max_flows=50, new_rate=1000, new_burst=1000))
        box.files.write("/tmp/hold.py", HOLD)
        box.commands.run(f"python3 /tmp/hold.py {EXT_A} 80 55 > /tmp/hold.out 2>&1", background=True)
        deadline = time.monotonic() + 60
        while not (out := box.commands.run("cat /tmp/hold.out 2>/dev/null || true").stdout.split()):
            assert time.monotonic() < deadline, "the guest's holder printed nothing"
            time.sleep(0.5)
        assert out[:50] == ["ok"] * 50, out
        assert all(r.startswith("111:") and float(r.split(":")[1]) < 1 for r in out[50:]), out  # ECONNREFUSED at once
        held = [e for e in _node_entries(address) if "ESTABLISHED" in e and f"dst={EXT_A}" in e]
        assert len(held) == 50 and all(int(e.split()[4]) <= 7440 for e in held), held
        # DNS is a flow too: refused at the limit, quickly
        started = time.monotonic()
        assert box.commands.run("getent hosts ext-a.test || echo no-answer", timeout=60).stdout.strip() == "no-answer"
        assert time.monotonic() - started < 15
        # the node is not starved: its connections into the guest enter at vpeer and are not counted
        box.commands.run("cd /tmp && python3 -m http.server 8080 >/dev/null 2>&1", background=True)
        import httpx
        deadline = time.monotonic() + 30
        with httpx.Client(timeout=5, limits=httpx.Limits(max_keepalive_connections=0)) as client:
            answered = 0
            while answered < 60:
                try:
                    answered += client.get(f"http://{address}:8080/").status_code == 200
                except httpx.HTTPError:
                    assert answered == 0 and time.monotonic() < deadline, "the node cannot reach the guest"
                    time.sleep(0.5)
        assert box.commands.run("echo alive").stdout.strip() == "alive"
        # let go, and it connects again
        box.commands.run("pkill -f 'python3 /tmp/[h]old.py'; sleep 1")
        assert probe(box, [(EXT_A, 80)]) == {(EXT_A, 80): True}
    finally:
        box.kill()
    deadline = time.monotonic() + 30
    while _node_entries(address):
        assert time.monotonic() < deadline, "the killed guest's flows stayed in the node's table"
        time.sleep(0.5)


DNS_HOLD = r"""
import socket, time
held, out = [], []
for _ in range(25):
    s = socket.socket(); s.settimeout(5)
    try:
        s.connect(("8.8.8.8", 53)); held.append(s); out.append("ok")
    except OSError as e:
        out.append(str(e.errno))
print(" ".join(out), flush=True)
time.sleep(600)
"""

DNS_FLOOD = r"""
import json, socket, struct, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.setblocking(False); s.connect(("8.8.8.8", 53))
q = b"\x05ext-a\x04test\x00\x00\x01\x00\x01"
sent = answered = 0
end = time.monotonic() + 2
while time.monotonic() < end:
    try:
        s.send(struct.pack(">HHHHHH", sent & 0xffff, 0x0100, 1, 0, 0, 0) + q); sent += 1
    except BlockingIOError:
        pass
    while True:
        try:
            s.recv(512); answered += 1
        except BlockingIOError:
            break
drain = time.monotonic() + 1
while time.monotonic() < drain:
    try:
        s.recv(512); answered += 1
    except BlockingIOError:
        time.sleep(0.01)
print(json.dumps({"sent": sent, "answered": answered}))
"""


def test_one_guest_cannot_take_the_nodes_resolver(stack, sdk_env, world):
    """Issue 21: every guest shares the node's dnsmasq. It runs as an unprivileged user; a
    guest that holds TCP DNS connections gets 4 (AENV_NET_DNS_TCP_CONNECTIONS), the rest are
    reset, and dnsmasq (20 TCP children at most) still answers others over TCP; a guest that
    floods queries gets ~200 a second answered after a burst of 400 (AENV_NET_DNS_RATE/BURST)
    while the resolver answers others at once. Only a name of the test's hosts file is
    asked: nothing leaves the node."""
    from vmm.net.dns import DNSLimits, service_ip

    pid = int((stack.home / "net" / "dnsmasq.pid").read_text())
    status = open(f"/proc/{pid}/status").read()
    assert [u for u in next(x for x in status.splitlines() if x.startswith("Uid:")).split()[1:] if u == "0"] == []
    resolver, limits = service_ip(stack.net_pool), DNSLimits()
    box = Sandbox.create(timeout=600)
    try:
        box.files.write("/tmp/hold.py", DNS_HOLD)
        box.commands.run("python3 /tmp/hold.py > /tmp/hold.out 2>&1", background=True)
        deadline = time.monotonic() + 60
        while not (out := box.commands.run("cat /tmp/hold.out 2>/dev/null || true").stdout.split()):
            assert time.monotonic() < deadline, "the guest's holder printed nothing"
            time.sleep(0.5)
        # the resolver still serves TCP (and UDP) to others while the guest holds its share
        assert dns_ask(resolver, "ext-a.test", tcp=True, timeout=5)[0] == EXT_A
        assert dns_ask(resolver, "ext-a.test", timeout=2)[0] == EXT_A
        assert out[:limits.tcp] == ["ok"] * limits.tcp and set(out[limits.tcp:]) == {"111"}, out  # ECONNREFUSED
        box.commands.run("pkill -f '[h]old.py' || true")

        box.files.write("/tmp/flood.py", DNS_FLOOD)
        flood = box.commands.run("python3 /tmp/flood.py", background=True)
        time.sleep(1)
        started = time.monotonic()
        assert dns_ask(resolver, "ext-a.test", timeout=2)[0] == EXT_A  # during the flood
        assert time.monotonic() - started < 0.5
        result = json.loads(flood.wait().stdout.strip().splitlines()[-1])
        bound = limits.burst + 2 * limits.rate + 100  # 2 s of flood, some slack for timing
        assert result["sent"] > 2 * bound, f"the guest sent too few queries to prove anything: {result}"
        assert 2 * limits.rate <= result["answered"] <= bound, result
    finally:
        box.kill()
