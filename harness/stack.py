"""Starts a real aenv stack for end-to-end tests: daphne (API), uvicorn (data plane),
optionally a node worker booting real QEMU VMs, the lifecycle sweeper and the events worker
(webhook deliveries), each in its own process group, sharing a fresh AENV_HOME (SQLite) and
the cached guest images."""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path

import httpx

from cluster.processes import qemu_pids
from volumes.image import unmount_under

from harness.networld import EXT_A, EXT_B
from harness.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
# The stacks' operators' token (AENV_ADMIN_TOKEN): what GET /nodes needs to show every figure.
ADMIN_TOKEN = "test-operators-" + uuid.uuid4().hex


def shared_images_dir() -> Path:
    return Path(os.environ.get("AENV_IMAGES_DIR") or ROOT / "var" / "images").resolve()


_NET_INSTANCES = count(1)


@dataclass
class Stack:
    home: Path
    with_node: bool = True
    with_lifecycle: bool = True
    # manage.py run_events_worker (webhook deliveries, as scripts/up.sh starts it): off unless a
    # test delivers webhooks, one process less on a 2-core machine for every other stack.
    with_events: bool = False
    extra_env: dict = field(default_factory=dict)
    procs: dict = field(default_factory=dict)
    log_offsets: dict = field(default_factory=dict)
    api_url: str = ""
    sandbox_url: str = ""
    api_key: str = ""
    node_id: str = ""

    net_instance: int = field(default_factory=lambda: next(_NET_INSTANCES))

    @property
    def net_prefix(self) -> str:
        """Each stack is a network instance of its own (slots, table, resolver, addresses),
        inside the test session's (tests/conftest.py)."""
        return f"{os.environ.get('AENV_NET_PREFIX', 'aenvt')}s{self.net_instance}"

    @property
    def net_pool(self) -> str:
        """A /20 of the session's /16 after the session's own first /20 (15 stacks)."""
        first, second = os.environ.get("AENV_NET_POOL", "10.13.0.0/20").split(".")[:2]
        return f"{first}.{second}.{16 * (1 + (self.net_instance - 1) % 15)}.0/20"

    @property
    def webhook_queue(self) -> str:
        return f"control.events-{self.home.name}"

    def shutdown(self) -> None:
        """Everything the stack started, gone: its processes, VMs left running, its webhook
        queue and its network instance (slots, nftables table, resolver). Its home stays
        (callers decide)."""
        self.stop()
        if self.with_events:
            self.drop_webhook_queue()
        self.kill_vm_leftovers()
        stop_chunkfs(self.home)
        unmount_under(self.home)  # volumes with a limit: their filesystems (volumes.image)
        self.remove_network()

    def drop_webhook_queue(self) -> None:
        """The stack's webhook queue out of the shared broker (tasks left when it stopped)."""
        import redis  # noqa: PLC0415 - the broker's client, only for stacks that used it

        from nodes.celery_app import app  # noqa: PLC0415 - the broker URL the stack's processes use

        try:
            redis.Redis.from_url(app.conf.broker_url).delete(self.webhook_queue)
        except redis.RedisError:
            pass  # a broker that is gone took the queue with it

    def events_alive(self) -> bool:
        """The events worker runs (a test that waits for a delivery says why it saw none)."""
        proc = self.procs.get("events")
        return proc is not None and proc.poll() is None

    def remove_network(self) -> None:
        """Once its VMs are gone: the stack's slots, nftables table and resolver."""
        from vmm.net import slots  # noqa: PLC0415

        if slots.netns_supported():
            from vmm.net.netns import remove_instance  # noqa: PLC0415

            remove_instance(self.net_prefix, self.net_pool, self.home)

    @property
    def env(self) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_") and k != "DATABASE_URL"}
        env.update(
            AENV_HOME=str(self.home),
            AENV_IMAGES_DIR=str(shared_images_dir()),
            AENV_NODE_ID=self.node_id,
            AENV_NET_PREFIX=self.net_prefix,
            AENV_NET_POOL=self.net_pool,
            AENV_PRIVATE_REGISTRIES="127.0.0.1",  # the tests' own registries (harness/oci_registry.py)
            # the test world's external hosts sit in TEST-NET-2, always denied: opened as an
            # operator opens a mirror (networld.py)
            AENV_NET_ALLOW_EXTRA=f"{EXT_A}/32,{EXT_B}/32",
            AENV_ADMIN_TOKEN=ADMIN_TOKEN,
            # signed node tasks (nodes.signing): the stack's key pair, made at start; a second
            # node (harness.second_node) inherits it as another machine is given the certificate
            AENV_TASK_SIGNING_DIR=str(self.home / "task-signing"),
            # the control plane's webhook queue, the stack's own: stacks share the broker, and
            # one stack's events worker must not take (and lose) another's deliveries
            AENV_WEBHOOK_QUEUE=self.webhook_queue,
            DJANGO_SETTINGS_MODULE="config.settings",
            PYTHONUNBUFFERED="1",
        )
        if self.api_url:  # where the node asks for secret values and egressProxy passwords
            env["AENV_API_PUBLIC_URL"] = self.api_url
        env.update(self.extra_env)
        return env

    def manage(self, *args: str, timeout: float = 600) -> str:
        out = subprocess.run(
            [PY, "manage.py", *args], cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if out.returncode != 0:
            raise RuntimeError(f"manage.py {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}")
        return out.stdout

    def _spawn(self, name: str, argv: list[str]) -> None:
        path = self.home / f"{name}.log"
        self.log_offsets[name] = path.stat().st_size if path.exists() else 0
        log = open(self.home / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen(
            argv, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def new_log(self, name: str) -> str:
        """What the current process of ``name`` has logged (after its latest start)."""
        path = self.home / f"{name}.log"
        if not path.exists():
            return ""
        with open(path, "rb") as f:
            f.seek(self.log_offsets.get(name, 0))
            return f.read().decode(errors="replace")

    def log(self, name: str) -> str:
        path = self.home / f"{name}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def start(self) -> "Stack":
        self.home.mkdir(parents=True, exist_ok=True)
        self.node_id = self.node_id or f"test-{uuid.uuid4().hex[:8]}"
        if self.with_node:
            subprocess.run(
                [PY, "-m", "vmm.images", "build", "--name", "base", "--images-dir", str(shared_images_dir())],
                cwd=ROOT, env=self.env, check=True, timeout=1800,
            )
        self.manage("migrate", "--noinput", "-v", "0")
        self.manage("task_signing_keys")  # every test stack runs signed, as the single-machine default does
        out = self.manage("bootstrap")
        match = re.search(r"AENV_API_KEY=(e2b_[0-9a-f]+)", out)
        self.api_key = match.group(1) if match else (self.home / "api_key").read_text().strip()
        api_port, sandbox_port = free_port(), free_port()
        self.api_url = f"http://127.0.0.1:{api_port}"
        self.sandbox_url = f"http://127.0.0.1:{sandbox_port}"
        if self.with_node:
            self.start_node(wait=False)
        if self.with_lifecycle:
            self._spawn("lifecycle", [PY, "manage.py", "run_lifecycle"])
        if self.with_events:
            self._spawn("events", [PY, "manage.py", "run_events_worker", "--concurrency", "2",
                                   "--loglevel", "WARNING"])
        self._spawn("api", [PY, "-m", "daphne", "-b", "127.0.0.1", "-p", str(api_port), "config.asgi:application"])
        self._spawn("dataplane", [
            PY, "-m", "dataplane.serve", "--host", "127.0.0.1", "--port", str(sandbox_port),
            "--", "--no-access-log", "--timeout-keep-alive", "300",
        ])
        self._wait_http(f"{self.api_url}/health", "api")
        self._wait_port(sandbox_port, "dataplane")
        if self.with_node:
            self._wait_node()
        return self

    def start_node(self, wait: bool = True) -> None:
        """(Re)starts the node worker, e.g. after a test killed it."""
        self._spawn("node", [PY, "manage.py", "run_node"])
        if wait:
            self._wait_node(fresh=True)

    def restart_lifecycle(self, deadline: float = 60) -> None:
        """The lifecycle sweeper stopped and started again with the stack's settings as they
        are now (``extra_env``: a test's retention or period, then the stack's own again), until
        the new one says it runs. Seconds, where a stack of its own takes ~20 to start and stop."""
        self.stop("lifecycle")
        self._spawn("lifecycle", [PY, "manage.py", "run_lifecycle"])
        end = time.monotonic() + deadline
        while "lifecycle sweeper running" not in self.new_log("lifecycle"):
            self._check_alive("lifecycle")
            if time.monotonic() > end:
                raise RuntimeError(f"the lifecycle sweeper did not start:\n{self.log('lifecycle')}")
            time.sleep(0.2)

    def kill_node(self) -> None:
        """SIGKILLs the node worker's process group, as a crash would (its VMs run on)."""
        proc = self.procs.pop("node", None)
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def _wait_http(self, url: str, name: str, deadline: float = 60) -> None:
        end = time.monotonic() + deadline
        while time.monotonic() < end:
            try:
                if httpx.get(url, timeout=2).status_code < 500:
                    return
            except httpx.HTTPError:
                pass
            self._check_alive(name)
            time.sleep(0.2)
        raise RuntimeError(f"{name} did not answer {url}:\n{self.log(name)}")

    def _wait_port(self, port: int, name: str, deadline: float = 60) -> None:
        end = time.monotonic() + deadline
        while time.monotonic() < end:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return
            self._check_alive(name)
            time.sleep(0.2)
        raise RuntimeError(f"{name} did not listen on {port}:\n{self.log(name)}")

    def _wait_node(self, deadline: float = 120, fresh: bool = False) -> None:
        """Until the node is alive; ``fresh``: until this worker (not a killed one, whose
        last heartbeat may still count) has registered and started consuming."""
        end = time.monotonic() + deadline
        while time.monotonic() < end:
            self._check_alive("node")
            out = subprocess.run([PY, "manage.py", "node_status", "--quiet"], cwd=ROOT, env=self.env)
            if out.returncode == 0 and (not fresh or " ready." in self.new_log("node")):
                return
            time.sleep(0.5)
        raise RuntimeError(f"node worker did not register:\n{self.log('node')}")

    def _check_alive(self, name: str) -> None:
        proc = self.procs.get(name)
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log(name)}")

    def stop(self, name: str | None = None, timeout: float = 15) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` s (a node worker pauses its sandboxes first)."""
        names = [name] if name else list(self.procs)
        for n in names:
            proc = self.procs.pop(n, None)
            if proc is None or proc.poll() is not None:
                continue
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)

    def headers(self) -> dict:
        return {"X-API-Key": self.api_key}

    @property
    def admin_token(self) -> str:
        return ADMIN_TOKEN

    def admin_headers(self) -> dict:
        """The operators' view (``GET /nodes`` with every figure): the key and the stack's
        ``AENV_ADMIN_TOKEN``."""
        return {**self.headers(), "X-Admin-Token": self.admin_token}

    def vm_leftovers(self) -> dict:
        """QEMU processes, sandbox state dirs and RAM files that belong to this stack's home."""
        procs = qemu_pids(str(self.home))
        sandboxes_dir = self.home / "sandboxes"
        dirs = sorted(p.name for p in sandboxes_dir.iterdir()) if sandboxes_dir.exists() else []
        return {"processes": procs, "state_dirs": dirs}

    def kill_vm_leftovers(self) -> None:
        for pid in self.vm_leftovers()["processes"]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def db(self, code: str) -> str:
        """Runs Python in `manage.py shell` against this stack's database; returns stdout."""
        return self.manage("shell", "-v", "0", "-c", code, timeout=120)

    def qemu_pids(self, sandbox_id: str) -> list[int]:
        """This stack's QEMU processes of one sandbox."""
        return qemu_pids(str(self.home), sandbox_id)


@contextmanager
def running_stack(prefix: str = "e2e", **kwargs):
    """A started Stack (``kwargs`` go to Stack) under a fresh home in var/test-runs; stopped,
    its VMs killed and its home removed after (kept with AENV_KEEP_TEST_HOME)."""
    home = ROOT / "var" / "test-runs" / f"{prefix}-{uuid.uuid4().hex[:8]}"
    s = Stack(home=home, **kwargs)
    with started(s, s.shutdown, home):
        yield s


@contextmanager
def started(thing, stop, home: Path):
    """``thing`` started (its ``start()``) for the block; after it (also when starting failed),
    ``stop()`` and ``thing``'s ``home`` removed (see remove_test_home)."""
    try:
        thing.start()
        yield thing
    finally:
        stop()
        remove_test_home(home)


def remove_test_home(home: Path) -> None:
    """A test run's home removed, unless AENV_KEEP_TEST_HOME asks to keep it (a failure's trail)."""
    if not os.environ.get("AENV_KEEP_TEST_HOME"):
        shutil.rmtree(home, ignore_errors=True)


def stop_chunkfs(home: Path, timeout: float = 15) -> None:
    """A node home's chunkfs daemon (lazy restores, agent.stores.lazy: started in a session of
    its own, so stopping the node leaves it running) stopped and its FUSE mount gone: call once
    the home's VMs are, or its directory cannot be removed."""
    run_dir = Path(home) / "chunkfs"
    try:
        pid = int((run_dir / "control.sock.pid").read_text().strip() or 0)
    except (OSError, ValueError):
        pid = 0
    try:
        ours = pid > 0 and str(run_dir) in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        ours = False  # gone already
    if ours:
        os.kill(pid, signal.SIGTERM)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                if Path(f"/proc/{pid}/stat").read_text(errors="replace").split()[2:3] == ["Z"]:
                    break  # ended (unreaped: it was started from this process)
            except OSError:
                break  # gone
            time.sleep(0.05)
    mnt = run_dir / "mnt"
    with open("/proc/self/mountinfo") as f:
        mounted = any(len(line.split()) > 4 and line.split()[4] == str(mnt) for line in f)
    if mounted:
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False, capture_output=True)
