"""deploy/compose.yaml (+ compose.ci.yaml) started for real on the Docker engine: PostgreSQL,
Redis, an S3 server, the control plane and two node containers, all built from Debian/PyPI
packages on a local Debian root. The unchanged E2B SDK creates a sandbox on each node (the
other one drained), runs a command in each. Sandbox networks are netns (a namespace and slot per
guest, the data plane routed to each node's pool by its routes sidecar): each guest reaches no
service of the stack, no API port and not the other node's guest, while its node container
reaches the services and the data plane's container the other guest (so the addresses are
right); a guest with internet access sends out through its node's uplink, one without does not.
Then one is paused and resumed on the other node from the S3 store, with its file. Both node
containers can start the egress proxy (its venv is in the node image). Before that:
each node joined with the token the one-shot join-tokens left it, and works as a PostgreSQL role
of its own that cannot read API keys (it never had the control plane's database password).
``docker compose down -v`` afterwards. The timings go to the output (docs/deployment.md)."""
from __future__ import annotations

import ipaddress
import json
import time

import pytest
from django.conf import settings
from e2b import Sandbox

from envd import ENVD_PORT
from harness.compose_stack import NODES, Unavailable, compose_stack

pytestmark = [pytest.mark.vm, pytest.mark.timeout(3600)]


@pytest.fixture(scope="module")
def stack():
    try:
        with compose_stack(settings.AENV_IMAGES_DIR) as s:
            print(f"[compose] images built in {s.timings['build_s']:.0f} s, up --wait in {s.timings['up_s']:.0f} s",
                  flush=True)
            yield s
    except Unavailable as exc:
        pytest.skip(f"no Docker engine here: {exc}")


@pytest.fixture
def sdk(stack, monkeypatch):
    monkeypatch.setenv("E2B_API_URL", stack.api_url)
    monkeypatch.setenv("E2B_SANDBOX_URL", stack.sandbox_url)
    monkeypatch.setenv("E2B_API_KEY", stack.api_key)
    monkeypatch.delenv("E2B_DEBUG", raising=False)
    return stack


def drain(stack, node: str, on: bool) -> None:
    stack.manage(f"from nodes.models import Node; assert Node.objects.filter(pk={node!r}).update(draining={on}) == 1")


def row(stack, sandbox_id: str) -> dict:
    return json.loads(stack.manage(
        "import json; from sandboxes.models import Sandbox as S; "
        f"s = S.objects.get(pk={sandbox_id!r}); print(json.dumps({{'node': s.node_id, 'state': s.state, "
        "'envd_host': s.envd_host, 'envd_port': s.envd_port, 'exported': s.pause_image_at is not None}))"))


def create_on(stack, node: str, **options) -> Sandbox:
    """A sandbox on ``node``: every other node drains while it is placed."""
    others = [n for n in NODES if n != node]
    for other in others:
        drain(stack, other, True)
    try:
        sandbox = Sandbox.create(timeout=900, **options)
    finally:
        for other in others:
            drain(stack, other, False)
    assert row(stack, sandbox.sandbox_id)["node"] == node
    return sandbox


def closed_from(sandbox: Sandbox, targets: dict[str, tuple[str, int]]) -> dict[str, bool]:
    """For each named host:port, whether a TCP connection from inside the guest to it fails:
    one command, every attempt at once (each gives up after 5 s)."""
    names = list(targets)
    tries = " ".join(f"{i}={host}:{port}" for i, (host, port) in enumerate(targets.values()))
    done = sandbox.commands.run(
        f"for t in {tries}; do (a=${{t#*=}}; if timeout 5 bash -c \"echo > /dev/tcp/${{a%:*}}/${{a##*:}}\" "
        f"2>/dev/null; then echo \"${{t%%=*}} OPEN\"; else echo \"${{t%%=*}} CLOSED\"; fi) & done; wait",
        timeout=60)
    seen = {names[int(i)]: verdict for i, verdict in (line.split() for line in done.stdout.splitlines() if line.strip())}
    assert set(seen) == set(targets), done.stdout
    return {name: verdict == "CLOSED" for name, verdict in seen.items()}


PUBLIC = "192.0.43.8"  # a public address (IANA's): no private range, so a guest's policy decides on it
POOLS = {"node-1": "10.21.0.0/16", "node-2": "10.22.0.0/16"}  # deploy/compose-pools/


