"""vmm.qemu.disk_chain against a scripted QMP: which node is the base, when the stream is
done, and what a failed, cancelled or endless stream raises (the real thing:
tests/vmm/test_disk_chain_vm.py)."""

from pathlib import Path

import pytest

from vmm.driver import VMError
from vmm.qemu import disk_chain

NODES = [
    {"node-name": "top3", "drv": "qcow2", "file": "/s/top-3.qcow2"},
    {"node-name": "#block120", "drv": "file", "file": "/img/rootfs.qcow2"},
    {"node-name": "#block121", "drv": "qcow2", "file": "/img/rootfs.qcow2"},
]


class ScriptedQMP:
    """Answers query-named-block-nodes with NODES, block-stream by recording it, and
    query-block-jobs with the job for ``polls`` answers; ``events`` as QEMU would send them."""

    def __init__(self, polls: int = 2, events: list[dict] | None = None, cancel_fails: bool = False):
        self.polls, self.events, self.cancel_fails = polls, [], cancel_fails
        self._pending_events = events or []
        self.calls: list[tuple[str, dict]] = []

    def execute(self, command: str, **arguments):
        self.calls.append((command, arguments))
        if command == "query-named-block-nodes":
            return NODES
        if command == "query-block-jobs":
            if self.polls > 0:
                self.polls -= 1
                return [{"device": "stream-top3", "type": "stream"}]
            self.events.extend(self._pending_events)
            return []
        if command == "block-job-cancel" and self.cancel_fails:
            raise disk_chain.QMPError("block-job-cancel: no such job")
        return {}


def test_streams_into_the_top_down_to_the_base_format_node():
    q = ScriptedQMP(polls=3, events=[{"event": "BLOCK_JOB_COMPLETED", "data": {"device": "stream-top3"}}])
    disk_chain.stream_into_top(q, "top3", "/img/rootfs.qcow2", timeout=5, poll=0)
    assert ("block-stream", {"job-id": "stream-top3", "device": "top3", "base-node": "#block121"}) in q.calls
    assert [c for c, _ in q.calls].count("query-block-jobs") == 4  # waited until the job was gone


def test_a_base_qemu_does_not_have_open_is_an_error():
    with pytest.raises(VMError, match="no block node of /img/other.qcow2"):
        disk_chain.stream_into_top(ScriptedQMP(), "top3", "/img/other.qcow2", timeout=5, poll=0)


def test_a_stream_that_failed_raises():
    q = ScriptedQMP(events=[{"event": "BLOCK_JOB_COMPLETED",
                             "data": {"device": "stream-top3", "error": "No space left on device"}}])
    with pytest.raises(VMError, match="No space left"):
        disk_chain.stream_into_top(q, "top3", "/img/rootfs.qcow2", timeout=5, poll=0)


def test_an_event_of_another_job_is_not_ours():
    q = ScriptedQMP(events=[{"event": "BLOCK_JOB_COMPLETED", "data": {"device": "other", "error": "x"}}])
    disk_chain.stream_into_top(q, "top3", "/img/rootfs.qcow2", timeout=5, poll=0)


def test_a_cancelled_stream_raises():
    q = ScriptedQMP(events=[{"event": "BLOCK_JOB_CANCELLED", "data": {"device": "stream-top3"}}])
    with pytest.raises(VMError, match="cancelled"):
        disk_chain.stream_into_top(q, "top3", "/img/rootfs.qcow2", timeout=5, poll=0)


def test_a_stream_past_its_timeout_is_cancelled():
    q = ScriptedQMP(polls=10**6)
    with pytest.raises(VMError, match="took over 0 s; cancelled"):
        disk_chain.stream_into_top(q, "top3", "/img/rootfs.qcow2", timeout=0, poll=0)
    assert ("block-job-cancel", {"device": "stream-top3", "force": True}) in q.calls


def _state(tmp_path, chain: list[str]):
    from vmm.qemu.state import VMState  # noqa: PLC0415

    s = VMState(sandbox_id="sb", pid=1, accel="tcg", host_address="", host_port=0, state_dir=str(tmp_path),
                top=str(tmp_path / "top-9.qcow2"), qmp=str(tmp_path / "qmp.sock"), console="", pidfile="", ram="",
                image="base", image_dir="", kernel="", initrd="", rootfs=chain[0], tools="", cpu_count=1,
                memory_mb=256, disk_size_mb=2048, argv=[], created_at=0.0, chain=chain, top_node="top9")
    s.save()
    return s


def _layers(tmp_path):
    """A restored sandbox's chain: its snapshot's base and layer (not its own), then two of its own."""
    snap = tmp_path / "snap"
    snap.mkdir()
    files = [snap / "base.qcow2", snap / "layer-0.qcow2", tmp_path / "top.qcow2", tmp_path / "top-1.qcow2"]
    for f in files:
        f.write_text("x")
    return [str(f) for f in files]


def test_own_layers_are_the_ones_above_everything_inherited(tmp_path):
    from vmm.qemu.snapshots import _own_layers  # noqa: PLC0415

    chain = _layers(tmp_path)
    assert _own_layers(_state(tmp_path, chain)) == chain[2:]
    assert _own_layers(_state(tmp_path, chain[:2])) == []
    # an own-looking layer under an inherited one is not the sandbox's to stream away
    assert _own_layers(_state(tmp_path, [chain[0], chain[2], chain[1]])) == []


def test_shorten_chain_streams_down_to_the_last_inherited_layer_and_deletes_the_own_ones(tmp_path,
                                                                                      monkeypatch):
    from vmm.qemu.cmdline import VMPaths  # noqa: PLC0415
    from vmm.qemu.snapshots import SnapshotMixin  # noqa: PLC0415
    from vmm.qemu.state import VMState  # noqa: PLC0415

    chain = _layers(tmp_path)
    state = _state(tmp_path, chain)
    streamed = []
    monkeypatch.setattr("vmm.qemu.snapshots.QMP", lambda *a, **k: _NullQMP())
    monkeypatch.setattr(disk_chain, "stream_into_top", lambda q, top, base, timeout: streamed.append((top, base)))
    driver = SnapshotMixin()
    driver._shorten_chain(state, VMPaths.for_sandbox(tmp_path, "sb"), chain[2:])
    assert streamed == [("top9", chain[1])]  # the snapshot's layers stay under the top, shared
    assert VMState.load(tmp_path).chain == chain[:2]  # durable before any file goes
    assert [Path(c).exists() for c in chain] == [True, True, False, False]  # the snapshot's files stay


def test_a_stream_that_fails_leaves_chain_and_files_as_they_were(tmp_path, monkeypatch):
    from vmm.qemu.cmdline import VMPaths  # noqa: PLC0415
    from vmm.qemu.snapshots import SnapshotMixin  # noqa: PLC0415
    from vmm.qemu.state import VMState  # noqa: PLC0415

    chain = _layers(tmp_path)
    state = _state(tmp_path, chain)
    monkeypatch.setattr("vmm.qemu.snapshots.QMP", lambda *a, **k: _NullQMP())

    def fails(*a, **k):
        raise VMError("streaming the disk chain into top9 failed: No space left on device")

    monkeypatch.setattr(disk_chain, "stream_into_top", fails)
    SnapshotMixin()._shorten_chain(state, VMPaths.for_sandbox(tmp_path, "sb"), chain[2:])
    assert VMState.load(tmp_path).chain == chain
    assert all(Path(c).exists() for c in chain)


class _NullQMP:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
