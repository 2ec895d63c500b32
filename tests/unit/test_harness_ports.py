"""harness.ports: listen ports for child servers come from outside the ephemeral range, in turn
across processes, and skip a port something holds."""
from __future__ import annotations

import multiprocessing
import socket

import pytest

from harness import ports


def _allocate(counter, n, out):
    out.put([ports.free_port(counter) for _ in range(n)])


def test_ports_are_outside_the_ephemeral_range(tmp_path):
    low, high = ports.ephemeral_range()
    got = [ports.free_port(tmp_path / "counter") for _ in range(50)]
    assert all(not (low <= p <= high) for p in got), got
    assert len(set(got)) == 50


def test_processes_side_by_side_never_get_the_same_port(tmp_path):
    counter = tmp_path / "counter"
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    workers = [ctx.Process(target=_allocate, args=(counter, 40, out)) for _ in range(4)]
    for w in workers:
        w.start()
    got = [p for _ in workers for p in out.get(timeout=60)]
    for w in workers:
        w.join(timeout=60)
    assert len(got) == 160 and len(set(got)) == 160


def test_a_port_something_listens_on_is_skipped(tmp_path):
    counter = tmp_path / "counter"
    first = ports.free_port(counter)
    # the next in turn is held by a listener: the allocation goes past it
    with socket.socket() as held:
        held.bind(("127.0.0.1", first + 1))
        held.listen()
        nxt = ports.free_port(counter)
    assert nxt not in (first, first + 1)


def test_the_turn_goes_round_the_block(tmp_path, monkeypatch):
    counter = tmp_path / "counter"
    monkeypatch.setattr(ports, "port_block", lambda: (21000, 21002))
    monkeypatch.setattr(ports, "bindable", lambda port, host="127.0.0.1": port != 21001)
    counter.write_text("21002")
    assert [ports.free_port(counter) for _ in range(3)] == [21002, 21000, 21002]
    monkeypatch.setattr(ports, "bindable", lambda port, host="127.0.0.1": False)
    with pytest.raises(RuntimeError, match="21000-21002"):  # a block with nothing free says so
        ports.free_port(counter)


def test_a_small_ephemeral_low_puts_the_block_above(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (1024, 40000))
    assert ports.port_block() == (40001, 52000)
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (32768, 60999))
    assert ports.port_block() == (20768, 32767)
