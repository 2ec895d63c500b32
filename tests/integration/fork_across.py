"""What the cross-node fork tests share: a parent on the stack's own node (node B drained while
it is made), with a file and a counting process, forked ×4 through the official SDK over the
two nodes of ``AENV_FORK_MAX_PER_NODE=2``."""
from __future__ import annotations

import time

from e2b import Sandbox

from harness.guest_counter import start_counter


def db(stack, code: str) -> str:
    return stack.db(code).strip()


def nodes_of(stack, ids: list[str]) -> dict[str, str]:
    out = db(stack, "from sandboxes.models import Sandbox as S; "
                    f"print(';'.join(f'{{s.id}}={{s.node_id}}' for s in S.objects.filter(pk__in={ids!r})))")
    return dict(pair.split("=") for pair in out.split(";") if pair)


def parent_on_node_a(stack, node_b_id: str) -> tuple[Sandbox, int]:
    """The parent (on the stack's node) with ``/home/user/state.txt`` and its counter's pid."""
    db(stack, f"from nodes.models import Node; Node.objects.filter(pk='{node_b_id}').update(draining=True)")
    try:
        parent = Sandbox.create(timeout=600)
    finally:
        db(stack, f"from nodes.models import Node; Node.objects.filter(pk='{node_b_id}').update(draining=False)")
    parent.files.write("/home/user/state.txt", "from the parent")
    pid, _ = start_counter(parent)
    return parent, pid


def fork_four(stack, parent: Sandbox, node_b_id: str) -> tuple[list[Sandbox], dict[str, str], float]:
    """The four children (two a node), where each runs, and the seconds until the API answered."""
    t0 = time.monotonic()
    results = parent.fork(count=4, timeout=300)
    fork_s = time.monotonic() - t0
    children = [r for r in results if not isinstance(r, Exception)]
    assert len(children) == 4, results
    where = nodes_of(stack, [c.sandbox_id for c in children])
    assert sorted(where.values()) == sorted([stack.node_id] * 2 + [node_b_id] * 2), where
    return children, where, fork_s