def routed_pools(stack, service: str) -> set[str]:
    """The networks routed in ``service``'s network namespace (its /proc/net/route)."""
    table = stack.exec(service, "cat", "/proc/net/route").stdout.splitlines()[1:]
    return {str(ipaddress.IPv4Network((int(dst, 16).to_bytes(4, "little"), bin(int(mask, 16)).count("1"))))
            for _, dst, _, _, _, _, _, mask, *_ in (line.split() for line in table)}


def wait_routes(stack) -> None:
    """The routes sidecars' first pass after the nodes registered (every 30 s)."""
    deadline = time.monotonic() + 120
    for service in ("dataplane", "api"):
        while not set(POOLS.values()) <= routed_pools(stack, service):
            assert time.monotonic() < deadline, (routed_pools(stack, service), stack.logs(f"{service}-routes"))
            time.sleep(2)


def egress_packets(stack, node: str, guest: Sandbox) -> int:
    """How many packets the guest's connection attempts to PUBLIC:80 sent out of its node's
    container (a counter in a table of the test's own in that container's forward hook)."""
    table = "aenv_ci_egress"
    stack.exec(node, "bash", "-c", f"nft delete table ip {table} 2>/dev/null; nft 'add table ip {table}' && "
               f"nft 'add chain ip {table} out {{ type filter hook forward priority -300; }}' && "
               f"nft 'add rule ip {table} out ip daddr {PUBLIC} tcp dport 80 oifname \"eth0\" counter'")
    guest.commands.run(f"timeout 3 bash -c 'echo > /dev/tcp/{PUBLIC}/80' || true", timeout=30)
    listed = json.loads(stack.exec(node, "nft", "-j", "list", "table", "ip", table).stdout)
    stack.exec(node, "nft", "delete", "table", "ip", table, check=False)
    return sum(item["rule"]["expr"][-1]["counter"]["packets"] for item in listed["nftables"] if "rule" in item)


def test_nodes_joined_with_tokens_and_work_as_their_own_database_roles(stack):
    """Both nodes joined (a credential, the token bound to their id, spent); every database
    session from a node's address is its role's, as is a new process's in its container (the
    health check's way: the stored role URL); that role cannot read the API keys."""
    joined = json.loads(stack.manage(
        "import json; from nodes.models import Node; from nodes.db_roles import role_name; print(json.dumps({"
        "n.pk: {'credential': bool(n.credential_hash), 'token_node': n.joined_via and n.joined_via.node_id, "
        "'token_used': bool(n.joined_via and n.joined_via.used_at), 'revoked': n.revoked_at is not None, "
        f"'role': role_name(n.pk)}} for n in Node.objects.filter(pk__in={list(NODES)!r})}}))"))
    assert sorted(joined) == sorted(NODES), joined
    for node, state in joined.items():
        assert state["credential"] and state["token_node"] == node and state["token_used"], (node, state)
        assert not state["revoked"], (node, state)
    for node in NODES:
        role = joined[node]["role"]
        env = stack.exec(node, "printenv", "DATABASE_URL").stdout
        assert ":" not in env.split("@")[0].removeprefix("postgres://"), f"{node}'s DATABASE_URL has a password"
        whoami = stack.manage("from django.db import connection\n"
                              "with connection.cursor() as c:\n    c.execute('select current_user')\n"
                              "    print(c.fetchone()[0])", service=node).split()[-1]
        assert whoami == role, (node, whoami)
        keys = stack.manage("from django.db import connection, ProgrammingError\n"
                            "try:\n    with connection.cursor() as c:\n"
                            "        c.execute('select count(*) from sandboxes_apikey')\n"
                            "        print('READ', c.fetchone())\n"
                            "except ProgrammingError as exc:\n    print('DENIED', exc)", service=node)
        assert "DENIED" in keys and "permission denied" in keys and "READ" not in keys, (node, keys)
        # the worker's own sessions (heartbeats, tasks): from the node's address, as its role only
        address = stack.address(node)
        deadline = time.monotonic() + 60
        while True:
            users = set(stack.exec("postgres", "psql", "-U", "aenv", "-d", "aenv", "-Atc",
                                   f"select usename from pg_stat_activity where client_addr = '{address}'"
                                   ).stdout.split())
            if users or time.monotonic() > deadline:
                break
            time.sleep(2)
        assert users == {role}, (node, address, users)


