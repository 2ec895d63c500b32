"""The chaos bench's stack: a harness.stack.Stack whose Redis and PostgreSQL are private
(harness.chaos_services), whose node home sits on a small loop-mounted filesystem and whose
guest RAM goes to a small private tmpfs (AENV_SHM_DIR), and whose every process can be
SIGKILLed and started again on the same port: the faults, by name (``FAULTS``)."""
from __future__ import annotations

import os
import signal
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import httpx

from harness.chaos_services import LoopFs, PrivatePostgres, PrivateRedis, PrivateTmpfs
from harness.polling import until
from harness.stack import PY, Stack, started

# Every fault the bench knows, in the order it injects them; node-b only with a second node.
FAULTS = ("api", "dataplane", "node", "node-b", "sweeper", "redis", "postgres", "disk", "shm")
# What the chaos stack sets beyond its private services: a node that looks for abandoned
# operations and dead VMs often, so a check after a fault need not wait minutes. An operation
# is abandoned a minute after the API's deadline for it (AENV_LIFECYCLE_DEADLINE), as the
# defaults keep it: at 90 s the node's reconcile ended creates that 20 clients' load made take
# longer while their API requests still waited. The checks wait that long for orphans (a
# create whose API was killed is the node's to end: ORPHAN_WAIT).
CHAOS_ENV = {"AENV_RECONCILE_INTERVAL": "5", "AENV_RECONCILE_STALE": "180", "AENV_VM_WATCH_INTERVAL": "2",
             "AENV_SHM_HEADROOM_MB": "128", "AENV_NODE_HEARTBEAT_INTERVAL": "2",
             "AENV_NODE_HEARTBEAT_TIMEOUT": "20", "AENV_LIFECYCLE_DEADLINE": "120",
             "AENV_NODE_TASK_DEADLINE": "180", "AENV_NET_WARM_SLOTS": "4"}
WARM_SLOTS = 4
ORPHAN_WAIT = int(CHAOS_ENV["AENV_RECONCILE_STALE"]) + 6 * int(CHAOS_ENV["AENV_RECONCILE_INTERVAL"])
# The chaos stack's network instance, never a test session's or another bench's (docs/benchmarks.md).
NET_PREFIX, NET_POOL = "aenvq", "10.28.0.0/20"


