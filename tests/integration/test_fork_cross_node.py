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

from harness.guest_counter import read_counter

from .fork_across import db, fork_four, parent_on_node_a

pytestmark = [pytest.mark.vm, pytest.mark.timeout(900)]


def test_a_fork_of_four_with_two_a_node_spans_two_nodes(s3_two_nodes):
    stack = s3_two_nodes
    node_b = stack.node_b
    parent, children = None, []
    try:
        parent, pid = parent_on_node_a(stack, node_b.id)
        children, where, fork_s = fork_four(stack, parent, node_b.id)
        capture = db(stack, "from snapshots.models import Snapshot as S; "
                            "print(S.objects.get(fork_capture=True).id)")
        # node B runs its two from a lazy mount of the stored capture, not a download
        assert (node_b.home / "lazy" / "snapshots" / capture / "manifest.json").is_file()
        assert not (node_b.home / "cache" / "snapshots" / capture).exists()
        for c in children:
            assert c.files.read("/home/user/state.txt") == "from the parent"
            assert read_counter(c)[0] == pid, "the child's counter was restarted, not forked"
        print(f"\nFORK x4 over two nodes: {fork_s * 1000:.0f} ms until all four answered the API")
        print(db(stack, "from sandboxes.models import SandboxEvent as E; "
                        f"e = E.objects.get(sandbox_id='{parent.sandbox_id}', operation='fork', outcome='ok'); "
                        "print('capture', e.duration_ms, 'ms', e.details.get('timings')); "
                        f"e = E.objects.get(sandbox_id='{parent.sandbox_id}', operation='fork', outcome='stored'); "
                        "print('stored (upload)', e.duration_ms, 'ms')"))
        print(db(stack, "from sandboxes.models import SandboxEvent as E; "
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
        while db(stack, f"from snapshots.models import Snapshot as S; print(S.objects.filter(pk='{capture}')"
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
