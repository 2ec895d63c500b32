"""A fork larger than the parent's node may hold runs across nodes (issue 24 item 4), with real
VMs and the S3 store (a moto server): with AENV_FORK_MAX_PER_NODE=2 a fork ×4 through the
official SDK puts two children on the parent's node and two on node B, which restores them
lazily from the fork's stored capture. Every child has the parent's file and its running
process (the same pid, still counting); killing the parent leaves node B's children running;
once every child is gone the sweeper releases the capture (its row, node B's lazy mount)."""
from __future__ import annotations

import time
import uuid

import pytest
from e2b import Sandbox

from harness.moto_s3 import CREDENTIALS, moto_server

from .conftest import running_stack
from .guest_counter import read_counter, start_counter
from harness.second_node import SecondNode, short_root  # noqa: F401 - a fixture

pytestmark = [pytest.mark.vm, pytest.mark.timeout(900)]

BUCKET = "aenv-forkx"


@pytest.fixture(scope="module")
def forkx_stack():
    with moto_server(BUCKET) as url:
        env = {"AENV_SNAPSHOT_BACKEND": "s3", "AENV_S3_ENDPOINT": url, "AENV_S3_BUCKET": BUCKET,
               "AENV_S3_REGION": "us-east-1", "AENV_S3_PREFIX": f"fx-{uuid.uuid4().hex[:6]}", **CREDENTIALS,
               "AENV_FORK_MAX_PER_NODE": "2"}
        with running_stack("forkx", extra_env=env) as s:
            yield s


def _db(stack, code: str) -> str:
    return stack.db(code).strip()


def _nodes_of(stack, ids: list[str]) -> dict[str, str]:
    out = _db(stack, "from sandboxes.models import Sandbox as S; "
                     f"print(';'.join(f'{{s.id}}={{s.node_id}}' for s in S.objects.filter(pk__in={ids!r})))")
    return dict(pair.split("=") for pair in out.split(";") if pair)


def test_a_fork_of_four_with_two_a_node_spans_two_nodes(forkx_stack, short_root, monkeypatch):
    stack = forkx_stack
    for key, value in (("E2B_API_URL", stack.api_url), ("E2B_SANDBOX_URL", stack.sandbox_url),
                       ("E2B_API_KEY", stack.api_key)):
        monkeypatch.setenv(key, value)
    node_b = SecondNode(stack, short_root)
    parent, children = None, []
    try:
        _db(stack, f"from nodes.models import Node; Node.objects.filter(pk='{node_b.id}').update(draining=True)")
        parent = Sandbox.create(timeout=600)
        _db(stack, f"from nodes.models import Node; Node.objects.filter(pk='{node_b.id}').update(draining=False)")
        parent.files.write("/home/user/state.txt", "from the parent")
        pid, _ = start_counter(parent)

        t0 = time.monotonic()
        results = parent.fork(count=4, timeout=300)
        fork_s = time.monotonic() - t0
        children = [r for r in results if not isinstance(r, Exception)]
        assert len(children) == 4, results
        where = _nodes_of(stack, [c.sandbox_id for c in children])
        assert sorted(where.values()) == sorted([stack.node_id] * 2 + [node_b.id] * 2), where
        capture = _db(stack, "from snapshots.models import Snapshot as S; "
                             "print(S.objects.get(fork_capture=True).id)")
        # node B runs its two from a lazy mount of the stored capture, not a download
        assert (node_b.home / "lazy" / "snapshots" / capture / "manifest.json").is_file()
        assert not (node_b.home / "cache" / "snapshots" / capture).exists()
        for c in children:
            assert c.files.read("/home/user/state.txt") == "from the parent"
            assert read_counter(c)[0] == pid, "the child's counter was restarted, not forked"
        print(f"\nFORK x4 over two nodes: {fork_s * 1000:.0f} ms until all four answered the API")
        print(_db(stack, "from sandboxes.models import SandboxEvent as E; "
                         f"e = E.objects.get(sandbox_id='{parent.sandbox_id}', operation='fork', outcome='ok'); "
                         "print('capture', e.duration_ms, 'ms', e.details.get('timings')); "
                         f"e = E.objects.get(sandbox_id='{parent.sandbox_id}', operation='fork', outcome='stored'); "
                         "print('stored (upload)', e.duration_ms, 'ms')"))
        print(_db(stack, "from sandboxes.models import SandboxEvent as E; "
                         f"ids = {[c.sandbox_id for c in children]!r}; "
                         "[print('child', e.details.get('node'), e.duration_ms, 'ms', e.details.get('timings')) "
                         "for e in E.objects.filter(sandbox_id__in=ids, operation='create', outcome='ok')]"))

        parent.kill()
        remote = [c for c in children if where[c.sandbox_id] == node_b.id]
        counts = [read_counter(c)[1] for c in remote]
        time.sleep(0.8)
        assert all(read_counter(c)[1] > n for c, n in zip(remote, counts)), "node B's children stopped"
        assert remote[0].commands.run("echo alive").stdout.strip() == "alive"

        for c in children:
            c.kill()
        children = []
        deadline = time.monotonic() + 60  # the sweeper looks every 10 s
        while _db(stack, f"from snapshots.models import Snapshot as S; print(S.objects.filter(pk='{capture}')"
                         ".exists())") == "True":
            assert time.monotonic() < deadline, stack.log("lifecycle")
            time.sleep(1)
        assert not (node_b.home / "lazy" / "snapshots" / capture).exists()
    finally:
        for c in children:
            c.kill()
        if parent is not None:
            try:
                parent.kill()
            except Exception:  # noqa: BLE001 - killed above
                pass
        node_b.stop()