def test_node_containers_can_start_the_egress_proxy(stack):
    """Each node image carries the egress proxy's venv (.venv-egress: domain allowOut, rules,
    secrets): the node sees it as available, and the proxy's starter imports mitmproxy and
    aenv's addon as the user it runs as (nobody)."""
    for node in NODES:
        seen = stack.manage("from vmm.net.egress import EgressProxy\n"
                            "print('AVAILABLE', EgressProxy('check', '127.0.0.1', '/tmp').available())", service=node)
        assert "AVAILABLE True" in seen, (node, seen)
        started = stack.exec(node, "setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                             ".venv-egress/bin/python", "vmm/net/egress_proxy/run.py", "--help", check=False)
        assert started.returncode == 0 and "--listen" in started.stdout, (node, started.stdout, started.stderr)


def test_two_nodes_a_move_through_s3_and_a_guest_reaches_nothing(sdk):
    stack = sdk
    t0 = time.monotonic()
    wait_routes(stack)
    one = create_on(stack, "node-1", allow_internet_access=True)
    two = create_on(stack, "node-2", allow_internet_access=False)
    try:
        for sandbox, node in ((one, "node-1"), (two, "node-2")):
            done = sandbox.commands.run("echo hello from $(hostname)")
            assert done.exit_code == 0 and done.stdout.startswith("hello from"), done

        # what a guest must not reach: the stack's services, the API's ports, the other node's guest
        # (its envd at its slot address) — while its node container reaches the services and the
        # data plane's container (routed to every pool by its sidecar) the other guest
        services = {"postgres": (stack.address("postgres"), 5432), "redis": (stack.address("redis"), 6379),
                    "s3": (stack.address("s3"), 9000), "api": (stack.address("api"), 3000),
                    "dataplane": (stack.address("dataplane"), 3001)}
        placed = {node: row(stack, s.sandbox_id) for s, node in ((one, "node-1"), (two, "node-2"))}
        for guest, node, other in ((one, "node-1", "node-2"), (two, "node-2", "node-1")):
            targets = {**services, f"{other}'s guest": (placed[other]["envd_host"], placed[other]["envd_port"])}
            for name, (host, port) in targets.items():
                prober = "dataplane" if name.endswith("guest") else node
                probe = stack.exec(prober, "bash", "-c", f"timeout 5 bash -c 'echo > /dev/tcp/{host}/{port}'", check=False)
                assert probe.returncode == 0, f"{prober} does not reach {name} at {host}:{port}: the probe proves nothing"
            closed = closed_from(guest, {**targets, "its own envd": ("127.0.0.1", ENVD_PORT)})
            assert not closed.pop("its own envd")  # the probe can say OPEN
            assert [name for name, shut in closed.items() if not shut] == [], f"the guest on {node} reaches them"

        # egress: a public address (offline it answers nothing, so what counts is the packet leaving
        # the node's container toward its uplink, counted there): node-1's guest has internet
        # access, node-2's has none and its packets never leave its slot
        for guest, node, allowed in ((one, "node-1", True), (two, "node-2", False)):
            sent = egress_packets(stack, node, guest)
            assert (sent > 0) == allowed, f"the guest on {node} (internet access {allowed}) sent {sent} packets out"

        # node-1's sandbox paused (exported to S3), then resumed where only the store has it
        one.files.write("/home/user/moved.txt", "across nodes")
        one.pause()
        deadline = time.monotonic() + 300
        while not row(stack, one.sandbox_id)["exported"]:
            assert time.monotonic() < deadline, stack.logs("node-1")
            time.sleep(1)
        drain(stack, "node-1", True)
        try:
            back = Sandbox.connect(one.sandbox_id, timeout=900)
        finally:
            drain(stack, "node-1", False)
        assert row(stack, one.sandbox_id)["node"] == "node-2"
        assert back.files.read("/home/user/moved.txt") == "across nodes"
        assert back.commands.run("echo resumed").stdout.strip() == "resumed"
        print(f"[compose] two creates, a move through S3 and the probes in {time.monotonic() - t0:.0f} s", flush=True)
    finally:
        for sandbox in (one, two):
            try:
                Sandbox.kill(sandbox.sandbox_id)
            except Exception:  # noqa: BLE001 - down -v removes what is left
                pass
