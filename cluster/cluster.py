"""Bringing a one-machine cluster up, looking at it and taking it down: one implementation
for ``scripts/cluster.sh`` and the tests.

What runs where: the root namespace holds PostgreSQL and Redis (the machine's own, on
loopback), the API (daphne), the data plane (dataplane.serve: uvicorn and its hot path) and the sweeper; each node worker runs
in its own namespace with its own home, address and slot pool (``layout``, ``hostnet``).
Every step checks before it acts, so ``up`` on a running cluster starts only what is
missing and ``down`` on a stopped one does nothing.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import httpx

from cluster import hostnet
from cluster.layout import ROOT, ClusterLayout, NodeLayout
from cluster.processes import Processes, Spec, qemu_pids
from nodes.signing import write_keys

CONTROL = ("sweeper", "api", "dataplane")


class ClusterError(Exception):
    """The cluster cannot be brought up or down; the message says why and what to do."""


def require_root() -> None:
    if os.geteuid() != 0:
        raise ClusterError("the cluster needs root: it makes network namespaces, veths, routes and nftables "
                           "rules (run it with sudo)")
    missing = [tool for tool in ("ip", "nft", "nsenter", "sysctl") if shutil.which(tool) is None]
    if missing:
        raise ClusterError(f"missing {', '.join(missing)} (apt-get install iproute2 nftables util-linux procps)")


class Cluster:
    def __init__(self, layout: ClusterLayout, python: str = sys.executable, progress=print):
        self.layout, self.python, self.progress = layout, python, progress
        self.procs = Processes(layout.state_dir)

    # -- state ------------------------------------------------------------------------------------

    @property
    def _layout_file(self) -> Path:
        return self.layout.state_dir / "cluster.json"

    def _state_secret(self, name: str) -> str:
        """A random secret of the cluster's, made once in its state dir (0600)."""
        path = self.layout.state_dir / name
        if not path.exists():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(50))
        return path.read_text().strip()

    def _secret_key(self) -> str:
        # The task-signing pair too (made once): every process's settings name it (layout).
        write_keys(self.layout.signing_dir)
        return self._state_secret("secret_key")

    @property
    def admin_token(self) -> str:
        """The operators' token (``AENV_ADMIN_TOKEN``): ``GET /nodes`` shows every figure with it."""
        return self._state_secret("admin_token")

    @property
    def api_key(self) -> str:
        return (self.layout.control_home / "api_key").read_text().strip()

    def sdk_env(self) -> dict[str, str]:
        """What the E2B SDK needs to use this cluster."""
        return {"E2B_API_URL": self.layout.api_url, "E2B_SANDBOX_URL": self.layout.sandbox_url,
                "E2B_API_KEY": self.api_key}

    def _check_same_layout(self) -> None:
        if not self._layout_file.exists():
            return
        saved = json.loads(self._layout_file.read_text())
        if saved.get("nodes") != self.layout.nodes and self._running():
            raise ClusterError(f"the cluster in {self.layout.state_dir} is up with {saved.get('nodes')} node(s); "
                               "take it down first (scripts/cluster.sh down)")

    def _running(self) -> list[str]:
        names = [*CONTROL, *(self._node_proc(n) for n in self._saved_nodes())]
        return [n for n in names if self.procs.pid(n) is not None]

    def _saved_nodes(self) -> list[NodeLayout]:
        """The nodes of the cluster as it was brought up (``down`` after ``up 5`` takes all five)."""
        if self._layout_file.exists():
            count = json.loads(self._layout_file.read_text()).get("nodes", self.layout.nodes)
            return [self.layout.node(i) for i in range(1, max(count, self.layout.nodes) + 1)]
        return self.layout.all_nodes

    @staticmethod
    def _node_proc(node: NodeLayout) -> str:
        return f"node-{node.index}"

    # -- up ---------------------------------------------------------------------------------------

    def up(self, wait: float = 180) -> dict:
        require_root()
        layout = self.layout
        layout.state_dir.mkdir(parents=True, exist_ok=True)
        self._check_same_layout()
        self._layout_file.write_text(json.dumps({k: str(v) if isinstance(v, Path) else v
                                                 for k, v in asdict(layout).items() if k != "extra_env"}, indent=2))
        key = self._secret_key()
        self._database()
        self.manage("migrate", "--noinput", "-v", "0")
        self.manage("bootstrap")
        self._ensure_api_key()
        self._network()
        self._guest_images(key)
        deny = hostnet.root_addresses()
        for node in layout.all_nodes:
            node.home.mkdir(parents=True, exist_ok=True)
            self.procs.start(Spec(self._node_proc(node), (self.python, "manage.py", "run_node"),
                                  self._env(node.env(key, deny, self._join_token(node))), netns=node.netns))
        control = self._env({**layout.control_env(key), "AENV_ADMIN_TOKEN": self.admin_token})
        self.procs.start(Spec("sweeper", (self.python, "manage.py", "run_lifecycle"), control))
        self.procs.start(Spec("api", (self.python, "-m", "daphne", "-b", "127.0.0.1", "-p", str(layout.api_port),
                                      "config.asgi:application"), control))
        self.procs.start(Spec("dataplane", (self.python, "-m", "dataplane.serve", "--host", "127.0.0.1",
                                            "--port", str(layout.dataplane_port),
                                            "--", "--no-access-log", "--timeout-keep-alive", "300"), control))
        self._wait_ready(wait)
        return self.status()

    def _join_token(self, node: NodeLayout) -> str:
        """A fresh single-use token for the node's id, as an operator would issue it: spent if
        the node has no credential yet (or one the database no longer knows), else unused
        until it expires within the hour."""
        return self.manage("node_tokens", "create", "--node-id", node.node_id, "--ttl", "1h").strip()

    def _env(self, settings: dict) -> dict:
        """The process environment: the caller's, without what the cluster decides itself."""
        base = {k: v for k, v in os.environ.items()
                if not k.startswith(("E2B_", "CELERY_")) and k not in ("DATABASE_URL", "AENV_CHANNEL_LAYER_URL")}
        return {**base, **settings}

    def manage(self, *args: str, timeout: float = 600) -> str:
        """``manage.py`` with the control plane's settings (its database); stdout."""
        env = self._env(self.layout.control_env(self._secret_key()))
        done = subprocess.run([self.python, "manage.py", *args], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=timeout)
        if done.returncode != 0:
            raise ClusterError(f"manage.py {' '.join(args)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        return done.stdout

    def _ensure_api_key(self) -> None:
        """bootstrap writes the key file only when it makes the team's first key (a database
        kept while var/cluster was removed has one): then a new key for the file."""
        path = self.layout.control_home / "api_key"
        if path.exists():
            return
        raw = self.manage("create_api_key", "--team", "default", "--name", "cluster").strip().split("=", 1)[1]
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(raw + "\n")

    def _pg(self):
        import psycopg  # noqa: PLC0415 - only where the database is made or dropped

        try:
            return psycopg.connect(host="127.0.0.1", port=self.layout.pg_port, user=self.layout.pg_user,
                                   dbname="postgres", autocommit=True, connect_timeout=10)
        except psycopg.OperationalError as exc:
            raise ClusterError(f"PostgreSQL at 127.0.0.1:{self.layout.pg_port} (user {self.layout.pg_user}): {exc}. "
                               "The cluster needs it running there with trust for local TCP") from None

    def _database(self) -> None:
        with self._pg() as conn:
            if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (self.layout.database,)).fetchone():
                return
            self.progress(f"creating database {self.layout.database}")
            conn.execute(f'CREATE DATABASE "{self.layout.database}"')

    def _network(self) -> None:
        layout = self.layout
        dev = hostnet.uplink()
        hostnet.install_table(layout, dev)
        for node in layout.all_nodes:
            if hostnet.ensure_node(node):
                self.progress(f"{node.netns}: namespace, link {node.gateway_ip} <-> {node.address}, "
                              f"slots {node.pool}")
        if dev:
            hostnet.UplinkForwarding().enable(dev)

    def _guest_images(self, key: str) -> None:
        """The base image and its booted template (2 vCPU / 512 MiB), cached in the shared
        images dir; the template is captured in node 1's namespace and network instance."""
        node = self.layout.node(1)
        env = self._env(node.env(key, hostnet.root_addresses()))
        for argv in ([self.python, "-m", "vmm.images", "build", "--name", "base", "--images-dir",
                      str(self.layout.images_dir)],
                     hostnet.in_netns(node.netns, self.python, "-m", "vmm.templates", "build", "--image", "base",
                                      "--cpu", "2", "--memory", "512", "--disk", "2048", "--images-dir",
                                      str(self.layout.images_dir))):
            done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
            if done.returncode != 0:
                raise ClusterError(f"{' '.join(argv[-10:])} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")

    def _wait_ready(self, wait: float) -> None:
        deadline = time.monotonic() + wait
        expected = {n.node_id for n in self.layout.all_nodes}
        while True:
            dead = [n for n in (*CONTROL, *(self._node_proc(n) for n in self.layout.all_nodes))
                    if self.procs.pid(n) is None]
            if dead:
                raise ClusterError(f"{', '.join(dead)} exited; see {self.procs.logs_dir}:\n"
                                   + self._tail(self.procs.log_path(dead[0])))
            ready = {n["id"] for n in self.nodes() or [] if n.get("status") == "ready"}
            if expected <= ready and _listening(self.layout.dataplane_port):
                return
            if time.monotonic() > deadline:
                raise ClusterError(f"not ready after {wait:.0f} s (nodes ready: {sorted(ready)}); "
                                   f"see {self.procs.logs_dir}")
            time.sleep(0.5)

    @staticmethod
    def _tail(path: Path) -> str:
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    # -- looking ----------------------------------------------------------------------------------

    def nodes(self) -> list[dict] | None:
        """``GET /nodes`` (None while the API does not answer)."""
        try:
            answer = httpx.get(f"{self.layout.api_url}/nodes", timeout=5,
                               headers={"X-API-Key": self.api_key, "X-Admin-Token": self.admin_token})
        except (httpx.HTTPError, OSError):
            return None
        return answer.json() if answer.status_code == 200 else None

    def status(self) -> dict:
        nodes = self._saved_nodes()
        return {
            "processes": {name: self.procs.pid(name) for name in (*CONTROL, *(self._node_proc(n) for n in nodes))},
            "namespaces": {n.netns: n.netns in hostnet.namespaces() for n in nodes},
            "nodes": self.nodes() if self.procs.pid("api") else None,
            "api": self.layout.api_url, "dataplane": self.layout.sandbox_url,
        }

    # -- down -------------------------------------------------------------------------------------

    def down(self, purge: bool = False, node_timeout: float | None = None) -> None:
        """Node workers first (SIGTERM: each pauses its running sandboxes to disk, so the
        database and broker must still be reachable), then the control plane, VMs left over,
        each node's network instance, the namespaces, the root table. ``purge``: the
        database, the Redis databases and the state dir too."""
        require_root()
        nodes = self._saved_nodes()
        if node_timeout is None:
            node_timeout = float(os.environ.get("AENV_NODE_STOP_TIMEOUT", "300")) + 30
        running = [self._node_proc(n) for n in nodes if self.procs.pid(self._node_proc(n))]
        if running:
            self.progress(f"stopping {', '.join(running)} (pausing their running sandboxes to disk)")
        self.procs.stop([self._node_proc(n) for n in nodes], node_timeout, self.progress)
        self.procs.stop(list(CONTROL), 15, self.progress)
        for node in nodes:
            killed = kill_vms(node.home)
            if killed:
                self.progress(f"{node.node_id}: killed {killed} VM(s) left running")
            if node.netns in hostnet.namespaces():
                self._remove_instance(node)
            hostnet.remove_node(node)
        hostnet.remove_table(self.layout)
        hostnet.UplinkForwarding().restore(self.layout)
        if purge:
            self._purge()

    def _remove_instance(self, node: NodeLayout) -> None:
        """The node's slots, nftables table and resolver, removed from inside its namespace."""
        code = ("import sys; from vmm.net.netns import remove_instance; "
                "print(remove_instance(sys.argv[1], sys.argv[2], sys.argv[3]))")
        subprocess.run(hostnet.in_netns(node.netns, self.python, "-c", code, node.net_prefix, node.pool,
                                        str(node.home)), cwd=ROOT, capture_output=True, text=True, timeout=120)

    def _purge(self) -> None:
        import redis  # noqa: PLC0415

        from nodes.db_roles import role_name  # noqa: PLC0415

        with self._pg() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.layout.database}" WITH (FORCE)')
            for node in self.layout.all_nodes:  # the nodes' roles (their rights went with the database)
                conn.execute(f'DROP ROLE IF EXISTS "{role_name(node.node_id)}"')
        for db in range(self.layout.redis_db, self.layout.redis_db + 3):
            redis.Redis(host="127.0.0.1", port=self.layout.redis_port, db=db).flushdb()
        shutil.rmtree(self.layout.state_dir, ignore_errors=True)


def kill_vms(home: Path) -> int:
    """SIGKILLs the QEMU processes of a node home (daemonized: in no process group of ours)."""
    killed = 0
    for pid in qemu_pids(f"{home}/"):
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except ProcessLookupError:
            pass
    return killed


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0

