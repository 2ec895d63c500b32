"""harness.chaos_checks on two nodes (bench/chaos.py --nodes 2): each node's leftovers are
judged against its own running sandboxes, the RAM tmpfs they share against all of them."""
from __future__ import annotations

import json
import re

from harness.chaos_checks import NodeView, orphan_findings, running_ids

ROWS = {"a1": "running", "a2": "paused", "a3": "killed", "b1": "running", "b2": "error"}
NODE_OF = {"a1": "na", "a2": "na", "a3": "na", "b1": "nb", "b2": "nb"}


class FakeStack:
    """What the checks ask the stack's database, answered from ROWS."""

    node_id, net_prefix, net_pool = "na", "zzchk", "10.250.0.0/20"

    def __init__(self, home):
        self.home = home

    def db(self, code: str) -> str:
        if "values_list('pk'" in code:
            node = re.search(r"node_id='([^']+)'", code)
            return " ".join(s for s, st in ROWS.items() if st == "running" and (node is None or NODE_OF[s] == node[1]))
        ids = json.loads(re.search(r"ids = (\[.*?\])", code)[1])
        return json.dumps({s: {"state": ROWS[s], "reason": "", "node": NODE_OF[s], "events": []}
                           for s in ids if s in ROWS})


def _node(root, node_id, sandboxes):
    home = root / node_id
    for sid in sandboxes:
        (home / "sandboxes" / sid).mkdir(parents=True)
    return NodeView(node_id, home, f"zzchk{node_id}", "10.250.16.0/20")


def test_each_node_is_judged_by_its_own_running_sandboxes_and_the_shared_tmpfs_by_all(tmp_path):
    stack = FakeStack(tmp_path / "na")
    nodes = [_node(tmp_path, "na", ["a1", "a2", "a3"]), _node(tmp_path, "nb", ["b1", "b2"])]
    shm = tmp_path / "shm"
    shm.mkdir()
    for name in ("aenv-a1.ram", "aenv-b1.ram", "aenv-a2.ram", "aenv-warm-base.ram"):
        (shm / name).write_bytes(b"")
    found = orphan_findings(stack, shm, warm_slots=4, nodes=nodes)
    assert sorted(found) == ["orphan RAM file aenv-a2.ram",  # paused: its memory is not in tmpfs
                             "orphan state dir a3 (killed) on node na",
                             "orphan state dir b2 (error) on node nb"], found
    assert running_ids(stack, "*") == ["a1", "b1"] and running_ids(stack) == ["a1"]


def test_one_node_reads_as_before(tmp_path):
    stack = FakeStack(tmp_path / "na")
    _node(tmp_path, "na", ["a1", "a3"])
    shm = tmp_path / "shm"
    shm.mkdir()
    (shm / "aenv-b1.ram").write_bytes(b"")  # running, but on a node this check does not know
    assert sorted(orphan_findings(stack, shm, warm_slots=4)) == ["orphan RAM file aenv-b1.ram",
                                                                 "orphan state dir a3 (killed)"]
