"""A real 3-node cluster on this machine (``cluster``, what ``scripts/cluster.sh``
runs): each node worker in a network namespace of its own with its own address, home and
slot pool, against one PostgreSQL and one Redis, the API, data plane and sweeper in the root
namespace. 12 sandboxes (30 in the slow suite) created at once through the official SDK
spread over the nodes;
every one answers a command through the data plane and a shell through the dashboard's
terminal WebSocket (both in the root namespace, reaching each guest in its node's
namespace); a guest reaches neither the gateway, nor another node, nor another node's
guests; kills free capacity on the node that held them, and the next create goes to the
least loaded node. The cluster is its own instance (names ``aect*``, 10.212/16 and
10.213/16, a database and Redis databases of its own), removed at the end."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from ipaddress import ip_address, ip_network

import httpx
import pytest

from cluster import Cluster, ClusterLayout
from cluster import hostnet

from harness.networld import NodeService, probe
from harness.stack import ROOT, free_port, shared_images_dir

pytestmark = [pytest.mark.vm, pytest.mark.timeout(1500)]

# Sandboxes created at once: 12 in the default run (CI time), the full 30 in the slow suite
# (AENV_TEST_SLOW=1 scripts/test.sh) or with AENV_TEST_CLUSTER_SANDBOXES (a multiple of 3).
COUNT = int(os.environ.get("AENV_TEST_CLUSTER_SANDBOXES",
                           "30" if os.environ.get("AENV_TEST_SLOW") == "1" else "12"))
# Each node is sized for exactly COUNT / 3 base sandboxes (2 vCPU each: 2 cores × OVERCOMMIT
# vCPUs), so the concurrent creates fill every node to the last slot and a fork on a full node
# is reachable with real VMs.
OVERCOMMIT = COUNT // 3


def _postgres_reason() -> str | None:
    try:
        with socket.create_connection(("127.0.0.1", 5432), timeout=2):
            return None
    except OSError:
        return "needs PostgreSQL on 127.0.0.1:5432 (trust for local TCP)"


@pytest.fixture(scope="module")
def cluster():
    if os.geteuid() != 0:
        pytest.skip("the cluster needs root (network namespaces, nftables)")
    reason = _postgres_reason()
    if reason:
        pytest.skip(reason)
    layout = ClusterLayout(nodes=3, name="aect", link_net="10.212.0.0/16", pool_net="10.213.0.0/16",
                           state_dir=ROOT / "var" / "test-runs" / "cluster-aect",  # fixed: a crashed run's is found
                           images_dir=shared_images_dir(), database="aenv_cluster_test",
                           redis_db=10, api_port=free_port(), dataplane_port=free_port(),
                           # with a token each node's metrics listen on its own address (else 127.0.0.1)
                           extra_env={"AENV_NODE_VCPU_OVERCOMMIT": str(OVERCOMMIT),
                                      "AENV_METRICS_TOKEN": "cluster-test-metrics-" + "0" * 32})
    c = Cluster(layout, progress=lambda m: print(f"[cluster] {m}", flush=True))
    c.down(purge=True, node_timeout=60)  # what a crashed run of this test may have left
    try:
        started = time.monotonic()
        c.up()
        print(f"[cluster] up in {time.monotonic() - started:.1f} s", flush=True)
        yield c
    finally:
        c.down(purge=True, node_timeout=120)
        assert not hostnet.namespaces() & {n.netns for n in layout.all_nodes}
        assert not any(name.startswith("aect") for name in hostnet.namespaces())  # the nodes' slots too
        assert layout.table not in hostnet.cluster_tables()


@pytest.fixture
def sdk(cluster, monkeypatch):
    for key, value in cluster.sdk_env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("E2B_DEBUG", raising=False)
    return cluster


def nodes_by_id(cluster) -> dict[str, dict]:
    return {n["id"]: n for n in cluster.nodes()}


def placement(cluster, sandbox_ids: list[str]) -> dict[str, tuple[str, str]]:
    """sandbox id → (node id, envd host), from the cluster's database."""
    code = ("import json; from sandboxes.models import Sandbox; "
            f"print(json.dumps({{s.id: [s.node_id, s.envd_host] for s in Sandbox.objects.filter(pk__in={sandbox_ids!r})}}))")
    return {k: tuple(v) for k, v in json.loads(cluster.manage("shell", "-v", "0", "-c", code).strip().splitlines()[-1]).items()}


