"""A fork across nodes with the early hand-off, end to end (issue 24): a stack on the S3 store (a
moto server) with peer fetch on every node, node B without the base disk, AENV_FORK_MAX_PER_NODE=2.
A fork ×4 through the official SDK: node A hands its capture over before the upload
(``index_snapshot``), node B restores its two children from the pending manifest reading the
capture (and the base disk) from node A, and the fork answers. Every child has the parent's
file and its running process; node B's chunks came from node A; the upload ends after the answer
(the parent's ``stored`` event), its pending manifest goes, and once the children are gone the
capture leaves the bucket. (The hand-off's failures: tests/unit/test_fork_spread.py; node A's
side with real VMs: tests/vmm/test_fork_handoff_vm.py.)"""
from __future__ import annotations

import json
import time
import uuid

import pytest

from harness.guest_counter import read_counter
from harness.moto_s3 import CREDENTIALS, moto_server
from harness.moto_s3 import client as s3_client
from harness.second_node import SecondNode, short_root  # noqa: F401 - a fixture

from .conftest import running_stack
from .fork_across import db, fork_four, parent_on_node_a

pytestmark = [pytest.mark.vm, pytest.mark.timeout(900)]

BUCKET = "aenv-handoff"


@pytest.fixture(scope="module")
def handoff_stack():
    with moto_server(BUCKET) as url:
        prefix = f"ho-{uuid.uuid4().hex[:6]}"
        env = {"AENV_SNAPSHOT_BACKEND": "s3", "AENV_S3_ENDPOINT": url, "AENV_S3_BUCKET": BUCKET,
               "AENV_S3_REGION": "us-east-1", "AENV_S3_PREFIX": prefix, **CREDENTIALS,
               "AENV_FORK_MAX_PER_NODE": "2", "AENV_NODE_HEARTBEAT_INTERVAL": "1",
               # every node of this machine serves its chunks on a port of its own
               "AENV_CHUNK_PEER_FETCH": "1", "AENV_CHUNK_PEER_PORT": "0"}
        with running_stack("handoff", extra_env=env) as s:
            s.s3 = (url, prefix)
            yield s


def _until(what: str, check, timeout: float, stack) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what}:\n{stack.log('node')[-3000:]}"
        time.sleep(1)


def _host(stack, node_id: str) -> dict:
    return json.loads(db(stack, f"import json; from nodes.models import Node; "
                                f"print(json.dumps(Node.objects.get(pk='{node_id}').host))"))


def _fork_outcomes(stack, parent_id: str) -> list[str]:
    return db(stack, "from sandboxes.models import SandboxEvent as E; "
                     f"print(' '.join(E.objects.filter(sandbox_id='{parent_id}', operation='fork')"
                     ".order_by('id').values_list('outcome', flat=True)))").split()


def _keys(stack, sub: str) -> list[str]:
    url, prefix = stack.s3
    pages = s3_client(url).get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"{prefix}/{sub}")
    return [o["Key"][len(prefix) + 1:] for page in pages for o in page.get("Contents", [])]


def test_a_fork_hands_its_capture_to_the_other_node_before_the_upload(handoff_stack, short_root, monkeypatch):
    stack = handoff_stack
    for key, value in (("E2B_API_URL", stack.api_url), ("E2B_SANDBOX_URL", stack.sandbox_url),
                       ("E2B_API_KEY", stack.api_key)):
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("E2B_DEBUG", raising=False)
    node_b = SecondNode(stack, short_root, base_disk=False)
    parent, children = None, []
    try:
        for node in (stack.node_id, node_b.id):  # both say they take a hand-off (peer fetch serving)
            _until(f"node {node} to say forkHandoff", lambda n=node: _host(stack, n).get("forkHandoff") is True,
                   60, stack)
        parent, pid = parent_on_node_a(stack, node_b.id)
        children, where, fork_s = fork_four(stack, parent, node_b.id)
        outcomes = _fork_outcomes(stack, parent.sandbox_id)
        assert outcomes[:3] == ["started", "ok", "handed_over"], outcomes
        print(f"\nFORK x4 with the hand-off: {fork_s * 1000:.0f} ms until the API answered; events {outcomes}")
        for c in children:
            assert c.files.read("/home/user/state.txt") == "from the parent"
            assert read_counter(c)[0] == pid, "the child's counter was restarted, not forked"
        # node B read the capture (and the base disk it lacks) from node A
        _until("node B's chunk figures to show chunks from node A",
               lambda: (_host(stack, node_b.id).get("chunkCache") or {}).get("peerChunks", 0) > 0, 30, stack)
        # the upload ends after the answer; then the bucket holds the capture, no longer pending
        _until("the capture's upload to end", lambda: _fork_outcomes(stack, parent.sandbox_id)[-1] == "stored",
               300, stack)
        capture = db(stack, "from snapshots.models import Snapshot as S; print(S.objects.get(fork_capture=True).id)")
        keys = _keys(stack, f"snapshots/{capture}/")
        assert f"snapshots/{capture}/manifest.json" in keys and f"snapshots/{capture}/pending.json" not in keys
        remote = [c for c in children if where[c.sandbox_id] == node_b.id]
        assert remote[0].commands.run("echo alive").stdout.strip() == "alive"

        for c in children:
            c.kill()
        children = []
        parent.kill()
        parent = None
        _until("the sweeper to release the capture", lambda: not _keys(stack, f"snapshots/{capture}/"), 90, stack)
    finally:
        for c in children:
            c.kill()
        if parent is not None:
            parent.kill()
        node_b.stop()
