"""A node dies (its worker and its VMs SIGKILLed), with the S3 store (a moto server): its
heartbeat stops, so it is dead after AENV_NODE_LOST_AFTER and the sweeper declares its
running sandbox lost (error, with a ``lost`` event); its paused sandbox, whose pause was
exported to the store, resumes on the other node with its memory (the same process, still
counting) and its files. When the dead node comes back it removes its stale copy."""
from __future__ import annotations

import os
import signal
import time
import uuid

import pytest
from e2b import Sandbox

from harness.moto_s3 import CREDENTIALS, moto_server

from .conftest import running_stack
from .guest_counter import read_counter, start_counter
from harness.second_node import SecondNode, short_root  # noqa: F401 - a fixture

pytestmark = [pytest.mark.vm, pytest.mark.timeout(900)]

BUCKET = "aenv-death"


@pytest.fixture(scope="module")
def death_stack():
    with moto_server(BUCKET) as url:
        env = {"AENV_SNAPSHOT_BACKEND": "s3", "AENV_S3_ENDPOINT": url, "AENV_S3_BUCKET": BUCKET,
               "AENV_S3_REGION": "us-east-1", "AENV_S3_PREFIX": f"d-{uuid.uuid4().hex[:6]}", **CREDENTIALS,
               "AENV_NODE_HEARTBEAT_INTERVAL": "1", "AENV_NODE_HEARTBEAT_TIMEOUT": "5",
               "AENV_NODE_LOST_AFTER": "10", "AENV_PAUSE_EXPORT_DELAY": "0.5"}
        with running_stack("death", extra_env=env) as s:
            yield s


def _row(stack, sandbox_id: str, field: str) -> str:
    return stack.db(f"from sandboxes.models import Sandbox as S; print(S.objects.get(pk='{sandbox_id}').{field})").strip()


def _drain(stack, node_id: str, on: bool) -> None:
    stack.db(f"from nodes.models import Node; Node.objects.filter(pk='{node_id}').update(draining={on})")


def test_a_dead_nodes_running_sandbox_is_lost_and_its_paused_one_moves(death_stack, short_root, monkeypatch):
    stack = death_stack
    for key, value in (("E2B_API_URL", stack.api_url), ("E2B_SANDBOX_URL", stack.sandbox_url),
                       ("E2B_API_KEY", stack.api_key)):
        monkeypatch.setenv(key, value)
    node_b = SecondNode(stack, short_root)
    try:
        _drain(stack, node_b.id, True)  # both sandboxes on node A
        running = Sandbox.create(timeout=600)
        paused = Sandbox.create(timeout=600)
        _drain(stack, node_b.id, False)
        assert {_row(stack, s.sandbox_id, "node_id") for s in (running, paused)} == {stack.node_id}
        paused.files.write("/home/user/keep.txt", "kept across nodes")
        pid, _ = start_counter(paused)
        paused.pause()
        deadline = time.monotonic() + 120
        while _row(stack, paused.sandbox_id, "pause_image_at") == "None":  # exported to the store
            assert time.monotonic() < deadline, stack.log("node")
            time.sleep(0.5)

        # node A dies: its worker and every VM of its home, at once
        stack.kill_node()
        for qemu in stack.qemu_pids(running.sandbox_id):
            os.kill(qemu, signal.SIGKILL)
        deadline = time.monotonic() + 90
        while _row(stack, running.sandbox_id, "state") != "error":
            assert time.monotonic() < deadline, stack.log("lifecycle")
            time.sleep(1)
        assert _row(stack, running.sandbox_id, "error_reason").startswith(f"lost: node {stack.node_id}")
        lost_events = stack.db("from sandboxes.models import SandboxEvent as E; "
                               f"print(E.objects.filter(sandbox_id='{running.sandbox_id}', operation='lost').count())")
        assert lost_events.strip() == "1"
        assert _row(stack, paused.sandbox_id, "state") == "paused"  # its files outlive its node

        back = Sandbox.connect(paused.sandbox_id, timeout=300)
        assert _row(stack, paused.sandbox_id, "node_id") == node_b.id
        # from lazily filled files (AENV_LAZY_RESTORE), not a whole download of its pause image
        image = f"pause-{paused.sandbox_id}"[:64]
        assert (node_b.home / "lazy" / "snapshots" / image / "manifest.json").is_file()
        assert not (node_b.home / "cache" / "snapshots" / image).exists()
        assert back.files.read("/home/user/keep.txt") == "kept across nodes"
        now_pid, n1 = read_counter(back)
        assert now_pid == pid  # its memory came along: the same process
        time.sleep(0.6)
        assert read_counter(back)[1] > n1

        stack.start_node()  # node A returns: its copy of the moved sandbox goes
        deadline = time.monotonic() + 60
        while (stack.home / "sandboxes" / paused.sandbox_id).exists():
            assert time.monotonic() < deadline, stack.log("node")
            time.sleep(0.5)
        assert "runs on node" in stack.new_log("node")
        back.kill()
    finally:
        node_b.stop()