class ChaosStack(Stack):
    """A Stack that can kill -9 and restart each of its processes by name."""

    @property
    def net_prefix(self) -> str:
        return NET_PREFIX

    @property
    def net_pool(self) -> str:
        return NET_POOL

    def kill9(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def restart(self, name: str) -> None:
        """Starts ``name`` again as Stack.start did (the same port), once it answers."""
        if name == "node":
            self.start_node(wait=True)
        elif name == "lifecycle":
            self._spawn("lifecycle", [PY, "manage.py", "run_lifecycle"])
        elif name == "api":
            port = int(self.api_url.rsplit(":", 1)[1])
            self._spawn("api", [PY, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "config.asgi:application"])
            self._wait_http(f"{self.api_url}/health", "api", deadline=120)
        elif name == "dataplane":
            port = int(self.sandbox_url.rsplit(":", 1)[1])
            self._spawn("dataplane", [PY, "-m", "dataplane.serve", "--host", "127.0.0.1", "--port", str(port),
                                      "--", "--no-access-log", "--timeout-keep-alive", "300"])
            self._wait_port(port, "dataplane", deadline=120)
        else:
            raise ValueError(name)

    def healthy(self) -> bool:
        """The API answers, the node worker runs, the sweeper runs."""
        try:
            ok = httpx.get(f"{self.api_url}/health", timeout=5).status_code in (200, 204)
        except httpx.HTTPError:
            return False
        return ok and all(self.procs.get(n) is not None and self.procs[n].poll() is None
                          for n in ("node", "lifecycle", "api", "dataplane"))


class ChaosWorld:
    """The stack and what it breaks: ``inject(fault)`` breaks, ``recover(fault)`` repairs.
    ``nodes=2``: a second node worker (harness.second_node: its own home, images and network
    instance; the same private database, Redis and RAM tmpfs) that placement spreads the
    clients' sandboxes over, so one node's death meets sandboxes on both."""

    def __init__(self, root: Path, clients: int, nodes: int = 1):
        self.root = Path(root)
        self.nodes = nodes
        self.peer = None  # the second node (harness.second_node.SecondNode)
        self.redis = PrivateRedis(self.root)
        self.pg = PrivatePostgres(self.root)
        # a home big enough for the clients' paused sandboxes (memory files up to the guest's 512 MiB)
        self.disk = LoopFs(self.root / "home.img", self.root / "h", 3072 + 1024 * clients)
        self.shm = PrivateTmpfs(self.root / "shm", 1536 + 640 * clients)
        self.stack: ChaosStack | None = None

    def start(self) -> ChaosStack:
        self.redis.start()
        self.pg.start()
        self.disk.mount()
        self.shm.mount()
        env = {**CHAOS_ENV, **self.redis.env(), **self.pg.env(), "AENV_SHM_DIR": str(self.shm.mnt)}
        self.stack = ChaosStack(home=self.disk.mnt / "home", extra_env=env)
        self.stack.start()
        if self.nodes > 1:
            from harness.second_node import SecondNode  # noqa: PLC0415

            self.peer = SecondNode(self.stack, self.root, name="b")
        return self.stack

    def node_views(self) -> list:
        """Each node as the checks see it (harness.chaos_checks.NodeView)."""
        from harness.chaos_checks import NodeView  # noqa: PLC0415

        views = [NodeView.of(self.stack)]
        if self.peer is not None:
            e = self.peer.env
            views.append(NodeView(self.peer.id, self.peer.home, e["AENV_NET_PREFIX"], e["AENV_NET_POOL"]))
        return views

    def inject(self, fault: str) -> str:
        """Breaks ``fault``; returns what was done (for the table)."""
        s = self.stack
        if fault in ("api", "dataplane", "node"):
            s.kill9(fault)
            return f"kill -9 {fault}"
        if fault == "node-b":
            if self.peer is None:
                raise ValueError("node-b needs a second node (nodes=2)")
            self.peer.kill9()
            return "kill -9 node B's worker"
        if fault == "sweeper":
            s.kill9("lifecycle")
            return "kill -9 run_lifecycle"
        if fault == "redis":
            self.redis.kill9()
            return "kill -9 redis-server (private, AOF everysec)"
        if fault == "postgres":
            self.pg.stop("immediate")
            return "pg_ctl stop -m immediate (private cluster)"
        if fault == "disk":
            return f"filled the node home's filesystem ({self.disk.fill()} MiB)"
        if fault == "shm":
            return f"filled AENV_SHM_DIR's tmpfs ({self.shm.fill()} MiB)"
        raise ValueError(fault)

    def recover(self, fault: str) -> None:
        s = self.stack
        if fault in ("api", "dataplane", "node"):
            s.restart(fault)
        elif fault == "node-b":
            self.peer.start()
        elif fault == "sweeper":
            s.restart("lifecycle")
        elif fault == "redis":
            self.redis.start()
        elif fault == "postgres":
            self.pg.start()
        elif fault == "disk":
            self.disk.unfill()
        elif fault == "shm":
            self.shm.unfill()

    def revive(self) -> list[str]:
        """Any stack process that died of a fault it was not the target of, started again
        (each is a finding: named in the answer)."""
        s, died = self.stack, []
        for name in ("api", "dataplane", "node", "lifecycle"):
            proc = s.procs.get(name)
            if proc is None or proc.poll() is not None:
                died.append(name)
                s.procs.pop(name, None)
                s.restart(name)
        if self.peer is not None and self.peer.proc.poll() is not None:
            died.append("node-b")
            self.peer.start()
        return died

    def close(self) -> None:
        if self.peer is not None:
            try:
                self.peer.stop()
            except Exception:  # noqa: BLE001 - teardown: the rest still goes
                pass
        if self.stack is not None:
            self.stack.shutdown()
        for part in (self.shm, self.disk, self.pg, self.redis):
            try:
                part.close()
            except Exception:  # noqa: BLE001 - teardown: the rest still goes
                pass


@contextmanager
def chaos_world(clients: int, root: Path | None = None, nodes: int = 1):
    """A started ChaosWorld under a short root (Unix socket paths stay under 108 bytes)."""
    root = root or Path("/tmp") / f"aenv-chaos-{uuid.uuid4().hex[:6]}"
    root.mkdir(parents=True, exist_ok=True)
    world = ChaosWorld(root, clients, nodes)
    with started(world, world.close, root):
        yield world


def wait_healthy(stack: ChaosStack, deadline: float = 180) -> float:
    """Seconds until the stack answers again after a repair."""
    t0 = time.monotonic()
    until(stack.healthy, f"the stack to recover (within {deadline} s)", deadline, interval=0.5, tolerate=())
    return time.monotonic() - t0