def dashboard_session(cluster) -> str:
    """A signed-in dashboard session of the default team (the login form, as a browser does)."""
    password = uuid.uuid4().hex
    cluster.manage("create_dashboard_user", "--username", "cluster-test", "--team", "default", "--password", password)
    with httpx.Client(base_url=cluster.layout.api_url, timeout=30) as http:
        http.get("/dashboard/login/")
        answer = http.post("/dashboard/login/", data={"username": "cluster-test", "password": password,
                                                      "csrfmiddlewaretoken": http.cookies["csrftoken"]})
        assert answer.status_code in (302, 303) and "sessionid" in http.cookies, answer.text[-500:]
        return http.cookies["sessionid"]


async def terminal_answers(cluster, session: str, sandbox_id: str, n: int) -> bool:
    """Opens the sandbox's terminal over the dashboard's WebSocket and runs a line in its shell."""
    from websockets.asyncio.client import connect  # noqa: PLC0415

    url = f"ws://127.0.0.1:{cluster.layout.api_port}/ws/sandboxes/{sandbox_id}/terminal?cols=100&rows=30"
    async with connect(url, origin=cluster.layout.api_url, additional_headers={"Cookie": f"sessionid={session}"},
                       open_timeout=30) as ws:
        output, ready = b"", False
        deadline = asyncio.get_running_loop().time() + 90
        while asyncio.get_running_loop().time() < deadline:
            msg = await asyncio.wait_for(ws.recv(), timeout=90)
            if isinstance(msg, str):
                if json.loads(msg).get("type") == "ready" and not ready:
                    ready = True
                    await ws.send(json.dumps({"type": "input", "data": f"echo term-$(({n}*7))\r"}))
                continue
            output += msg
            if f"term-{n * 7}".encode() in output:
                return True
        return False


