"""The chaos bench's invariants, checked while the clients hold (no operation in flight) after
a fault was repaired and the node reconciled:

- every sandbox the API acknowledged is running (with its QEMU), paused (without), killed
  because its client sent a DELETE, or error with an event saying so; never missing, never
  killed or error without a word, never stuck in an operation's state;
- no orphan: no QEMU process of the node home but the running sandboxes', no state dir of a
  sandbox that is neither running nor paused, no RAM file in AENV_SHM_DIR but a running
  sandbox's (and the node's ready-made copies), no network slot (with its nftables table: the
  slot's netns holds it) beyond the running sandboxes' and the warm pool, no stray veth."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from cluster.processes import qemu_pids

SETTLED = ("running", "paused", "killed", "error")


@dataclass(frozen=True)
class NodeView:
    """One node as the checks look at it: its id, home (its VMs' command lines hold it) and
    network instance."""

    node_id: str
    home: Path
    net_prefix: str
    net_pool: str

    @classmethod
    def of(cls, stack) -> "NodeView":
        """A stack's own node."""
        return cls(stack.node_id, stack.home, stack.net_prefix, stack.net_pool)

    def state_dirs(self) -> list[str]:
        sandboxes = self.home / "sandboxes"
        return sorted(p.name for p in sandboxes.iterdir()) if sandboxes.exists() else []


def db_rows(stack, ids: list[str]) -> dict:
    """id -> {state, reason, events: [(operation, outcome, to_state)]} from the stack's database."""
    if not ids:
        return {}
    code = ("import json\nfrom sandboxes.models import Sandbox as S, SandboxEvent as E\n"
            f"ids = {json.dumps(ids)}\nout = {{}}\n"
            "for s in S.objects.filter(pk__in=ids):\n"
            "    out[s.pk] = {'state': s.state, 'reason': s.error_reason or '', 'node': s.node_id, 'events': "
            "[[e.operation, e.outcome, e.to_state] for e in E.objects.filter(sandbox_id=s.pk).order_by('pk')]}\n"
            "print(json.dumps(out))")
    return json.loads(stack.db(code).strip().splitlines()[-1])


def running_ids(stack, node_id: str | None = None) -> list[str]:
    """The running sandboxes of one node (default: the stack's own), or of every node (``"*"``)."""
    node_id = stack.node_id if node_id is None else node_id
    where = "" if node_id == "*" else f"node_id='{node_id}', "
    code = ("from sandboxes.models import Sandbox as S\n"
            f"print(' '.join(S.objects.filter({where}state='running').values_list('pk', flat=True)))")
    return stack.db(code).split()


def settle(stack, ids: list[str], deadline: float = 240) -> dict:
    """The rows once none is in an operation's state (the node's reconcile ends abandoned ones)."""
    end = time.monotonic() + deadline
    while True:
        rows = db_rows(stack, ids)
        if all(r["state"] in SETTLED for r in rows.values()) or time.monotonic() > end:
            return rows
        time.sleep(2)


def sandbox_findings(stack, acked: dict, rows: dict) -> list[str]:
    """What breaks the first invariant, one line per sandbox."""
    out = []
    for sid, seen in acked.items():
        row = rows.get(sid)
        if row is None:
            out.append(f"{sid}: acknowledged ({seen['via']}) but no row: silently gone")
            continue
        state, events = row["state"], row["events"]
        qemu = qemu_pids(sid)  # on whichever node it is
        if state == "running" and len(qemu) != 1:
            out.append(f"{sid}: running but {len(qemu)} QEMU process(es)")
        elif state == "paused" and qemu:
            out.append(f"{sid}: paused but QEMU {qemu} runs")
        elif state == "killed" and not seen["killed"] and not any(e[2] == "killed" for e in events):
            out.append(f"{sid}: killed without a DELETE from its client or an event")
        elif state == "error" and not any(e[2] == "error" or e[0] == "lost" for e in events):
            out.append(f"{sid}: error ({row['reason'][:80]}) without an event")
        elif state not in SETTLED:
            out.append(f"{sid}: stuck {state}")
    return out


def orphan_findings(stack, shm_dir: Path, warm_slots: int, nodes: list[NodeView] | None = None) -> list[str]:
    """What breaks the second invariant on each node (default: the stack's own); the RAM
    tmpfs is the nodes' shared one."""
    from vmm.net import slots  # noqa: PLC0415 - the node's network modules, only when checking

    nodes = nodes or [NodeView.of(stack)]
    many = len(nodes) > 1
    out, running_anywhere = [], set()
    for node in nodes:
        running = set(running_ids(stack, node.node_id))
        running_anywhere |= running
        on = f" on node {node.node_id}" if many else ""
        owned = {pid for sid in running for pid in qemu_pids(str(node.home), sid)}
        stray = sorted(set(qemu_pids(str(node.home))) - owned)
        if stray:
            out.append(f"orphan QEMU processes {stray}{on}")
        dirs = node.state_dirs()
        rows = db_rows(stack, dirs)
        for sid in dirs:
            state = rows.get(sid, {}).get("state", "no row")
            if state not in ("running", "paused"):
                out.append(f"orphan state dir {sid} ({state}){on}")
        if slots.netns_supported():
            used = set()
            for sid in running:
                try:
                    used.add(json.loads((node.home / "sandboxes" / sid / "vm.json").read_text())["net_slot"])
                except (OSError, KeyError, ValueError):
                    pass
            spare = [s.index for s in slots.list_slots(node.net_prefix, node.net_pool) if s.index not in used]
            if len(spare) > warm_slots:
                out.append(f"{len(spare)} slots (netns + nftables table) beyond the running sandboxes', "
                           f"more than the {warm_slots} warm ones{on}")
            veths = slots.stray_veths(node.net_prefix)
            if veths:
                out.append(f"stray veths {veths}{on}")
    for ram in sorted(Path(shm_dir).glob("aenv-*.ram")):
        if ram.name.startswith("aenv-warm-"):
            continue  # the nodes' ready-made copies (vmm.qemu.warm_ram), theirs to keep
        sid = ram.name.removeprefix("aenv-").removesuffix(".ram")
        if sid not in running_anywhere:
            out.append(f"orphan RAM file {ram.name}")
    return out
