"""Keeps a VM's disk chain short while it runs.

Why: every snapshot seals the VM's writable top into its chain, and every later capture copies
the whole chain (a ``cp`` and a ``qemu-img rebase`` per layer) while QEMU keeps each layer open
and looks a cluster up through all of them. In the fourth soak a sandbox's snapshots went from
15 s to 40 s over ~75 layers (docs/benchmarks.md, "Fourth run"). Past a bound, QEMU's
``block-stream`` copies what the layers between the base and the top hold into the top, with
the guest running, and then points the top straight at the base; the caller drops the layers.
If QEMU dies half-way the top still has its old backing chain in its header: nothing is lost.
"""

from __future__ import annotations

import os
import time

from vmm.driver import VMError
from vmm.qemu.qmp import QMP, QMPError


def format_node_of(q: QMP, filename: str) -> str:
    """The node name of the image QEMU opened from ``filename`` (its format node, not the
    file node under it); the base of a chain is opened from the layer above's header, so
    QEMU named it itself."""
    want = os.path.realpath(filename)
    for node in q.execute("query-named-block-nodes", flat=True) or []:
        if node.get("drv") != "file" and os.path.realpath(node.get("file", "")) == want:
            return node["node-name"]
    raise VMError(f"no block node of {filename} in the running QEMU")


def stream_into_top(q: QMP, top_node: str, base_file: str, timeout: float, poll: float = 0.05) -> None:
    """Every layer between ``base_file`` and ``top_node`` streamed into the top; returns once
    QEMU has finished and dropped them from its graph (the top's header names the base).
    On a timeout the job is cancelled (the chain stays as it was) and VMError raised."""
    job = f"stream-{top_node}"
    q.execute("block-stream", **{"job-id": job, "device": top_node, "base-node": format_node_of(q, base_file)})
    deadline = time.monotonic() + timeout
    while any(j.get("device") == job for j in q.execute("query-block-jobs") or []):
        if time.monotonic() > deadline:
            try:
                q.execute("block-job-cancel", device=job, force=True)
            except QMPError:
                pass  # it finished meanwhile: the events below say how
            else:
                raise VMError(f"streaming the disk chain into {top_node} took over {timeout:.0f} s; cancelled")
        time.sleep(poll)
    for event in q.events:
        data = event.get("data") or {}
        if data.get("device") != job:
            continue
        if event.get("event") == "BLOCK_JOB_CANCELLED":
            raise VMError(f"streaming the disk chain into {top_node} was cancelled")
        if event.get("event") == "BLOCK_JOB_COMPLETED" and data.get("error"):
            raise VMError(f"streaming the disk chain into {top_node} failed: {data['error']}")
