"""A second node worker beside a test stack's own: its own AENV_HOME, images dir (the base
image hard-linked in: every node builds the same base itself) and network instance, the
same database and broker, joined with a join token at the stack's API — another "machine"
for cross-node tests."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid

import pytest

from vmm.images import find_image

from harness.stack import PY, ROOT, shared_images_dir, stop_chunkfs


class SecondNode:
    """Node B of the stack: a node worker with a home, images dir and network instance of
    its own (the base image hard-linked in: every node builds the same base itself).

    More nodes beside it (bench/lazy.py): ``name`` (``b``, ``c``, ...) names its id, dirs and
    network prefix, ``net_pool`` a slot pool of the caller's (default: the upper half of the
    stack's /20, node B's), ``extra_env`` adds settings, and ``base_disk=False`` leaves the
    base build's root disk out of its images dir (kernel, initrd and tools drive stay): a node
    that has never seen that disk, so a snapshot running on it brings it from the store."""

    def __init__(self, stack, root, *, name: str = "b", net_pool: str | None = None,
                 extra_env: dict | None = None, base_disk: bool = True):
        self.stack, self.name, self.id = stack, name, f"{name}-{uuid.uuid4().hex[:6]}"
        self.home, self.images = root / f"home-{name}", root / f"images-{name}"
        self.home.mkdir(parents=True)
        self.images.mkdir(parents=True)
        base = find_image(shared_images_dir(), "base")
        build = base.kernel.parent
        subprocess.run(["cp", "-al", str(build), str(self.images / build.name)], check=True)
        if not base_disk:
            (self.images / build.name / base.rootfs.name).unlink()  # a hard link: the shared one stays
        (self.images / "base").symlink_to(build.name)
        for extra in ("accel.json",):
            if (shared_images_dir() / extra).exists():
                shutil.copy(shared_images_dir() / extra, self.images / extra)
        first, second = stack.net_pool.split(".")[:2]
        third = int(stack.net_pool.split(".")[2]) + 8  # the upper half of the stack's /20
        self.env = {**stack.env, **(extra_env or {}), "AENV_HOME": str(self.home),
                    "AENV_IMAGES_DIR": str(self.images), "AENV_NODE_ID": self.id,
                    "AENV_NET_PREFIX": f"{stack.net_prefix}{self.name}",
                    "AENV_NET_POOL": net_pool or f"{first}.{second}.{third}.0/21",
                    # the stack's database: its SQLite file unless it was given another
                    "DATABASE_URL": stack.env.get("DATABASE_URL") or f"sqlite:///{stack.home / 'db.sqlite3'}",
                    # one DJANGO_SECRET_KEY per deployment: it opens the task secrets the stack seals
                    "DJANGO_SECRET_KEY": (stack.home / "secret_key").read_text().strip(),
                    # another machine joins with an operator's token for its id (nodes.join)
                    "AENV_CONTROL_PLANE_URL": stack.api_url,
                    "AENV_NODE_JOIN_TOKEN": stack.manage("node_tokens", "create", "--node-id", self.id,
                                                         "--ttl", "1h").strip()}
        self.log = open(self.home / "node.log", "ab")
        self.start()

    def start(self) -> None:
        """Its node worker started (again: the same id, home and settings), once it says ready."""
        offset = self.log.tell()
        self.proc = subprocess.Popen([PY, "manage.py", "run_node"], cwd=ROOT, env=self.env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while b"ready." not in (self.home / "node.log").read_bytes()[offset:]:
            assert self.proc.poll() is None and time.monotonic() < deadline, (self.home / "node.log").read_text()
            time.sleep(0.5)

    def kill9(self) -> None:
        """Its node worker killed as a crash kills it (its VMs run on)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(timeout=10)

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            self.proc.wait(timeout=30)
        subprocess.run(["pkill", "-9", "-f", str(self.home)], check=False)  # its chunkfs daemon too
        stop_chunkfs(self.home)  # ... whose FUSE mount stays behind
        from vmm.net import slots  # noqa: PLC0415

        if slots.netns_supported():
            from vmm.net.netns import remove_instance  # noqa: PLC0415

            remove_instance(self.env["AENV_NET_PREFIX"], self.env["AENV_NET_POOL"], self.home)


@pytest.fixture
def short_root():
    """Unix socket paths (QMP) must stay under 108 bytes: not pytest's deep tmp dirs."""
    root = ROOT / "var" / "test-runs" / f"xn-{uuid.uuid4().hex[:6]}"
    root.mkdir(parents=True)
    yield root
    shutil.rmtree(root, ignore_errors=True)
