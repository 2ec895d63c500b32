"""A fork larger than the parent's node may hold runs across nodes (issue 24 item 4), with real
VMs and the S3 store (a moto server): with AENV_FORK_MAX_PER_NODE=2 a fork ×4 through the
official SDK puts two children on the parent's node and two on node B, which restores them
lazily from the fork's stored capture. Every child has the parent's file and its running
process (the same pid, still counting); killing the parent leaves node B's children running;
once every child is gone the sweeper releases the capture (its row, node B's lazy mount). The
two nodes and the store are the package's shared S3 two-node stack (conftest.s3_two_nodes, whose
settings include AENV_FORK_MAX_PER_NODE=2)."""
from __future__ import annotations

import time

import pytest
from e2b import Sandbox

from harness.guest_counter import read_counter, start_counter

pytestmark = [pytest.mark.vm, pytest.mark.timeout(900)]


def _db(stack, code: str) -> str:
    return stack.db(code).strip()


def _nodes_of(stack, ids: list[str]) -> dict[str, str]:
    out = _db(stack, "from sandboxes.models import Sandbox as S; "
                     f"print(';'.join(f'{{s.id}}={{s.node_id}}' for s in S.objects.filter(pk__in={ids!r})))")
    return dict(pair.split("=") for pair in out.split(";") if pair)


def test_a_fork_of_four_with_two_a_node_spans_two_nodes(s3_two_nodes):
    stack = s3_two_nodes
    node_b = stack.node_b
    parent, children = None, []
    try:
        _db(stack, f"from nodes.models import Node; Node.objects.filter(pk='{node_b.id}').update(draining=True)")
        try:
            parent = Sandbox.create(timeout=600)
        finally:
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