def test_sandboxes_created_at_once_spread_reachable_and_kills_free_capacity(sdk):
    from e2b import Sandbox  # noqa: PLC0415

    cluster = sdk
    layout = cluster.layout
    node_ids = [n.node_id for n in layout.all_nodes]
    sandboxes = []
    try:
        started = time.monotonic()
        with ThreadPoolExecutor(COUNT) as pool:
            futures = [pool.submit(Sandbox.create, timeout=600) for _ in range(COUNT)]
            sandboxes = [f.result() for f in futures]
        created_in = time.monotonic() - started
        print(f"[cluster] {COUNT} concurrent creates: {created_in:.1f} s", flush=True)

        where = placement(cluster, [s.sandbox_id for s in sandboxes])
        counts = Counter(node for node, _ in where.values())
        print(f"[cluster] per node: {dict(sorted(counts.items()))}", flush=True)
        assert set(counts) == set(node_ids), counts  # spread: every node took some
        assert max(counts.values()) - min(counts.values()) <= COUNT // 3, counts
        pools = {n.node_id: ip_network(n.pool) for n in layout.all_nodes}
        for sandbox_id, (node, envd_host) in where.items():
            assert ip_address(envd_host) in pools[node], (sandbox_id, node, envd_host)  # its node's own slot
        before = nodes_by_id(cluster)
        for node in node_ids:
            assert before[node]["metrics"]["allocatedCPU"] == 2 * counts[node], before[node]
            assert before[node]["sandboxCount"] == counts[node]

        # every one through the data plane (root namespace -> its node's slot)
        def run(pair):
            n, s = pair
            return s.commands.run(f"echo dp-$(({n}*3))", timeout=120).stdout.strip() == f"dp-{n * 3}"
        started = time.monotonic()
        with ThreadPoolExecutor(10) as pool:
            answered = list(pool.map(run, enumerate(sandboxes)))
        assert all(answered), [s.sandbox_id for s, ok in zip(sandboxes, answered) if not ok]
        print(f"[cluster] {COUNT} commands through the data plane: {time.monotonic() - started:.1f} s", flush=True)

        # and through the dashboard's terminal (daphne in the root namespace -> envd in the slot)
        session = dashboard_session(cluster)

        async def all_terminals():
            gate = asyncio.Semaphore(10)

            async def one(n, s):
                async with gate:
                    return await terminal_answers(cluster, session, s.sandbox_id, n)
            return await asyncio.gather(*(one(n, s) for n, s in enumerate(sandboxes)))
        started = time.monotonic()
        shells = asyncio.run(all_terminals())
        assert all(shells), [s.sandbox_id for s, ok in zip(sandboxes, shells) if not ok]
        print(f"[cluster] {COUNT} dashboard terminals: {time.monotonic() - started:.1f} s", flush=True)

        # every node is full: one more create is refused; a fork stays on its parent's node and
        # is refused there (503, saying so) although other nodes exist; nothing is reserved for it
        on = {node: [s for s in sandboxes if where[s.sandbox_id][0] == node] for node in node_ids}
        assert sorted(counts.values()) == [COUNT // 3] * 3, counts
        api = httpx.Client(base_url=layout.api_url, headers={"X-API-Key": cluster.api_key}, timeout=120)
        with api:
            more = api.post("/sandboxes", json={"templateID": "base"})
            assert more.status_code == 503, more.text
            parent = on[node_ids[0]][0]
            fork = api.post(f"/sandboxes/{parent.sandbox_id}/fork", json={"count": 1})
            assert fork.status_code == 503, fork.text
            assert fork.json()["code"] == 503 and node_ids[0] in fork.json()["message"], fork.json()
            children = api.get("/v2/sandboxes", params={"state": "running,paused"}).json()
            assert len(children) == COUNT, len(children)
        assert nodes_by_id(cluster)[node_ids[0]]["metrics"]["allocatedCPU"] == 2 * counts[node_ids[0]]
        assert parent.commands.run("echo still").stdout.strip() == "still"

        # kills free capacity on the node that held them, and only there
        first, second, third = sorted(node_ids, key=lambda n: counts[n], reverse=True)
        doomed = on[first] + on[second][:2]
        for s in doomed:
            s.kill()
        after = nodes_by_id(cluster)
        assert after[first]["metrics"]["allocatedCPU"] == 0 and after[first]["sandboxCount"] == 0
        assert after[first]["metrics"]["allocatedMemoryBytes"] == 0
        assert after[second]["metrics"]["allocatedCPU"] == 2 * (counts[second] - 2)
        assert after[second]["metrics"]["allocatedMemoryBytes"] == 512 * 2**20 * (counts[second] - 2)
        assert after[third]["metrics"]["allocatedCPU"] == 2 * counts[third]
        sandboxes = [s for s in sandboxes if s not in doomed]

        # the freed node is now the least loaded: spread sends the next create there
        nxt = Sandbox.create(timeout=300)
        sandboxes.append(nxt)
        assert placement(cluster, [nxt.sandbox_id])[nxt.sandbox_id][0] == first
        assert nxt.commands.run("echo again").stdout.strip() == "again"
    finally:
        for s in sandboxes:
            try:
                s.kill()
            except Exception:  # noqa: BLE001 - cleanup; the cluster's down kills the rest
                pass
    final = nodes_by_id(cluster)
    assert all(final[n]["metrics"]["allocatedCPU"] == 0 for n in node_ids), final


def _opens(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=5):
            return True
    except OSError:
        return False


def test_a_guest_reaches_no_gateway_node_or_other_nodes_guest(sdk):
    """From inside a guest on node 1: its gateway's service ports, a listener on every root
    namespace address, its own node, node 2 and a guest on node 2 are all closed — while the
    root namespace (the data plane's place) reaches node 2 and its guest."""
    from e2b import Sandbox  # noqa: PLC0415

    cluster = sdk
    one, two = cluster.layout.node(1), cluster.layout.node(2)
    service = NodeService()  # a listener on 0.0.0.0 of the root namespace
    layout = cluster.layout
    sandboxes = []
    try:
        # three creates land one per node (spread); keep the ones on nodes 1 and 2
        sandboxes = [Sandbox.create(timeout=300) for _ in range(3)]
        where = placement(cluster, [s.sandbox_id for s in sandboxes])
        guest = next(s for s in sandboxes if where[s.sandbox_id][0] == one.node_id)
        other_guest_host = next(h for s in sandboxes for n, h in [where[s.sandbox_id]] if n == two.node_id)
        metrics = 9464  # each node's Prometheus port, on its own address (the cluster sets AENV_METRICS_TOKEN)
        # the root namespace's addresses that answer from there: another test run's namespaces may
        # come and go meanwhile (their addresses are not this cluster's to check)
        root_ips = [ip for ip in (a.split("/")[0] for a in hostnet.root_addresses()) if _opens(ip, service.port)]
        assert root_ips, hostnet.root_addresses()  # the machine's own address at least
        targets = [(one.gateway_ip, layout.pg_port), (one.gateway_ip, layout.redis_port),
                   (one.gateway_ip, service.port), (two.gateway_ip, service.port),
                   *((ip, service.port) for ip in root_ips),
                   (one.address, metrics), (two.address, metrics), (other_guest_host, 49983)]
        # from the root namespace these are open (so "closed" below is the fence, not nothing there)
        for host, port in [(two.address, metrics), (other_guest_host, 49983)]:
            with socket.create_connection((host, port), timeout=5):
                pass
        seen = probe(guest, targets)
        assert not any(seen.values()), {t: v for t, v in seen.items() if v}
        assert service.accepted == len(root_ips)  # only the root namespace's own checks got in
    finally:
        service.close()
        for s in sandboxes:
            s.kill()


def test_a_restore_goes_to_the_node_that_has_its_snapshot(sdk):
    """Locality: a snapshot's files are on the node that took it (each node's own posix_fs
    store here), so a create from it lands there, although spread alone would pick an
    emptier node; the restored sandbox has the snapshot's file."""
    from e2b import Sandbox  # noqa: PLC0415

    cluster = sdk
    sandboxes, snapshot_id = [], None
    try:
        source = Sandbox.create(timeout=300)
        sandboxes.append(source)
        home = placement(cluster, [source.sandbox_id])[source.sandbox_id][0]
        source.files.write("/home/user/where.txt", "taken on the source's node")
        snapshot_id = source.create_snapshot().snapshot_id
        children = source.fork(count=1, timeout=300)  # the home node is now the busiest
        assert not [c for c in children if isinstance(c, Exception)], children
        sandboxes += children
        load = {n["id"]: n["sandboxCount"] for n in cluster.nodes()}
        assert load[home] == 2 and sorted(load.values()) == [0, 0, 2], load

        restored = Sandbox.create(snapshot_id, timeout=300)
        sandboxes.append(restored)
        assert placement(cluster, [restored.sandbox_id])[restored.sandbox_id][0] == home
        assert restored.files.read("/home/user/where.txt") == "taken on the source's node"
    finally:
        for s in sandboxes:
            try:
                s.kill()
            except Exception:  # noqa: BLE001 - cleanup; the cluster's down kills the rest
                pass
        if snapshot_id:
            httpx.delete(f"{cluster.layout.api_url}/templates/{snapshot_id}", headers={"X-API-Key": cluster.api_key},
                         timeout=120)


def test_each_node_works_as_its_own_database_role(cluster):
    """Per-node database roles (nodes.db_roles, on in the cluster): each node worker is
    connected as aenv_node_<id>, which cannot read the teams' API keys."""
    import psycopg  # noqa: PLC0415

    from nodes.db_roles import role_name  # noqa: PLC0415

    roles = {role_name(n.node_id) for n in cluster.layout.all_nodes}
    with psycopg.connect(host="127.0.0.1", port=cluster.layout.pg_port, user=cluster.layout.pg_user,
                         dbname=cluster.layout.database, autocommit=True) as conn:
        users = {u for (u,) in conn.execute("SELECT DISTINCT usename FROM pg_stat_activity WHERE datname = %s",
                                            [cluster.layout.database]).fetchall()}
        assert roles <= users, users
        for role in roles:
            assert conn.execute("SELECT has_table_privilege(%s, 'sandboxes_apikey', 'SELECT')", [role]).fetchone() == \
                (False,)
            assert conn.execute("SELECT has_table_privilege(%s, 'nodes_node', 'UPDATE')", [role]).fetchone() == (True,)
